"""The whole-layer path: a forward of at least the plan's tokens computes every CPU expert
on the GPU, from the staging buffer the layer's CPU experts were copied into, while the
next layer's stream into the other buffer.

Its cost is the copy of a whole layer, whatever the forward's size: it pays where the
CPU's work on the forward is longer (docs/design.md, "Staging").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, StageMarks
from vllm_kt_plugin.hybrid.staging.layer import WHOLE_LAYER_RAN, LayerStaging
from vllm_kt_plugin.hybrid.staging.plan import WHOLE_LAYER_PATH
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers
    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once


class WholeLayerPath(ForwardPath):
    """Every routed expert on the GPU: the GPU experts as always, the CPU experts from the
    staging buffer."""

    name = WHOLE_LAYER_PATH

    def __init__(self, staging: LayerStaging) -> None:
        self.staging = staging
        self.min_tokens = staging.plan.min_tokens
        self._next_host: HostExperts | None = None

    @property
    def host(self) -> HostExperts | None:
        return self.staging.host

    @property
    def buffers(self) -> StagingBuffers | None:
        return self.staging.buffers

    def takes(self, forward: Forward) -> bool:
        return self.staging.takes(forward, self.min_tokens)

    def create_weights(self, layer: RoutedExperts, create_args: dict[str, Any]) -> None:
        self.staging.create_weights(layer, create_args)

    def load_cpu_expert(
        self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, cpu_slot: int
    ) -> None:
        self.staging.load_cpu_expert(param_name, weight, weight_name, shard_id, cpu_slot)

    def after_loading(self, layer: RoutedExperts) -> None:
        self.staging.after_loading(" (whole layer)")

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        host, buffers = self.staging.host, self.staging.buffers
        assert host is not None and buffers is not None
        x, weights, ids = forward.x, forward.topk_weights, forward.topk_ids
        out = self.staging.gpu_experts(forward)
        index, staged = buffers.acquire(host)
        cpu_out = host.apply(staged, x, weights, ids)
        buffers.release(index)
        marks.planned(host.num_experts, host.num_experts, WHOLE_LAYER_PATH)
        marks.gpu_done()
        # After this layer's work is queued: a written next layer blocks this thread.
        parts = self.staging.parts
        if self._next_host is None:
            self._next_host = parts.context.process.host_experts_after(parts.layer_idx)
        if self._next_host is not host:
            buffers.prefetch(self._next_host, busy=index)
        logger.info_once(
            "%s: a forward of >= %d tokens computed the CPU experts on the GPU", WHOLE_LAYER_RAN, self.min_tokens
        )
        marks.synced()
        return cpu_out if out is None else out + cpu_out
