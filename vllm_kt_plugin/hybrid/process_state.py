"""What the kt-hybrid layers of one process share: ``HybridProcessState``, the
implementation of ``contracts.ProcessState`` that layers reach through their context.

It holds the layers in decoder order (for deferral and staging's prefetch), the staging
buffers and the split's probed costs, the metrics collector, the routing recorder, the
bench's timelines and the log of dynamic expert swaps: one per process, so one per model
(``process_state()``). It imports no path or observer: it knows them as the contracts'
``HybridLayer`` and ``SplitNeighbour``.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from vllm_kt_plugin.hybrid.decode_timeline import DecodeTimeline
from vllm_kt_plugin.hybrid.metrics import HybridMetrics
from vllm_kt_plugin.hybrid.routing_recorder import RoutingRecorder
from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers
from vllm_kt_plugin.hybrid.swap_log import SwapLog
from vllm_kt_plugin.hybrid.timeline import Timeline

if TYPE_CHECKING:
    from vllm_kt_plugin.hybrid.contracts import HybridLayer, SplitNeighbour
    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts
    from vllm_kt_plugin.hybrid.staging.probe import ProbedCosts


class HybridProcessState:
    """This process's kt-hybrid layers and what they share (see the module docstring and
    ``contracts.ProcessState``)."""

    def __init__(self) -> None:
        self.layers: list[HybridLayer] = []  # by decoder layer index
        self.host_experts: list[tuple[int, HostExperts]] = []  # staging's, by decoder layer index
        self.split_paths: list[tuple[int, SplitNeighbour]] = []  # by decoder layer index
        self.split_probe: ProbedCosts | None = None  # the split's cost model, probed once per process
        self.recorder = RoutingRecorder()
        self.timeline = Timeline()  # the bench's per-forward timeline, off unless it asks
        self.decode_timeline = DecodeTimeline()  # the bench's decode timeline, armed by its variable
        self.swap_log = SwapLog()
        self._staging: dict[torch.device, StagingBuffers] = {}
        self._metrics: HybridMetrics | None = None

    def add_layer(self, layer: HybridLayer) -> None:
        bisect.insort(self.layers, layer, key=lambda m: m.layer_idx)

    def adds_deferred_experts(self, layer_idx: int) -> bool:
        return any(m.cpu is not None and m.layer_idx == layer_idx + 1 for m in self.layers)

    def add_host_experts(self, layer_idx: int, host: HostExperts) -> None:
        bisect.insort(self.host_experts, (layer_idx, host), key=lambda entry: entry[0])
        self.timeline.name_host(host, layer_idx)

    def host_experts_after(self, layer_idx: int) -> HostExperts:
        later = [host for idx, host in self.host_experts if idx > layer_idx]
        return later[0] if later else self.host_experts[0][1]

    def add_split_path(self, layer_idx: int, path: SplitNeighbour) -> None:
        self.split_paths = [(i, p) for i, p in self.split_paths if i != layer_idx]  # a reload: the new one
        bisect.insort(self.split_paths, (layer_idx, path), key=lambda entry: entry[0])

    def split_path_after(self, layer_idx: int) -> SplitNeighbour | None:
        later = [path for idx, path in self.split_paths if idx > layer_idx]
        return later[0] if later else (self.split_paths[0][1] if self.split_paths else None)

    def first_split_path(self) -> SplitNeighbour | None:
        return self.split_paths[0][1] if self.split_paths else None

    def staging(self, device: torch.device) -> StagingBuffers:
        if device not in self._staging:
            self._staging[device] = StagingBuffers(device)
            self._staging[device].timeline = self.timeline
        return self._staging[device]

    def metrics(self, interval_s: float) -> HybridMetrics | None:
        if interval_s <= 0:
            return None
        if self._metrics is None:
            self._metrics = HybridMetrics(interval_s)
        return self._metrics


_PROCESS_STATE = HybridProcessState()


def process_state() -> HybridProcessState:
    """This process's state."""
    return _PROCESS_STATE
