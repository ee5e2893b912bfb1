"""CPU experts in plain PyTorch: exact (float32) and slow.

It computes whatever vLLM's experts compute (``ExpertMath``: the activations of vLLM's
MoE kernels, biases, SwiGLU's clamp and scale, router weights on the input), from the
experts as vLLM's own loader wrote them (``takes_loaded_experts``: any checkpoint layout).
So it is the reference the other backends are compared with, the backend for machines
without kt-kernel, and the one that serves layers kt-kernel cannot compute (the plugin
picks it for those unless KT_BACKEND says otherwise: ``hybrid.backend_choice``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat, CPUExperts, ExpertMath, LayerSpec
from vllm_kt_plugin.hookspecs import hookimpl
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.variables import KTSettings

# gpt-oss's SwiGLU where the layer states no limit or scale (vLLM's kernels use these).
_OAI_LIMIT, _OAI_ALPHA = 7.0, 1.702


def _halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def _clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def _silu(h: torch.Tensor, math: ExpertMath) -> torch.Tensor:
    gate, up = _clamped(*_halves(h), math.clamp)  # DeepSeek-V4: SiLU with a clamp
    return F.silu(gate) * up


def _swigluoai(h: torch.Tensor, math: ExpertMath) -> torch.Tensor:
    """gpt-oss: gate and up interleaved in w13's rows, (up + 1) * gate * sigmoid(alpha * gate)."""
    limit = _OAI_LIMIT if math.clamp is None else math.clamp
    alpha = _OAI_ALPHA if math.alpha is None else math.alpha
    gate, up = _clamped(h[..., 0::2], h[..., 1::2], limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def _swigluoai_uninterleave(h: torch.Tensor, math: ExpertMath) -> torch.Tensor:
    """MiniMax-M3: gate and up in w13's halves, gate * sigmoid(alpha * gate) * (up + beta)
    (vLLM's SiluAndMulWithClamp; alpha 1 and beta 0 where the layer states none)."""
    alpha = 1.0 if math.alpha is None else math.alpha
    beta = 0.0 if math.beta is None else math.beta
    gate, up = _clamped(*_halves(h), math.clamp)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


# vLLM's MoEActivation value -> the expert's activation on x @ w13.T (+ bias).
ACTIVATIONS: Mapping[str, Callable[[torch.Tensor, ExpertMath], torch.Tensor]] = {
    "silu": _silu,
    "gelu": lambda h, m: F.gelu(_halves(h)[0]) * _halves(h)[1],
    "gelu_tanh": lambda h, m: F.gelu(_halves(h)[0], approximate="tanh") * _halves(h)[1],
    "swigluoai": _swigluoai,
    "swigluoai_uninterleave": _swigluoai_uninterleave,
    "silu_no_mul": lambda h, m: F.silu(h),
    "gelu_no_mul": lambda h, m: F.gelu(h),
    "gelu_tanh_no_mul": lambda h, m: F.gelu(h, approximate="tanh"),
    "relu2_no_mul": lambda h, m: F.relu(h).square(),
}

# the activations that take the layer's alpha
_SCALED = ("swigluoai", "swigluoai_uninterleave")


class TorchExperts(CPUExperts):
    name: ClassVar[str] = "torch"
    takes_loaded_experts: ClassVar[bool] = True

    @classmethod
    def cannot_compute(cls, math: ExpertMath) -> str | None:
        if math.activation not in ACTIVATIONS:
            return f"the torch backend has no {math.activation} activation (it has {', '.join(ACTIVATIONS)})"
        if math.alpha is not None and math.activation not in _SCALED:
            return f"the torch backend scales SwiGLU only in {' and '.join(_SCALED)}, not in {math.activation}"
        if math.beta is not None and math.activation != "swigluoai_uninterleave":
            return f"the torch backend offsets SwiGLU's up only in swigluoai_uninterleave, not in {math.activation}"
        if math.activation == "swigluoai_uninterleave" and math.clamp is None:
            return "swigluoai_uninterleave without a swiglu_limit (vLLM's kernels require one)"
        return None

    @classmethod
    def default_method(cls, checkpoint: CheckpointFormat) -> str:
        return "BF16"

    @classmethod
    def validate(cls, settings: KTSettings, checkpoint: CheckpointFormat) -> None:
        if settings.method not in (None, "BF16"):
            raise KTConfigError(
                "KT_METHOD", settings.method, "KT_BACKEND=torch computes BF16 experts only", "BF16 (or unset)"
            )
        if checkpoint.quant_method is not None:
            raise KTConfigError(
                "KT_BACKEND",
                "torch",
                f"KT_BACKEND=torch computes from unquantized expert tensors, but this checkpoint is "
                f"{checkpoint.quant_method}-quantized",
                "kt_kernel for a quantized checkpoint",
            )
        if settings.max_deferred_experts_per_token:
            raise KTConfigError(
                "KT_MAX_DEFERRED_EXPERTS_PER_TOKEN",
                str(settings.max_deferred_experts_per_token),
                "KT_BACKEND=torch does not defer experts; use 0",
            )
        if settings.weight_path is not None:
            raise KTConfigError(
                "KT_WEIGHT_PATH", settings.weight_path, "KT_BACKEND=torch reads no weight files; unset it"
            )

    def __init__(self, spec: LayerSpec, settings: KTSettings) -> None:
        super().__init__(spec, settings)
        self.cpu_experts = spec.placement.cpu_expert_ids()
        self._index = {e: i for i, e in enumerate(self.cpu_experts)}
        self.activation = ACTIVATIONS[spec.math.activation]
        self.w13 = self.w2 = torch.empty(0)
        self.b13: torch.Tensor | None = None
        self.b2: torch.Tensor | None = None
        self._loaded = False
        self._result: torch.Tensor | None = None

    def describe(self) -> str:
        # KT_METHOD=BF16 names what it accepts; it computes in float32, on torch's own threads
        return f"torch float32 with {torch.get_num_threads()} threads"

    def load_loaded_experts(self, tensors: Mapping[str, torch.Tensor]) -> None:
        def f32(name: str) -> torch.Tensor | None:
            tensor = tensors.get(name)
            return None if tensor is None else tensor.detach().to("cpu", torch.float32, copy=True)

        w13, w2 = f32("w13_weight"), f32("w2_weight")
        if w13 is None or w2 is None:
            raise RuntimeError(f"kt-hybrid: {self.spec.layer_name}: vLLM's layer holds no w13_weight/w2_weight")
        self.w13, self.w2 = w13, w2
        self.b13, self.b2 = (f32("w13_bias"), f32("w2_bias")) if self.spec.math.has_bias else (None, None)
        self._loaded = True

    def finalize_weights(self, max_deferred_experts_per_token: int) -> None:
        if self._loaded or not self.cpu_experts:
            return
        if self.spec.load_format != "dummy":
            raise RuntimeError(f"kt-hybrid: {self.spec.layer_name}: the CPU experts were never loaded")
        n, h, i = len(self.cpu_experts), self.spec.hidden_size, self.spec.intermediate_size
        gen = torch.Generator().manual_seed(self.spec.layer_idx)
        gated = not self.spec.math.activation.endswith("_no_mul")
        self.w13 = torch.randn(n, 2 * i if gated else i, h, generator=gen) * 0.02
        self.w2 = torch.randn(n, h, i, generator=gen) * 0.02

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        xs = x.detach().to("cpu", torch.float32)
        ids = topk_ids.to("cpu", torch.long)
        weights = topk_weights.to("cpu", torch.float32)
        on_input = self.spec.math.router_weight_on_input
        out = torch.zeros_like(xs)
        for expert in ids.unique().tolist():
            idx = self._index.get(expert)
            if idx is None:  # a GPU expert
                continue
            tokens, picks = torch.nonzero(ids == expert, as_tuple=True)
            w = weights[tokens, picks, None]
            inputs = xs[tokens] * w if on_input else xs[tokens]
            h = inputs @ self.w13[idx].T
            if self.b13 is not None:
                h = h + self.b13[idx]
            y = self.activation(h, self.spec.math) @ self.w2[idx].T
            if self.b2 is not None:
                y = y + self.b2[idx]
            out.index_add_(0, tokens, y if on_input else w * y)
        self._result = out

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        assert self._result is not None, "sync() without submit()"
        result, self._result = self._result, None
        return result.to(x.device, x.dtype)


@hookimpl
def kt_cpu_backends() -> dict[str, type[CPUExperts]]:
    return {TorchExperts.name: TorchExperts}
