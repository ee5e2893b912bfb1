"""The routing recorder: while enabled, each kt-hybrid layer counts which experts its
tokens picked and how many of those picks went to the CPU. ``vllm-kt profile`` turns the
counts into a routing profile (KT_EXPERT_PROFILE); the recorder itself costs nothing
while disabled (one attribute read per layer forward).
"""

from __future__ import annotations

import torch


class RoutingRecorder:
    """Counts of ``topk_ids`` per layer, and picks that went to the CPU, while enabled."""

    def __init__(self) -> None:
        self.enabled = False
        self.reset()

    def reset(self) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        self.cpu_evaluations: dict[int, int] = {}
        self.gpu_expert_ids: dict[int, list[int]] = {}

    def record(self, layer_idx: int, topk_ids: torch.Tensor, gpu_mask: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1).long().cpu()
        ids = ids[ids >= 0]  # padded tokens' picks are -1 (vLLM's VLLM_MOE_SKIP_PADDING)
        picks = torch.bincount(ids, minlength=gpu_mask.numel())
        self.counts[layer_idx] = self.counts.get(layer_idx, torch.zeros_like(picks)) + picks
        self.cpu_evaluations[layer_idx] = self.cpu_evaluations.get(layer_idx, 0) + int(picks[~gpu_mask].sum())
        if layer_idx not in self.gpu_expert_ids:  # a layer's placement is fixed
            self.gpu_expert_ids[layer_idx] = torch.nonzero(gpu_mask).flatten().tolist()
