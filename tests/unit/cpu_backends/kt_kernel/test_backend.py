"""kt-kernel's CPU experts (``cpu_backends/kt_kernel/backend.py``) inside real vLLM MoE layers:
against the dense reference, quantized online (AMX) and cached, and written back in the GPU layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kt_testing.hardware import kt_variant, requires_kernel, skip_without_kernel
from kt_testing.hybrid_layers import E, K, assert_close, kt_config, write_kt_checkpoint

from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
from vllm_kt_plugin.planning.placement import ExpertPlacement
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_tools.support.moe_layers import (
    HIDDEN,
    build_moe,
    fresh_layer_index,
    load,
    random_experts,
    random_routing,
    reference_moe,
)


@pytest.mark.parametrize("num_gpu", [0, 4])
def test_kt_kernel_backend_matches_dense_reference(vllm_layer_context, tmp_path: Path, num_gpu: int) -> None:
    """Real kt-kernel BF16 experts (reading their own safetensors) in two consecutive vLLM
    layers, called in turn with one batch size: kt-kernel reuses its buffers per batch
    size and alternates them between layers, so stale results would show."""
    idx = fresh_layer_index()
    layers = {idx: random_experts(E, seed=21 + num_gpu), idx + 1: random_experts(E, seed=31 + num_gpu)}
    assert fresh_layer_index() == idx + 1
    write_kt_checkpoint(tmp_path, layers)
    config = kt_config(kt_weight_path=str(tmp_path), kt_num_gpu_experts=str(num_gpu), kt_cpuinfer="1")
    runners = {i: build_moe(config, layer_idx=i) for i in layers}
    for i, runner in runners.items():
        load(runner, layers[i])
        assert type(runner.routed_experts.quant_method.cpu).__name__ == "KTKernelExperts"
    for step in range(3):
        for i, runner in runners.items():
            layer = runner.routed_experts
            x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(10 * step + i)).to(torch.bfloat16)
            ids, weights = random_routing(8, E, K, seed=100 * step + i)
            out = layer.quant_method.apply(layer, x, weights, ids, None, None)
            assert_close(out, reference_moe(x, ids, weights, layers[i]))


# AMXINT8 quantization error on these random experts: ~2 % of the output norm (FACTS:
# 0.027 at the Qwen3 shape); 6 % bounds it with room, and catches missing experts (100 %).
AMXINT8_REL_ERR = 0.06


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_cpu(cpu, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    cpu.submit(x, ids, weights)
    return cpu.sync(x).clone()


def online_config(cache: Path, num_gpu: int) -> KTHybridConfig:
    return kt_config(kt_method="AMXINT8", kt_cache_dir=str(cache), kt_num_gpu_experts=str(num_gpu), kt_cpuinfer="1")


@requires_kernel("AMXINT8")
def test_online_amx_weights_are_quantized_once_and_cached(vllm_layer_context, tmp_path: Path) -> None:
    """AMXINT8 without KT_WEIGHT_PATH: the layer is quantized from the tensors vLLM loads
    (GPU experts' too), cached, and a later start with another placement loads the cache."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts

    cache = tmp_path / "cache"
    runner = build_moe(online_config(cache, num_gpu=3))
    layer = runner.routed_experts
    method = layer.quant_method
    experts = random_experts(E, seed=41)
    load(runner, experts)
    folder = method.cpu.cache
    idx = method.cpu.spec.layer_idx
    assert folder is not None and folder.is_relative_to(cache)
    assert (folder / f"_layer_{idx}" / "vllm-kt.json").is_file()
    assert not method.cpu.wants_all_experts
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    ids, weights = random_routing(16, E, K, seed=43)
    assert rel_err(method.apply(layer, x, weights, ids, None, None), reference_moe(x, ids, weights, experts)) < (
        AMXINT8_REL_ERR
    )

    # Next start, every expert on the CPU: nothing is handed over, all 8 come from the cache.
    spec = method.cpu.spec
    everything_on_cpu = ExpertPlacement.first_n(E, 0)
    again = KTKernelExperts(type(spec)(**{**spec.__dict__, "placement": everything_on_cpu}), method.settings)
    assert again.cache == folder and not again.wants_all_experts
    marker_time = (folder / f"_layer_{idx}" / "vllm-kt.json").stat().st_mtime_ns
    again.finalize_weights(0)
    assert (folder / f"_layer_{idx}" / "vllm-kt.json").stat().st_mtime_ns == marker_time
    assert rel_err(run_cpu(again, x, ids, weights), reference_moe(x, ids, weights, experts)) < AMXINT8_REL_ERR


@requires_kernel("AMXINT8")
def test_online_amx_weights_under_dummy_load_format(vllm_layer_context, tmp_path: Path) -> None:
    """load_format=dummy hands over no tensors: the CPU experts get random weights in
    vLLM's dummy range, cached apart from real weights; a real load missing them fails."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts

    method = build_moe(online_config(tmp_path, num_gpu=2)).routed_experts.quant_method
    spec = type(method.cpu.spec)(**{**method.cpu.spec.__dict__, "load_format": "dummy"})
    dummy = KTKernelExperts(spec, method.settings)
    assert dummy.cache != method.cpu.cache and dummy.wants_all_experts
    dummy.finalize_weights(0)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(44)).to(torch.bfloat16)
    ids, weights = random_routing(4, E, K, seed=45)
    out = run_cpu(dummy, x, ids, weights)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    with pytest.raises(RuntimeError, match="lacked 24 of the 24 expert"):
        method.cpu.finalize_weights(0)


def test_amx_sizes_kt_kernel_cannot_tile_are_refused(
    vllm_layer_context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kt-kernel's AMXINT4 kernels need multiples of 128 (it fails or crashes otherwise).
    The size check runs before any kernel does, so it holds on CPUs without the kernel."""
    from vllm_kt_plugin.cpu_backends.kt_kernel import backend

    monkeypatch.setattr(backend, "kernel_available", lambda method: True)
    config = kt_config(kt_method="AMXINT4", kt_cache_dir=str(tmp_path), kt_num_gpu_experts="2")
    with pytest.raises(KTConfigError, match="multiples of 128; this model has 128 and 64"):
        build_moe(config)


def test_kt_kernel_writes_bf16_experts_in_the_gpu_layout(vllm_layer_context, tmp_path: Path) -> None:
    """kt-kernel's BF16 experts written back (staging without a host copy) are the
    checkpoint's: w13 = gate then up, w2 = down, in the order asked."""
    skip_without_kernel("BF16")
    idx = fresh_layer_index()
    experts = random_experts(E, seed=41)
    write_kt_checkpoint(tmp_path, {idx: experts})
    runner = build_moe(kt_config(kt_weight_path=str(tmp_path), kt_num_gpu_experts="2", kt_cpuinfer="1"), layer_idx=idx)
    load(runner, experts)
    cpu = runner.routed_experts.quant_method.cpu
    if not cpu.writes_gpu_layout:
        pytest.skip(f"this CPU's kt-kernel build ({kt_variant()}) cannot write BF16 experts back")
    inter, hidden = experts[0]["gate_proj"].shape
    ids = [5, 2, 7]
    w13 = torch.zeros(len(ids), 2 * inter, hidden, dtype=torch.bfloat16)
    w2 = torch.zeros(len(ids), hidden, inter, dtype=torch.bfloat16)
    cpu.write_gpu_layout(ids, {"w13_weight": w13, "w2_weight": w2})
    for row, expert in enumerate(ids):
        assert torch.equal(w13[row], torch.cat([experts[expert]["gate_proj"], experts[expert]["up_proj"]]))
        assert torch.equal(w2[row], experts[expert]["down_proj"])
    # kt-kernel writes through raw pointers: a tensor-parallel shard or another dtype is refused.
    with pytest.raises(ValueError, match="cannot write experts"):
        cpu.write_gpu_layout(ids, {"w13_weight": w13[:, :inter], "w2_weight": w2[..., : inter // 2]})
    with pytest.raises(ValueError, match="bfloat16"):
        cpu.write_gpu_layout(ids, {"w13_weight": w13.half(), "w2_weight": w2.half()})
