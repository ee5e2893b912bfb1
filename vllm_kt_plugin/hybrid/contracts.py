"""The contracts of one hybrid forward: route -> pick a path -> run it, with observers told.

A layer runs the first of its ``ForwardPath``s (``paths``) whose ``takes`` accepts the
forward; a path computes the layer's whole routed output and may take part in the weight
lifecycle. ``ForwardObserver``s watch without changing results, and may hand the path
``StageMarks`` to time its stages. A layer reaches what its process shares through
``LayerContext.process``, the Protocol ``ProcessState``, so nothing here or in the paths and
observers imports the modules that build or hold layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.decode_timeline import DecodeTimeline
    from vllm_kt_plugin.hybrid.gpu_experts import GPUExperts
    from vllm_kt_plugin.hybrid.metrics import HybridMetrics
    from vllm_kt_plugin.hybrid.routing_recorder import RoutingRecorder
    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers
    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts
    from vllm_kt_plugin.hybrid.staging.probe import ProbedCosts
    from vllm_kt_plugin.hybrid.swap_log import SwapLog
    from vllm_kt_plugin.hybrid.timeline import Timeline
    from vllm_kt_plugin.planning.layer_plan import LayerPlan
    from vllm_kt_plugin.planning.placement import ExpertPlacement
    from vllm_kt_plugin.settings.variables import KTSettings


@dataclass(frozen=True)
class Forward:
    """One call of a layer's routed experts."""

    layer: RoutedExperts
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    capturing: bool  # inside a CUDA-graph capture: no Python runs at replay

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


class SplitNeighbour(Protocol):
    """What a split path reads of the next layer's (``staging.split.SplitPath``) to prefetch
    that layer's predicted part into the other staging buffer; and kt-hybrid's scheduler, of
    every split path, from which size a forward streams the whole layer."""

    @property
    def host(self) -> HostExperts | None: ...

    whole_min_tokens: int  # forwards from this size stage the whole layer (known once probed)

    @property
    def by_expert(self) -> bool: ...

    def predict(self, count: int) -> list[int]: ...


class HybridLayer(Protocol):
    """What the process state reads of a layer's method (``moe_method.KTHybridMoEMethod``):
    its decoder index and whether this rank computes its CPU experts."""

    layer_idx: int
    cpu: CPUExperts | None


