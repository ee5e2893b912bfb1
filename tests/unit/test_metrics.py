"""KT_METRICS_INTERVAL: the summary line (which side bounds a layer follows the time it waits
for the CPU), the reporting of whole forwards, and the GPU clock's kernel."""

from __future__ import annotations

import pytest

from vllm_kt_plugin.hybrid.metrics import LayerTotals, summarize


def test_waiting_on_the_cpu_makes_a_layer_cpu_bound() -> None:
    # CUDA semantics: CPU branch = GPU experts + wait.
    waits = {0: LayerTotals(cpu_s=0.6, gpu_s=0.2, wait_s=0.4, forwards=100, tokens=100)}
    line = summarize(waits, 10.0)
    assert "-> CPU-bound" in line and "waiting on the CPU 4.000 ms" in line and "1 layers" in line


def test_a_layer_that_never_waits_is_gpu_bound() -> None:
    hidden = {
        0: LayerTotals(cpu_s=0.5, gpu_s=0.5, wait_s=0.001, forwards=100, tokens=800),
        1: LayerTotals(cpu_s=0.52, gpu_s=0.5, wait_s=0.02, forwards=100, tokens=800),
    }
    line = summarize(hidden, 10.0)
    assert "-> GPU-bound" in line
    assert "longest wait: layer 1 (0.200 ms, 8.0 tokens/forward)" in line


def test_a_report_never_splits_a_forward(monkeypatch) -> None:
    """Host-timed layers (vLLM's CPU build) count once the forward's last layer is done, so
    the reporting thread, which may read at any moment, sees whole forwards only."""
    import torch

    from vllm_kt_plugin.hybrid import metrics as module
    from vllm_kt_plugin.hybrid.metrics import HybridMetrics

    lines: list[str] = []
    monkeypatch.setattr(module.logger, "info", lambda fmt, *args: lines.append(fmt % args))

    metrics = HybridMetrics(3600.0)  # the thread sleeps; reports are called here
    for layer in (1, 2):
        metrics.add_layer(layer)
    x = torch.zeros(4, 8)
    for layer in (1, 2):
        probe = metrics.probe(layer, x)
        probe.submitted()
        probe.gpu_done()
        if layer == 1:
            assert metrics.totals() == {}  # half a forward: nothing to report yet
        probe.synced()
    totals = metrics.totals()
    assert sorted(totals) == [(1, 4), (2, 4)] and all(t.forwards == 1 and t.tokens == 4 for t in totals.values())
    metrics.report(metrics.last_report + 1.0)
    metrics.report(metrics.last_report + 1.0)  # nothing new: no line
    assert len(lines) == 1 and "2 layers, 2 layer forwards" in lines[0], lines


