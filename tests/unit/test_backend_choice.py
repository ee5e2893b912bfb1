"""Experts kt-kernel cannot compute: the torch backend computes them as vLLM's kernels
define them (checked against a per-token reference written from those definitions), and
``hybrid.backend_choice`` picks it for such layers unless KT_BACKEND says otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, ExpertMath, LayerSpec
from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts
from vllm_kt_plugin.cpu_backends.torch_backend import TorchExperts
from vllm_kt_plugin.hybrid.backend_choice import backend_for
from vllm_kt_plugin.planning.placement import ExpertPlacement
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.variables import KTSettings

E, H, W = 4, 16, 8  # experts, hidden, expert width


def _backend(math: ExpertMath, gated: bool = True) -> tuple[TorchExperts, dict[str, torch.Tensor]]:
    """A torch backend with experts 2 and 3 on the CPU, given random experts in vLLM's layout."""
    placement = ExpertPlacement.first_n(E, 2)
    spec = LayerSpec("model.layers.0.mlp.experts", 0, E, 2, H, W, placement, 64, "m", math=math)
    backend = TorchExperts(spec, KTSettings(backend="torch"))
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w13_weight": torch.randn(2, 2 * W if gated else W, H, generator=gen),
        "w2_weight": torch.randn(2, H, W, generator=gen),
        "w13_bias": torch.randn(2, 2 * W if gated else W, generator=gen),
        "w2_bias": torch.randn(2, H, generator=gen),
    }
    backend.load_loaded_experts(tensors)
    backend.finalize_weights(0)
    return backend, tensors


def _run(backend: TorchExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    backend.submit(x, ids, weights)
    return backend.sync(x)


X = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
IDS = torch.tensor([[2, 0], [3, 2], [1, 0]])  # token 2 picks GPU experts only
WEIGHTS = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])


def _reference(expert: torch.Tensor, tensors: dict, row: int, x: torch.Tensor, bias: bool) -> torch.Tensor:
    h = x @ tensors["w13_weight"][row].T + (tensors["w13_bias"][row] if bias else 0)
    return expert(h) @ tensors["w2_weight"][row].T + (tensors["w2_bias"][row] if bias else 0)


def _expected(expert, tensors: dict, bias: bool, on_input: bool = False) -> torch.Tensor:  # noqa: ANN001
    out = torch.zeros_like(X)
    for t in range(X.shape[0]):
        for k in range(IDS.shape[1]):
            e, w = int(IDS[t, k]), float(WEIGHTS[t, k])
            if e >= 2:  # a CPU expert, row e - 2
                out[t] += (
                    _reference(expert, tensors, e - 2, X[t] * w, bias)
                    if on_input
                    else w * _reference(expert, tensors, e - 2, X[t], bias)
                )
    return out


def test_silu_gated_experts() -> None:
    backend, tensors = _backend(ExpertMath())
    expected = _expected(lambda h: F.silu(h[:W]) * h[W:], tensors, bias=False)
    assert torch.allclose(_run(backend, X, IDS, WEIGHTS), expected, atol=1e-4)


def test_gpt_oss_experts_interleaved_with_biases_and_a_clamp() -> None:
    """vLLM's swigluoai: gate and up interleaved, clamped at the layer's limit, (up + 1) *
    gate * sigmoid(alpha * gate), biases on both projections."""
    math = ExpertMath(activation="swigluoai", has_bias=True, clamp=7.0, alpha=1.702)
    backend, tensors = _backend(math)

    def expert(h: torch.Tensor) -> torch.Tensor:
        gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)

    assert torch.allclose(_run(backend, X, IDS, WEIGHTS), _expected(expert, tensors, bias=True), atol=1e-3)


