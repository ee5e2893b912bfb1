"""Observers of a layer's forwards (``contracts.ForwardObserver``): the routing recorder of
``vllm-kt profile``, the per-layer metrics (KT_METRICS_INTERVAL) and the bench's
per-forward and decode timelines. Dynamic GPU experts
(``dynamic_experts.DynamicExperts``) observe too. A layer subscribes each where it
applies, once, when it is built or loaded; the forward itself has no branch for any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kt_plugin.hybrid.contracts import NO_MARKS, Forward, ForwardObserver, StageMarks
from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH

if TYPE_CHECKING:
    from vllm_kt_plugin.hybrid.decode_timeline import DecodeTimeline
    from vllm_kt_plugin.hybrid.metrics import HybridMetrics
    from vllm_kt_plugin.hybrid.routing_recorder import RoutingRecorder
    from vllm_kt_plugin.hybrid.timeline import Timeline
    from vllm_kt_plugin.planning.placement import ExpertPlacement


class RecordsRouting(ForwardObserver):
    """Counts the layer's picks into the process's routing recorder while it is enabled
    (one attribute read per forward while it is not)."""

    def __init__(self, recorder: RoutingRecorder, layer_idx: int, placement: ExpertPlacement) -> None:
        self.recorder, self.layer_idx, self.placement = recorder, layer_idx, placement

    def routed(self, forward: Forward) -> None:
        if self.recorder.enabled:
            self.recorder.record(self.layer_idx, forward.topk_ids, self.placement.gpu_mask)


class TimesLayer(ForwardObserver):
    """KT_METRICS_INTERVAL on a layer with CPU experts: logs prefill-sized forwards with
    their path (outside CUDA-graph capture) and times the CPU-experts path's stages."""

    def __init__(self, metrics: HybridMetrics, layer_idx: int) -> None:
        self.metrics, self.layer_idx = metrics, layer_idx
        metrics.add_layer(layer_idx)

    def path_taken(self, forward: Forward, path: str) -> StageMarks:
        if not forward.capturing:
            self.metrics.large_forward(self.layer_idx, forward.tokens, path)
        if path != CPU_PATH:
            return NO_MARKS
        probe = self.metrics.probe(self.layer_idx, forward.x)
        return probe if probe is not None else NO_MARKS


class RecordsTimeline(ForwardObserver):
    """Hands the layer's large forwards to the process's timeline while it is enabled (one
    attribute read per forward while it is not)."""

    def __init__(self, timeline: Timeline, layer_idx: int) -> None:
        self.timeline, self.layer_idx = timeline, layer_idx
        timeline.add_layer(layer_idx)

    def path_taken(self, forward: Forward, path: str) -> StageMarks:
        timeline = self.timeline
        if not timeline.enabled or forward.capturing or forward.tokens < timeline.min_tokens:
            return NO_MARKS
        marks = timeline.layer_marks(self.layer_idx, forward.tokens, path, forward.x.device)
        return marks if marks is not None else NO_MARKS


class RecordsDecode(ForwardObserver):
    """Stamps the layer's decode-sized CPU-experts forwards into the process's decode timeline
    (wired only where it was armed at start: its stamps must be in the captured graphs)."""

    def __init__(self, timeline: DecodeTimeline, layer_idx: int) -> None:
        self.timeline, self.layer_idx = timeline, layer_idx
        timeline.add_layer(layer_idx)

    def path_taken(self, forward: Forward, path: str) -> StageMarks:
        if path != CPU_PATH:
            return NO_MARKS
        marks = self.timeline.marks(self.layer_idx, forward.x, forward.capturing)
        return marks if marks is not None else NO_MARKS
