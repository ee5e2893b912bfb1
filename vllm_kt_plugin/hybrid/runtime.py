"""What the kt-hybrid layers of one process share, and what each layer is given.

``HybridRuntime`` is the one per-process object: the layers in decoder order (deferral
asks whether the next layer adds deferred experts; GPU prefill prefetches the next
layer's CPU experts, the split the next split layer's predicted part), GPU prefill's
staging buffers, the split's probed costs, the metrics collector, the routing recorder
behind ``vllm-kt profile``, the bench's per-forward timeline and the log of dynamic
expert swaps. vLLM builds one
model per worker process, so one object per process is one per model; ``runtime()``
returns it.

``LayerContext`` is what a layer gets from the quantization config: its settings, the
placement plan, the CPU backend, the factory of the native method, and the runtime.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_kt_plugin.hybrid.host_experts import HostExperts
from vllm_kt_plugin.hybrid.metrics import HybridMetrics
from vllm_kt_plugin.hybrid.routing_recorder import RoutingRecorder
from vllm_kt_plugin.hybrid.staging_buffers import StagingBuffers
from vllm_kt_plugin.hybrid.swap_log import SwapLog
from vllm_kt_plugin.hybrid.timeline import Timeline

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.moe_method import KTHybridMoEMethod
    from vllm_kt_plugin.hybrid.split_path import SplitPath
    from vllm_kt_plugin.hybrid.split_probe import ProbedCosts
    from vllm_kt_plugin.planning.layer_plan import LayerPlan
    from vllm_kt_plugin.settings.variables import KTSettings


class HybridRuntime:
    """This process's kt-hybrid layers and what they share (see the module docstring)."""

    def __init__(self) -> None:
        self.layers: list[KTHybridMoEMethod] = []  # by decoder layer index
        self.hosts: list[tuple[int, HostExperts]] = []  # GPU prefill's, by decoder layer index
        self.split_paths: list[tuple[int, SplitPath]] = []  # by decoder layer index
        self.split_probe: ProbedCosts | None = None  # the split's cost model, probed once per process
        self.recorder = RoutingRecorder()
        self.timeline = Timeline()  # the bench's per-forward timeline, off unless it asks
        self.swap_log = SwapLog()
        self._staging: dict[torch.device, StagingBuffers] = {}
        self._metrics: HybridMetrics | None = None

    def add_layer(self, layer: KTHybridMoEMethod) -> None:
        bisect.insort(self.layers, layer, key=lambda m: m.layer_idx)

    def adds_deferred_experts(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` + 1 is a layer of this process that computes
        CPU experts, and so adds the experts ``layer_idx`` defers to it."""
        return any(m.cpu is not None and m.layer_idx == layer_idx + 1 for m in self.layers)

    def add_host(self, layer_idx: int, host: HostExperts) -> None:
        bisect.insort(self.hosts, (layer_idx, host), key=lambda entry: entry[0])
        self.timeline.name_host(host, layer_idx)

    def host_after(self, layer_idx: int) -> HostExperts:
        """The host copy of the next layer that has one (wrapping to the first): GPU
        prefill prefetches it while ``layer_idx`` computes."""
        later = [host for idx, host in self.hosts if idx > layer_idx]
        return later[0] if later else self.hosts[0][1]

    def add_split_path(self, layer_idx: int, path: SplitPath) -> None:
        self.split_paths = [(i, p) for i, p in self.split_paths if i != layer_idx]  # a reload: the new one
        bisect.insort(self.split_paths, (layer_idx, path), key=lambda entry: entry[0])

    def split_path_after(self, layer_idx: int) -> SplitPath | None:
        """The split path of the next layer that has one (wrapping to the first): the
        split prefetches its predicted part while ``layer_idx`` computes."""
        later = [path for idx, path in self.split_paths if idx > layer_idx]
        return later[0] if later else (self.split_paths[0][1] if self.split_paths else None)

    def first_split_path(self) -> SplitPath | None:
        return self.split_paths[0][1] if self.split_paths else None

    def staging(self, device: torch.device) -> StagingBuffers:
        """The two GPU-prefill buffers of ``device``, shared by its layers."""
        if device not in self._staging:
            self._staging[device] = StagingBuffers(device)
            self._staging[device].timeline = self.timeline
        return self._staging[device]

    def metrics(self, interval_s: float) -> HybridMetrics | None:
        """The one metrics collector (None when KT_METRICS_INTERVAL=0)."""
        if interval_s <= 0:
            return None
        if self._metrics is None:
            self._metrics = HybridMetrics(interval_s)
        return self._metrics


_RUNTIME = HybridRuntime()


def runtime() -> HybridRuntime:
    """This process's runtime."""
    return _RUNTIME


@dataclass(frozen=True)
class LayerContext:
    """What one kt-hybrid MoE layer is given by the quantization config."""

    settings: KTSettings  # this process's (threads and NUMA nodes of its host share)
    plan: LayerPlan  # placements, and why GPU prefill's auto stays off
    backend: type[CPUExperts]
    make_native: Callable[[RoutedExperts, str], FusedMoEMethodBase]  # the checkpoint's method for a layer
    runtime: HybridRuntime