def test_minimax_m3_experts_as_vllms_silu_and_mul_with_clamp() -> None:
    """vLLM's swigluoai_uninterleave: gate and up in w13's halves, computed by vLLM's
    SiluAndMulWithClamp (its forward_native, vLLM's own definition) with the layer's limit,
    alpha and beta; kt-kernel cannot compute it, so the torch backend serves the layer."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.activation import SiluAndMulWithClamp

    op = SimpleNamespace(swiglu_limit=1.5, alpha=1.702, beta=1.0)
    math = ExpertMath(activation="swigluoai_uninterleave", clamp=op.swiglu_limit, alpha=op.alpha, beta=op.beta)
    backend, tensors = _backend(math)
    expected = _expected(lambda h: SiluAndMulWithClamp.forward_native(op, h), tensors, bias=False)
    assert torch.allclose(_run(backend, X, IDS, WEIGHTS), expected, atol=1e-4)
    assert KTKernelExperts.cannot_compute(math) is not None and TorchExperts.cannot_compute(math) is None
    assert backend_for("layer", math, KTKernelExperts, KTSettings(), CheckpointFormat()) is TorchExperts
    # an offset the torch backend's other activations do not take, and vLLM's required limit
    assert "offsets" in (TorchExperts.cannot_compute(ExpertMath(beta=1.0)) or "")
    assert "swiglu_limit" in (TorchExperts.cannot_compute(replace(math, clamp=None)) or "")


def test_router_weights_on_the_input_and_a_clamped_silu() -> None:
    math = ExpertMath(clamp=0.5, router_weight_on_input=True)
    backend, tensors = _backend(math)
    expected = _expected(lambda h: F.silu(h[:W].clamp(max=0.5)) * h[W:].clamp(-0.5, 0.5), tensors, False, True)
    assert torch.allclose(_run(backend, X, IDS, WEIGHTS), expected, atol=1e-4)


def test_non_gated_relu2_experts() -> None:
    backend, tensors = _backend(ExpertMath(activation="relu2_no_mul"), gated=False)
    expected = _expected(lambda h: F.relu(h).square(), tensors, bias=False)
    assert torch.allclose(_run(backend, X, IDS, WEIGHTS), expected, atol=1e-3)


def test_who_computes_what() -> None:
    plain = ExpertMath()
    assert KTKernelExperts.cannot_compute(plain) is None and TorchExperts.cannot_compute(plain) is None
    for math in (ExpertMath(has_bias=True), ExpertMath(activation="gelu"), ExpertMath(router_weight_on_input=True)):
        assert KTKernelExperts.cannot_compute(math) is not None and TorchExperts.cannot_compute(math) is None
    assert "situ" in (TorchExperts.cannot_compute(ExpertMath(activation="situ")) or "")


SETTINGS = KTSettings(backend="kt_kernel", method="BF16")
BIASED = ExpertMath(has_bias=True)


def test_the_torch_backend_computes_what_kt_kernel_cannot_when_kt_backend_is_unset() -> None:
    assert backend_for("layer", ExpertMath(), KTKernelExperts, SETTINGS, CheckpointFormat()) is KTKernelExperts
    assert backend_for("layer", BIASED, KTKernelExperts, SETTINGS, CheckpointFormat()) is TorchExperts


def test_a_chosen_backend_that_cannot_is_refused_in_one_line() -> None:
    chosen = replace(SETTINGS, given=(("KT_BACKEND", "kt_kernel"),))
    with pytest.raises(KTConfigError, match="KT_BACKEND='kt_kernel' is invalid.*biases"):
        backend_for("layer", BIASED, KTKernelExperts, chosen, CheckpointFormat())


def test_experts_no_backend_computes_are_refused_in_one_line() -> None:
    with pytest.raises(KTConfigError, match="no CPU backend computes the experts of layer: .*fp8-quantized") as error:
        backend_for("layer", BIASED, KTKernelExperts, SETTINGS, CheckpointFormat("fp8"))
    assert "\n" not in str(error.value)
    with pytest.raises(KTConfigError, match="no situ activation"):
        backend_for("layer", ExpertMath(activation="situ"), KTKernelExperts, SETTINGS, CheckpointFormat())
