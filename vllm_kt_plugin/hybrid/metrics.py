"""Per-layer timing of the hybrid forward (KT_METRICS_INTERVAL > 0): CPU experts, GPU
experts and the time the layer waits for the CPU, so a user sees which side bounds decode.

Three points per layer forward (before the submit, after the GPU experts, after the sync),
on the GPU's clock under CUDA (``device_clock``: CUDA-graph replays run no Python) and the
host's on vLLM's CPU build; a reporting thread logs a line per batch size every interval,
and Prometheus counters carry the totals (on ``/metrics`` only in vLLM's multiprocess
mode: the layers run in the engine core). docs/design.md, "Metrics", says why each part.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import defaultdict
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.hybrid.staging.plan import SPLIT_PATH, WHOLE_LAYER_PATH
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm_kt_plugin.hybrid.device_clock import ClockSums, DeviceClock

logger = logging.getLogger(LOGGER_NAME)


MIN_REPORT_PERIOD_S = 0.05  # the reporting thread's shortest sleep, whatever the interval
# Prefill-sized forwards (and every forward that takes a staging path) are logged one by one,
# with their path and when they were queued: how vLLM split a batch of prompts into steps
# decides which path each step takes, and no per-layer average shows it. Never inside graph
# replays (decode).
LARGE_FORWARD_TOKENS = 256


@dataclass
class LayerTotals:
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    wait_s: float = 0.0
    forwards: int = 0
    tokens: int = 0

    def __add__(self, other: LayerTotals) -> LayerTotals:
        return LayerTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: LayerTotals) -> LayerTotals:
        return LayerTotals(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def device_totals(sums: ClockSums) -> LayerTotals:
    """A layer's device-clock sums as totals (the CPU branch spans both intervals)."""
    gpu, wait = sums.gpu_ns / 1e9, sums.wait_ns / 1e9
    return LayerTotals(gpu + wait, gpu, wait, sums.forwards, sums.tokens)


class _DeviceProbe:
    """One forward's points on the GPU's clock (kernels on the layer's stream)."""

    def __init__(self, clock: DeviceClock, layer_idx: int, tokens: int) -> None:
        self.clock, self.layer_idx, self.tokens = clock, layer_idx, tokens
        clock.before_submit(layer_idx, tokens)

    def submitted(self) -> None:
        pass  # on CUDA the submit only enqueues: nothing to time

    def gpu_done(self) -> None:
        self.clock.after_gpu_experts(self.layer_idx, self.tokens)

    def planned(self, staged: int, picked: int, way: str) -> None:
        pass  # the CPU-experts path only: nothing staged

    def synced(self) -> None:
        self.clock.after_sync(self.layer_idx, self.tokens)


class _HostProbe:
    """One forward's points on the host's clock (vLLM's CPU build)."""

    def __init__(self, metrics: HybridMetrics, layer_idx: int, tokens: int) -> None:
        self.metrics, self.layer_idx, self.tokens = metrics, layer_idx, tokens
        self.marks = [time.perf_counter()]

    def submitted(self) -> None:
        self.marks.append(time.perf_counter())

    def gpu_done(self) -> None:
        self.marks.append(time.perf_counter())

    def planned(self, staged: int, picked: int, way: str) -> None:
        pass  # the CPU-experts path only: nothing staged

    def synced(self) -> None:
        t0, t1, t2 = self.marks
        t3 = time.perf_counter()
        # Submit to result spans everything; the layer waits inside the submit (a backend
        # that computes there) and inside the sync (kt-kernel, whose threads compute
        # meanwhile): span = GPU experts + wait, as on the device clock.
        totals = LayerTotals(t3 - t0, t2 - t1, (t1 - t0) + (t3 - t2), 1, self.tokens)
        self.metrics.add_host_timed(self.layer_idx, totals)


