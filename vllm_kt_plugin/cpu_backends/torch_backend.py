"""CPU experts in plain PyTorch: exact (float32) and slow.

For tests, as the reference the other backends are compared with, and for machines
without kt-kernel. It computes from the checkpoint's own (unquantized) expert tensors,
which it receives while vLLM loads the model.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_kt_plugin.cpu_backends.base import EXPERT_SHARDS, CheckpointFormat, CPUExperts, LayerSpec
from vllm_kt_plugin.hookspecs import hookimpl
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.variables import KTSettings


class TorchExperts(CPUExperts):
    name: ClassVar[str] = "torch"

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
        self._shards: dict[tuple[int, str], torch.Tensor] = {}
        self.gate = self.up = self.down = torch.empty(0)
        self._result: torch.Tensor | None = None

    def load_checkpoint_tensor(self, expert_id: int, shard_id: str, tensor: torch.Tensor) -> None:
        if shard_id in EXPERT_SHARDS and tensor.is_floating_point():
            self._shards[(expert_id, shard_id)] = tensor.detach().to("cpu", torch.float32, copy=True)

    def _stack(self, shard_id: str, shape: tuple[int, int]) -> torch.Tensor:
        missing = [e for e in self.cpu_experts if (e, shard_id) not in self._shards]
        if missing and self.spec.load_format != "dummy":
            raise RuntimeError(
                f"kt-hybrid: {self.spec.layer_name}: the checkpoint gave no {shard_id} tensor for CPU experts {missing}"
            )
        gen = torch.Generator().manual_seed(self.spec.layer_idx)
        return (
            torch.stack(
                [self._shards.get((e, shard_id), torch.randn(shape, generator=gen) * 0.02) for e in self.cpu_experts]
            )
            if self.cpu_experts
            else torch.empty(0, *shape)
        )

    def finalize_weights(self, max_deferred_experts_per_token: int) -> None:
        h, i = self.spec.hidden_size, self.spec.intermediate_size
        self.gate = self._stack("w1", (i, h))
        self.up = self._stack("w3", (i, h))
        self.down = self._stack("w2", (h, i))
        self._shards.clear()

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        xs = x.detach().to("cpu", torch.float32)
        ids = topk_ids.to("cpu", torch.long)
        weights = topk_weights.to("cpu", torch.float32)
        out = torch.zeros_like(xs)
        for expert in ids.unique().tolist():
            idx = self._index.get(expert)
            if idx is None:  # a GPU expert
                continue
            tokens, picks = torch.nonzero(ids == expert, as_tuple=True)
            h = F.silu(xs[tokens] @ self.gate[idx].T) * (xs[tokens] @ self.up[idx].T)
            out.index_add_(0, tokens, weights[tokens, picks, None] * (h @ self.down[idx].T))
        self._result = out

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        assert self._result is not None, "sync() without submit()"
        result, self._result = self._result, None
        return result.to(x.device, x.dtype)


@hookimpl
def kt_cpu_backends() -> dict[str, type[CPUExperts]]:
    return {TorchExperts.name: TorchExperts}
