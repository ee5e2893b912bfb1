"""The metrics summary line: which side bounds a layer follows the time it waits for the CPU."""

from __future__ import annotations

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
