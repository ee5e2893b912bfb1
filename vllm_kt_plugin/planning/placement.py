"""Which experts of a layer live on the GPU: a boolean mask per layer.

The native (GPU) method sees only its own experts, numbered 0..n_gpu-1 ("slots");
``gpu_slot_of`` maps the model's expert ids to those slots, -1 for CPU experts. Any
subset of experts is representable; ``KT_EXPERT_PLACEMENT`` picks it per layer
(``plan_placements``): the first N (uniform, the default), more in earlier layers
(front-loading), a seeded random N, or the N most-picked in a routing profile (frequency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_kt_plugin.settings.catalogue import PLACEMENT_STRATEGIES
from vllm_kt_plugin.settings.routing_profile import RoutingProfile, load_routing_profile

if TYPE_CHECKING:
    from vllm_kt_plugin.settings.variables import KTSettings


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
    def from_gpu_expert_ids(cls, num_experts: int, gpu_expert_ids: list[int]) -> ExpertPlacement:
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[torch.tensor(gpu_expert_ids, dtype=torch.long)] = True
        return cls(mask)

    @property
    def num_cpu_experts(self) -> int:
        return self.num_experts - self.num_gpu_experts

    def gpu_expert_ids(self) -> list[int]:
        return torch.nonzero(self.gpu_mask).flatten().tolist()

    def cpu_expert_ids(self) -> list[int]:
        return torch.nonzero(~self.gpu_mask).flatten().tolist()

    def gpu_slot_of(self) -> torch.Tensor:
        """int32[num_experts]: the GPU slot of each expert, -1 for CPU experts."""
        return _slots(self.gpu_mask)

    def cpu_slot_of(self) -> torch.Tensor:
        """int32[num_experts]: each CPU expert's index among the CPU experts, -1 for GPU
        experts (the order of staging's host copy)."""
        return _slots(~self.gpu_mask)

    def describe(self) -> str:
        gpu = self.gpu_expert_ids()
        first_n = gpu == list(range(len(gpu)))
        shown = f"[0..{len(gpu) - 1}]" if first_n and gpu else str(gpu)
        return f"{self.num_gpu_experts} GPU experts {shown}, {self.num_cpu_experts} CPU experts"


def _slots(mask: torch.Tensor) -> torch.Tensor:
    """int32 per expert: its index among the experts ``mask`` selects, -1 for the others."""
    slots = torch.full(mask.shape, -1, dtype=torch.int32)
    slots[mask] = torch.arange(int(mask.sum()), dtype=torch.int32)
    return slots


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


# --- KT_EXPERT_PLACEMENT strategies ---------------------------------------------------


def front_loading_counts(num_layers: int, num_experts: int, num_gpu_experts: int) -> list[int]:
    """GPU experts per layer, decreasing linearly from the first MoE layer to the last,
    with the same total as ``num_gpu_experts`` in every layer (same GPU memory)."""
    total = num_layers * num_gpu_experts
    weights = [num_layers - i for i in range(num_layers)]
    ideal = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in ideal]
    # Largest remainder first: ideals decrease, so the counts stay non-increasing.
    by_remainder = sorted(range(num_layers), key=lambda i: (counts[i] - ideal[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    overflow = sum(max(0, c - num_experts) for c in counts)
    counts = [min(c, num_experts) for c in counts]
    for i in range(num_layers):  # what the front layers cannot hold goes to the next ones
        moved = min(overflow, num_experts - counts[i])
        counts[i] += moved
        overflow -= moved
    return counts


def random_gpu_experts(num_experts: int, count: int, seed: int, layer_idx: int) -> list[int]:
    """A random ``count`` experts, the same on every rank for the same seed and layer."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)
    return sorted(torch.randperm(num_experts, generator=generator)[:count].tolist())


def most_used_experts(counts: Sequence[int], count: int) -> list[int]:
    """The ``count`` most-picked experts (ties: lower id first)."""
    ranked = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
    return sorted(ranked[:count])


def plan_placements(
    strategy: str,
    moe_layers: Sequence[int],
    num_experts: int,
    num_gpu_experts: int,
    *,
    seed: int = 0,
    profile: RoutingProfile | None = None,
) -> dict[int, ExpertPlacement]:
    """The placement of every MoE layer (decoder layer index -> placement)."""
    if not 0 <= num_gpu_experts <= num_experts:
        raise ValueError(f"num_gpu_experts={num_gpu_experts} not in [0, {num_experts}]")
    if strategy == "uniform":
        return {i: ExpertPlacement.first_n(num_experts, num_gpu_experts) for i in moe_layers}
    if strategy == "front-loading":
        counts = front_loading_counts(len(moe_layers), num_experts, num_gpu_experts)
        return {i: ExpertPlacement.first_n(num_experts, n) for i, n in zip(moe_layers, counts, strict=True)}
    if strategy == "random":
        return {
            i: ExpertPlacement.from_gpu_expert_ids(
                num_experts, random_gpu_experts(num_experts, num_gpu_experts, seed, i)
            )
            for i in moe_layers
        }
    if strategy == "frequency":
        if profile is None:
            raise ValueError("frequency placement needs a routing profile")
        profile.check_fits(num_experts)
        return {
            i: ExpertPlacement.from_gpu_expert_ids(num_experts, most_used_experts(profile.counts(i), num_gpu_experts))
            for i in moe_layers
        }
    raise ValueError(f"unknown placement strategy {strategy!r}; known: {', '.join(PLACEMENT_STRATEGIES)}")


def plan_placements_from_settings(
    settings: KTSettings, moe_layers: Sequence[int], num_experts: int, num_gpu_experts: int
) -> dict[int, ExpertPlacement]:
    """``plan_placements`` with KT_EXPERT_PLACEMENT, its seed and its profile."""
    frequency = settings.expert_placement == "frequency"
    profile = load_routing_profile(settings.expert_profile) if frequency else None
    return plan_placements(
        settings.expert_placement,
        moe_layers,
        num_experts,
        num_gpu_experts,
        seed=settings.expert_placement_seed,
        profile=profile,
    )


def count_cpu_evaluations(profile: RoutingProfile, placements: Mapping[int, ExpertPlacement]) -> int:
    """Expert evaluations the CPU would have done on the profiled workload: every pick of
    an expert that this placement leaves on the CPU."""
    total = 0
    for layer_idx, placement in placements.items():
        counts = profile.counts(layer_idx)
        total += sum(counts[e] for e in placement.cpu_expert_ids())
    return total