def test_a_report_gives_each_batch_size_its_line(monkeypatch) -> None:
    """A window of batch-1 decode also holds the prompts' prefill forwards: each batch size
    gets its own line, so the bench reads whole-number batches from every window."""
    import torch

    from vllm_kt_plugin.hybrid import metrics as module
    from vllm_kt_plugin.hybrid.metrics import HybridMetrics
    from vllm_kt_tools.bench.report import layer_metrics

    lines: list[str] = []
    monkeypatch.setattr(module.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    metrics = HybridMetrics(3600.0)
    for layer in (1, 2):
        metrics.add_layer(layer)
    for tokens in (32, 1, 1, 1):  # a prompt's prefill, then three decode steps
        for layer in (1, 2):
            probe = metrics.probe(layer, torch.zeros(tokens, 8))
            probe.submitted()
            probe.gpu_done()
            probe.synced()
    metrics.report(metrics.last_report + 1.0)
    assert len(lines) == 2, lines
    parsed = layer_metrics("\n".join(f"(EngineCore pid=1) INFO [metrics.py:1] {line}" for line in lines))
    assert {size: m["layer_forwards"] for size, m in parsed.items()} == {"1": 6, "32": 2}


def test_prefill_sized_forwards_are_logged_once_with_their_path(monkeypatch) -> None:
    """Each prefill-sized or staged forward gives one line (at the first hybrid layer,
    whatever the order the layers register in), which the bench reads back as the engine's
    steps."""
    from vllm_kt_plugin.hybrid import metrics as module
    from vllm_kt_plugin.hybrid.metrics import LARGE_FORWARD_TOKENS, HybridMetrics
    from vllm_kt_plugin.hybrid.staging.plan import CPU_PATH, WHOLE_LAYER_PATH
    from vllm_kt_tools.bench.report import large_forwards

    lines: list[str] = []
    monkeypatch.setattr(module.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    metrics = HybridMetrics(3600.0)
    for layer in (5, 3):
        metrics.add_layer(layer)
    for layer in (3, 5):
        metrics.large_forward(layer, 1024, CPU_PATH)
    metrics.large_forward(3, LARGE_FORWARD_TOKENS - 1, CPU_PATH)  # decode-sized: nothing
    metrics.large_forward(3, 7168, WHOLE_LAYER_PATH)
    metrics.large_forward(3, 32, WHOLE_LAYER_PATH)  # staged below the size: still logged
    steps = large_forwards("\n".join(f"(EngineCore pid=1) INFO 12-04 06:29:25 [metrics.py:1] {x}" for x in lines))
    assert [s[:2] for s in steps] == [[1024, "CPU-experts"], [7168, "whole-layer"], [32, "whole-layer"]], lines
    assert steps[0][2] == 0.0
    assert large_forwards("nothing") == []


def test_device_clock_sums_become_totals() -> None:
    from vllm_kt_plugin.hybrid.device_clock import ClockSums
    from vllm_kt_plugin.hybrid.metrics import device_totals

    totals = device_totals(ClockSums(gpu_ns=2_000_000, wait_ns=500_000, forwards=10, tokens=80))
    assert totals == LayerTotals(cpu_s=0.0025, gpu_s=0.002, wait_s=0.0005, forwards=10, tokens=80)


CLOCK_IN_INTERPRETER = """
import itertools, json
import numpy as np, torch
import triton.language as tl
import triton.language.extra.cuda as cuda
import triton.runtime.interpreter as interpreter

ticks = itertools.count(1000, 7)  # the GPU's clock, advancing 7 ns per read
cuda.globaltimer = lambda: tl.core.tensor(
    interpreter.TensorHandle(np.array(next(ticks), dtype=np.int64), tl.int64), tl.int64
)
from vllm_kt_plugin.hybrid.device_clock import DeviceClock

import vllm_kt_plugin.hybrid.device_clock as module
module.SIZES = 3  # two batch sizes of their own, the rest together
clock = DeviceClock(torch.device("cpu"), [3, 5])
for tokens in (16, 8, 16, 2, 4):
    for layer in (3, 5):
        clock.before_submit(layer, tokens)
        clock.after_gpu_experts(layer, tokens)
        if layer == 3:
            clock.after_gpu_experts(layer, tokens)  # a second GPU interval: 14 ns in all
        clock.after_sync(layer, tokens)
print(json.dumps({f"{layer}/{size}": list(sums) for (layer, size), sums in clock.read().items()}))
"""


def test_device_clock_kernel_in_triton_interpreter() -> None:
    """The clock's Triton kernel, run by Triton's interpreter with a fake %globaltimer: each
    phase adds the time since the last stamp to its field of the layer's and batch size's
    sums (sizes past the slots share the last one, key 0), the sync counts the forward and
    its tokens, and the last layer publishes the sums to the host mirror."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CLOCK_IN_INTERPRETER], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    sums = json.loads(out.stdout.strip().splitlines()[-1])
    assert sums == {
        "3/16": [4 * 7, 2 * 7, 2, 32],
        "3/8": [2 * 7, 1 * 7, 1, 8],
        "3/0": [4 * 7, 2 * 7, 2, 6],
        "5/16": [2 * 7, 2 * 7, 2, 32],
        "5/8": [1 * 7, 1 * 7, 1, 8],
        "5/0": [2 * 7, 2 * 7, 2, 6],
    }


@pytest.mark.parametrize("computes_in", ["submit", "sync"])
def test_host_timed_wait_never_exceeds_the_span(monkeypatch, computes_in: str) -> None:
    """vLLM's CPU build times on the host. kt-kernel's submit only hands the work to its
    threads and its sync waits for them; the torch backend computes in the submit. In both
    the layer's wait is part of the CPU branch's span (submit to result), as on CUDA: the
    CPU build once logged 'CPU experts 1.606 ms, waiting on the CPU 7.431 ms'."""
    import torch

    from vllm_kt_plugin.hybrid import metrics as module
    from vllm_kt_plugin.hybrid.metrics import HOST_CLOCK_NOTE, HybridMetrics

    now = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: now[0])
    lines: list[str] = []
    monkeypatch.setattr(module.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    metrics = HybridMetrics(3600.0)
    metrics.add_layer(0)
    cpu_ms, gpu_ms = 6.0, 0.2
    probe = metrics.probe(0, torch.zeros(1, 8))
    now[0] += cpu_ms / 1e3 if computes_in == "submit" else 0.0001  # the submit
    probe.submitted()
    now[0] += gpu_ms / 1e3  # the GPU experts (here on the CPU)
    probe.gpu_done()
    now[0] += cpu_ms / 1e3 - gpu_ms / 1e3 if computes_in == "sync" else 0.0  # the sync waits for the rest
    probe.synced()
    (totals,) = metrics.totals().values()
    assert totals.wait_s <= totals.cpu_s
    assert totals.cpu_s == pytest.approx(totals.gpu_s + totals.wait_s)
    assert totals.gpu_s == pytest.approx(gpu_ms / 1e3)
    metrics.report(metrics.last_report + 1.0)
    assert len(lines) == 1 and HOST_CLOCK_NOTE in lines[0] and "-> CPU-bound" in lines[0], lines