class HybridMetrics:
    """Per-layer times of this process's hybrid layers, reported every ``interval_s``."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.layers: list[int] = []
        self.first_layer = self.last_layer = -1  # of self.layers, kept as they are added
        self.clock: DeviceClock | None = None
        # By (layer, batch size), as the device clock keeps them:
        self._forward: dict[tuple[int, int], LayerTotals] = defaultdict(LayerTotals)  # host: this forward's
        self._host: dict[tuple[int, int], LayerTotals] = defaultdict(LayerTotals)  # host: whole forwards so far
        self._lock = threading.Lock()
        self._reported: dict[tuple[int, int], LayerTotals] = {}
        self.last_report = time.monotonic()
        self._reporter: threading.Thread | None = None

    def add_layer(self, layer_idx: int) -> None:
        self.layers.append(layer_idx)
        self.first_layer, self.last_layer = min(self.layers), max(self.layers)

    def probe(self, layer_idx: int, x: torch.Tensor) -> _DeviceProbe | _HostProbe | None:
        """Before the submit: this forward's probe (None while a first forward is captured,
        before the clock exists)."""
        self._start_reporter()
        if not x.is_cuda:
            return _HostProbe(self, layer_idx, x.shape[0])
        if self.clock is None:
            if torch.cuda.is_current_stream_capturing():
                return None  # its buffers must not come from a graph's memory pool
            from vllm_kt_plugin.hybrid.device_clock import DeviceClock  # imports Triton: CUDA only

            self.clock = DeviceClock(x.device, self.layers)
        return _DeviceProbe(self.clock, layer_idx, x.shape[0])

    def large_forward(self, layer_idx: int, tokens: int, path: str) -> None:
        """Log a prefill-sized forward once, at the first hybrid layer, with the time its
        Python ran: when the step was queued, which may be well before it runs."""
        large = tokens >= LARGE_FORWARD_TOKENS or path in (WHOLE_LAYER_PATH, SPLIT_PATH)
        if large and layer_idx == self.first_layer:
            logger.info(
                "kt-hybrid: a forward of %d tokens takes the %s path (queued at %.3f s, monotonic clock)",
                tokens,
                path,
                time.monotonic(),
            )

    def add_host_timed(self, layer_idx: int, totals: LayerTotals) -> None:
        """A host-timed layer forward; published for the report with the forward's last layer,
        so that a report never splits a forward."""
        self._forward[(layer_idx, totals.tokens)] += totals
        if layer_idx == self.last_layer:
            with self._lock:
                for key, done in self._forward.items():
                    self._host[key] += done
            self._forward.clear()

    def totals(self) -> dict[tuple[int, int], LayerTotals]:
        """Everything timed so far, by (layer, batch size)."""
        with self._lock:
            totals = dict(self._host)
        if self.clock is not None:
            for key, sums in self.clock.read().items():
                totals[key] = totals.get(key, LayerTotals()) + device_totals(sums)
        return totals

    def _start_reporter(self) -> None:
        if self._reporter is None:
            self._reporter = threading.Thread(target=self._report_forever, name="kt-hybrid-metrics", daemon=True)
            self._reporter.start()

    def _report_forever(self) -> None:
        while True:
            time.sleep(max(self.interval_s, MIN_REPORT_PERIOD_S))
            try:
                self.report(time.monotonic())
            except Exception:  # a failed report (logging, Prometheus) must not end the reporting
                logger.exception("kt-hybrid: metrics report failed")

    def report(self, now: float) -> None:
        """Log (a line per batch size) and count what the layers did since the last report."""
        totals = self.totals()
        by_size: dict[int, dict[int, LayerTotals]] = defaultdict(dict)
        for (layer, size), total in sorted(totals.items()):
            delta = total - self._reported.get((layer, size), LayerTotals())
            if delta.forwards > 0:
                by_size[size][layer] = delta
                self._count(layer, delta)
        self._reported = totals
        seconds = now - self.last_report
        for window in by_size.values():
            logger.info("kt-hybrid metrics: %s", summarize(window, seconds, host_clock=self.clock is None))
        self.last_report = now

    def _count(self, layer_idx: int, delta: LayerTotals) -> None:
        counters = prometheus_counters()
        layer = str(layer_idx)
        counters["cpu"].labels(layer=layer).inc(delta.cpu_s)
        counters["gpu"].labels(layer=layer).inc(delta.gpu_s)
        counters["wait"].labels(layer=layer).inc(delta.wait_s)
        counters["forwards"].labels(layer=layer).inc(delta.forwards)


@functools.cache
def prometheus_counters() -> dict[str, Any]:
    """The counters, once per process: prometheus_client's registry takes each name once."""
    from prometheus_client import Counter

    return {
        "cpu": Counter("kt_hybrid_cpu_expert_seconds", "CPU experts (submit to sync)", ["layer"]),
        "gpu": Counter("kt_hybrid_gpu_expert_seconds", "GPU experts", ["layer"]),
        "wait": Counter("kt_hybrid_cpu_wait_seconds", "time the layer waited for the CPU experts", ["layer"]),
        "forwards": Counter("kt_hybrid_forwards", "hybrid MoE forwards", ["layer"]),
    }


WAIT_SHARE_CPU_BOUND = 0.05  # a layer that waits this share of its time for the CPU is CPU-bound


# What host clocks cannot tell apart on vLLM's CPU build, said on its report lines.
HOST_CLOCK_NOTE = (
    "host clock, vLLM's CPU build: the 'GPU' experts ran on the CPU beside kt-kernel's threads, "
    "so no GPU time was measured"
)


def summarize(window: dict[int, LayerTotals], seconds: float, *, host_clock: bool = False) -> str:
    """One line: per-forward averages over all layers, which side bounds, the layer that
    waits longest for its CPU experts (``host_clock``: timed on vLLM's CPU build)."""
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
        + (f" [{HOST_CLOCK_NOTE}]" if host_clock else "")
    )