class ProcessState(Protocol):
    """What the kt-hybrid layers of one process share, as a layer reaches it (its context's
    ``process``; ``process_state.HybridProcessState``, one per process, implements it)."""

    # staging: the host copies in decoder order and the buffers they share
    host_experts: list[tuple[int, HostExperts]]

    def add_host_experts(self, layer_idx: int, host: HostExperts) -> None: ...

    def host_experts_after(self, layer_idx: int) -> HostExperts:
        """The host copy of the next layer that has one (wrapping to the first): the
        whole-layer path prefetches it while ``layer_idx`` computes."""
        ...

    def staging(self, device: torch.device) -> StagingBuffers:
        """The two staging buffers of ``device``, shared by its layers."""
        ...

    # the split: its paths in decoder order and the costs probed once per process
    split_probe: ProbedCosts | None

    def add_split_path(self, layer_idx: int, path: SplitNeighbour) -> None: ...

    def split_path_after(self, layer_idx: int) -> SplitNeighbour | None:
        """The split path of the next layer that has one (wrapping to the first): the
        split prefetches its predicted part while ``layer_idx`` computes."""
        ...

    def first_split_path(self) -> SplitNeighbour | None: ...

    # the layers themselves (deferral) and what their observers report to
    recorder: RoutingRecorder
    timeline: Timeline
    decode_timeline: DecodeTimeline
    swap_log: SwapLog

    def add_layer(self, layer: HybridLayer) -> None: ...

    def adds_deferred_experts(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` + 1 is a layer of this process that computes
        CPU experts, and so adds the experts ``layer_idx`` defers to it."""
        ...

    def metrics(self, interval_s: float) -> HybridMetrics | None:
        """The one metrics collector (None when KT_METRICS_INTERVAL=0)."""
        ...


@dataclass(frozen=True)
class LayerContext:
    """What one kt-hybrid MoE layer is given by the quantization config."""

    settings: KTSettings  # this process's (threads and NUMA nodes of its host share)
    plan: LayerPlan  # placements, and the model's staging plan
    backend: type[CPUExperts]
    make_native: Callable[[RoutedExperts, str], FusedMoEMethodBase]  # the checkpoint's method for a layer
    process: ProcessState
    checkpoint: CheckpointFormat = CheckpointFormat()  # how the checkpoint stores its weights


@dataclass(frozen=True)
class LayerParts:
    """What a layer's paths and observers are built from: its name and index, placement,
    GPU experts (the native method), CPU experts (None on tensor-parallel ranks other than
    0 and without CPU experts) and context."""

    layer_name: str
    layer_idx: int
    moe: FusedMoEConfig
    placement: ExpertPlacement
    gpu: GPUExperts
    cpu: CPUExperts | None
    context: LayerContext
    cuda_graph_batch_sizes: tuple[int, ...]  # batch sizes vLLM captures (none on CPU or eager)
    make_shadow_native: Callable[[RoutedExperts], FusedMoEMethodBase]  # the native method for a shadow


class StageMarks(Protocol):
    """Points of a forward (an observer's timing probe): every path marks the GPU side
    done and the CPU result synced; the CPU-experts path and the split mark the submit."""

    def submitted(self) -> None: ...

    def gpu_done(self) -> None: ...

    def planned(self, staged: int, picked: int, way: str) -> None:
        """The path staged ``staged`` of the ``picked`` CPU experts on the GPU, the ``way``
        it ran this forward (the split path's own choice: the CPU path, split, whole layer)."""

    def synced(self) -> None: ...


class _NoMarks:
    def submitted(self) -> None:
        pass

    def gpu_done(self) -> None:
        pass

    def planned(self, staged: int, picked: int, way: str) -> None:
        pass

    def synced(self) -> None:
        pass


NO_MARKS: StageMarks = _NoMarks()


class _AllMarks:
    def __init__(self, marks: Sequence[StageMarks]) -> None:
        self.marks = marks

    def submitted(self) -> None:
        for m in self.marks:
            m.submitted()

    def gpu_done(self) -> None:
        for m in self.marks:
            m.gpu_done()

    def planned(self, staged: int, picked: int, way: str) -> None:
        for m in self.marks:
            m.planned(staged, picked, way)

    def synced(self) -> None:
        for m in self.marks:
            m.synced()


def combined(marks: Sequence[StageMarks]) -> StageMarks:
    """One ``StageMarks`` for several observers' (NO_MARKS for none)."""
    if not marks:
        return NO_MARKS
    return marks[0] if len(marks) == 1 else _AllMarks(marks)


class ForwardObserver:
    """Watches one layer's forwards; subclasses override what they need."""

    def routed(self, forward: Forward) -> None:
        """The forward's picks are known and none of its work is queued yet."""

    def path_taken(self, forward: Forward, path: str) -> StageMarks:
        """The forward takes ``path``; marks for its stages, if this observer times them."""
        return NO_MARKS


class ForwardPath:
    """One way to compute a layer's routed experts (see the module docstring).

    ``takes`` decides per forward (it must not branch on anything torch.compile would
    need to guard on but the token count: the CPU build traces the layer); ``run``
    returns the layer's output for the forward. The lifecycle hooks default to nothing.
    """

    name: ClassVar[str]

    def takes(self, forward: Forward) -> bool:
        raise NotImplementedError

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        raise NotImplementedError

    def create_weights(self, layer: RoutedExperts, create_args: dict[str, Any]) -> None:
        """After the native method created the layer's GPU-expert weights."""

    def load_cpu_expert(
        self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, cpu_slot: int
    ) -> None:
        """A checkpoint tensor of a CPU expert (``cpu_slot``: its index among them)."""

    def after_loading(self, layer: RoutedExperts) -> None:
        """After the native post-processing and the CPU backend's finalization."""
