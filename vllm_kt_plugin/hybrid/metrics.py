"""Per-layer timing of the hybrid forward (KT_METRICS_INTERVAL > 0): CPU experts, GPU
experts and the time the layer waits for the CPU, so a user sees which side bounds decode.

The MoE layers run in vLLM's engine-core process, while ``/metrics`` is served by the API
server process from prometheus_client's default registry; vLLM gathers other processes'
metrics only in its multiprocess mode (``--api-server-count`` > 1, or PROMETHEUS_MULTIPROC_DIR
set). So the numbers go to a periodic log line always, and to Prometheus counters
(``kt_hybrid_*_seconds_total{layer=...}``) that show on ``/metrics`` in that mode.

Timing: on CUDA, events on the layer's stream before submit (e0), after the GPU experts (e2)
and after sync (e3): the GPU side takes e2 - e0 and the wait for the CPU e3 - e2. The CPU
branch (submit to result) spans e3 - e0: the CPU experts' time when the layer waits for
them, an upper bound when they finish under the GPU work. A layer is CPU-bound when it
waits. Inside a CUDA-graph capture nothing is recorded (replays run no Python): measure
decode with --enforce-eager. On the CPU platform the submit computes synchronously, so host
clocks give the CPU experts' time itself, all of it waited for.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class LayerTotals:
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wait_s: float = 0.0
    forwards: int = 0
    tokens: int = 0


class _Span:
    """One forward's marks: CUDA events, or host times on the CPU platform."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []
        self.tokens = 0

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def ready(self) -> bool:
        return not self.cuda or self.marks[-1].query()

    def seconds(self) -> tuple[float, float, float]:
        """(CPU branch, GPU experts, wait for the CPU) of a span marked before submit, after
        submit, after the GPU experts and after sync."""
        if self.cuda:
            e0, _, e2, e3 = self.marks
            gpu, wait = e0.elapsed_time(e2) / 1e3, e2.elapsed_time(e3) / 1e3
            return gpu + wait, gpu, wait
        t0, t1, t2, t3 = self.marks  # the submit computes the CPU experts synchronously
        return t1 - t0, t2 - t1, (t1 - t0) + (t3 - t2)


class HybridMetrics:
    """Collects spans per layer and reports every ``interval_s`` seconds."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.pending: list[tuple[int, _Span]] = []
        self.window: dict[int, LayerTotals] = defaultdict(LayerTotals)
        self.last_report = time.monotonic()
        self._counters: dict[str, Any] | None = None

    def start(self, x: torch.Tensor) -> _Span | None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        span = _Span(x.is_cuda)
        span.tokens = x.shape[0]
        span.mark()
        return span

    def finish(self, layer_idx: int, span: _Span | None) -> None:
        if span is None:
            return
        span.mark()
        self.pending.append((layer_idx, span))
        now = time.monotonic()
        if now - self.last_report >= self.interval_s:
            self.report(now)

    def _collect(self) -> None:
        waiting = []
        for layer_idx, span in self.pending:
            if not span.ready():
                waiting.append((layer_idx, span))
                continue
            cpu, gpu, wait = span.seconds()
            totals = self.window[layer_idx]
            totals.cpu_s += cpu
            totals.gpu_s += gpu
            totals.wait_s += wait
            totals.forwards += 1
            totals.tokens += span.tokens
            self._count(layer_idx, cpu, gpu, wait)
        self.pending = waiting

    def report(self, now: float) -> None:
        self._collect()
        if self.window:
            logger.info("kt-hybrid metrics: %s", summarize(self.window, now - self.last_report))
        self.window = defaultdict(LayerTotals)
        self.last_report = now

    def _count(self, layer_idx: int, cpu: float, gpu: float, wait: float) -> None:
        counters = self._counters if self._counters is not None else self._make_counters()
        layer = str(layer_idx)
        counters["cpu"].labels(layer=layer).inc(cpu)
        counters["gpu"].labels(layer=layer).inc(gpu)
        counters["wait"].labels(layer=layer).inc(wait)
        counters["forwards"].labels(layer=layer).inc()

    def _make_counters(self) -> dict[str, Any]:
        from prometheus_client import Counter

        self._counters = {
            "cpu": Counter("kt_hybrid_cpu_expert_seconds", "CPU experts (submit to sync)", ["layer"]),
            "gpu": Counter("kt_hybrid_gpu_expert_seconds", "GPU experts", ["layer"]),
            "wait": Counter("kt_hybrid_cpu_wait_seconds", "time the layer waited for the CPU experts", ["layer"]),
            "forwards": Counter("kt_hybrid_forwards", "hybrid MoE forwards", ["layer"]),
        }
        return self._counters


WAIT_SHARE_CPU_BOUND = 0.05  # a layer that waits this share of its time for the CPU is CPU-bound


def summarize(window: dict[int, LayerTotals], seconds: float) -> str:
    """One line: per-forward averages over all layers, which side bounds, the layer that
    waits longest for its CPU experts."""
    forwards = sum(t.forwards for t in window.values())
    cpu = sum(t.cpu_s for t in window.values())
    gpu = sum(t.gpu_s for t in window.values())
    wait = sum(t.wait_s for t in window.values())
    layer_time = max(cpu, gpu)
    bound = "CPU" if wait > WAIT_SHARE_CPU_BOUND * layer_time else "GPU"
    slowest = max(window, key=lambda i: window[i].wait_s / max(window[i].forwards, 1))
    s = window[slowest]
    return (
        f"last {seconds:.0f} s, {len(window)} layers, {forwards} layer forwards: per layer forward "
        f"CPU experts (submit to result) {1e3 * cpu / forwards:.3f} ms, GPU experts {1e3 * gpu / forwards:.3f} ms, "
        f"waiting on the CPU {1e3 * wait / forwards:.3f} ms -> {bound}-bound; longest wait: layer {slowest} "
        f"({1e3 * s.wait_s / s.forwards:.3f} ms, {s.tokens / s.forwards:.1f} tokens/forward)"
    )
