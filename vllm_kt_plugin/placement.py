"""Which experts of a layer live on the GPU: a boolean mask per layer.

The native (GPU) method sees only its own experts, numbered 0..n_gpu-1 ("slots");
``gpu_slot_of`` maps the model's expert ids to those slots, -1 for CPU experts. Any
subset of experts is representable; the default is the first ``KT_NUM_GPU_EXPERTS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# KT_EXPERT_PLACEMENT values: which experts of each layer go to the GPU.
PLACEMENT_STRATEGIES = ("uniform", "front-loading", "random", "frequency")


@dataclass(frozen=True)
class ExpertPlacement:
    gpu_mask: torch.Tensor  # bool[num_experts] on the CPU; True = expert on the GPU

    # Counts are plain ints, fixed at construction: forward code (traced by
    # torch.compile on vLLM's CPU platform) branches on them.
    num_experts: int = field(init=False)
    num_gpu_experts: int = field(init=False)

    def __post_init__(self) -> None:
        if self.gpu_mask.dtype != torch.bool or self.gpu_mask.dim() != 1:
            raise ValueError("gpu_mask must be a 1-D bool tensor")
        object.__setattr__(self, "gpu_mask", self.gpu_mask.detach().to("cpu").clone())
        object.__setattr__(self, "num_experts", int(self.gpu_mask.numel()))
        object.__setattr__(self, "num_gpu_experts", int(self.gpu_mask.sum()))

    @classmethod
    def first_n(cls, num_experts: int, num_gpu_experts: int) -> ExpertPlacement:
        if not 0 <= num_gpu_experts <= num_experts:
            raise ValueError(f"num_gpu_experts={num_gpu_experts} not in [0, {num_experts}]")
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[:num_gpu_experts] = True
        return cls(mask)

    @classmethod
    def from_gpu_experts(cls, num_experts: int, gpu_experts: list[int]) -> ExpertPlacement:
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[torch.tensor(gpu_experts, dtype=torch.long)] = True
        return cls(mask)

    @property
    def num_cpu_experts(self) -> int:
        return self.num_experts - self.num_gpu_experts

    def gpu_experts(self) -> list[int]:
        return torch.nonzero(self.gpu_mask).flatten().tolist()

    def cpu_experts(self) -> list[int]:
        return torch.nonzero(~self.gpu_mask).flatten().tolist()

    def gpu_slot_of(self) -> torch.Tensor:
        """int32[num_experts]: the GPU slot of each expert, -1 for CPU experts."""
        slots = torch.full((self.num_experts,), -1, dtype=torch.int32)
        slots[self.gpu_mask] = torch.arange(self.num_gpu_experts, dtype=torch.int32)
        return slots

    def describe(self) -> str:
        gpu = self.gpu_experts()
        first_n = gpu == list(range(len(gpu)))
        shown = f"[0..{len(gpu) - 1}]" if first_n and gpu else str(gpu)
        return f"{self.num_gpu_experts} GPU experts {shown}, {self.num_cpu_experts} CPU experts"


def route_to_gpu_slots(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, gpu_slot_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing for the native method: expert ids become GPU slots; picks that went to a
    CPU expert point at slot 0 with weight 0, so they add nothing.

    Every vLLM MoE kernel accepts in-range ids, while support for -1 ids or an
    ``expert_map`` differs per kernel (vLLM's CPU kernels ignore it); a zero weight is
    correct everywhere.
    """
    slots = gpu_slot_of[topk_ids.long()]
    on_cpu = slots < 0
    weights = topk_weights.masked_fill(on_cpu, 0.0)
    return slots.clamp_min(0).to(topk_ids.dtype), weights
