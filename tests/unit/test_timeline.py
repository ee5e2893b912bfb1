"""The per-forward timeline (``hybrid/timeline.py``) on the host's clock, and the bench's
summary of a step (``bench/timeline.py``): pure bookkeeping, no engine."""

from __future__ import annotations

import time

import torch

from vllm_kt_plugin.hybrid.contracts import NO_MARKS
from vllm_kt_plugin.hybrid.timeline import ON_DEMAND, PREFETCH, Timeline
from vllm_kt_tools.bench.timeline import summarize

CPU = torch.device("cpu")


def _layer(timeline: Timeline, idx: int, tokens: int, path: str = "split", pause_s: float = 0.002) -> None:
    marks = timeline.layer_marks(idx, tokens, path, CPU)
    marks.submitted()
    time.sleep(pause_s)
    marks.planned(3, 5, path)
    marks.gpu_done()
    time.sleep(pause_s)
    marks.synced()


def test_steps_open_at_the_first_layer_and_hold_every_layer_in_order() -> None:
    timeline = Timeline()
    for idx in (3, 1, 2):
        timeline.add_layer(idx)
    host_a, host_b = object(), object()
    timeline.name_host(host_a, 2)
    timeline.name_host(host_b, 1)
    timeline.enable("8 x 1024", 256)
    for tokens in (1024, 7168):  # vLLM ran the batch in two steps
        for idx in (1, 2, 3):
            if idx == 2:
                copy = timeline.copy_started(host_a, 7, ON_DEMAND, None)
                time.sleep(0.001)
                timeline.copy_done(copy, None)
            _layer(timeline, idx, tokens)
        timeline.copy_done(timeline.copy_started(host_b, 95, PREFETCH, None), None)  # the next step's first layer
    timeline.enable("alone", 256)
    for idx in (1, 2, 3):
        _layer(timeline, idx, 1024, path="whole-layer")
    steps = timeline.collect()
    assert [(s["label"], s["tokens"]) for s in steps] == [("8 x 1024", 1024), ("8 x 1024", 7168), ("alone", 1024)]
    for step in steps:
        assert [layer["layer"] for layer in step["layers"]] == [1, 2, 3]
        for layer in step["layers"]:
            assert layer["gpu_ms"] >= 2 and layer["wait_ms"] >= 2 and layer["cpu_ms"] >= 4, layer
            assert layer["staged"] == 3 and layer["picked"] == 5
        starts = [layer["start_ms"] for layer in step["layers"]]
        assert starts[0] == 0 and starts == sorted(starts)
        assert step["span_ms"] >= 12
    first = steps[0]
    assert [c["layer"] for c in first["copies"]] == [2, 1] and [c["kind"] for c in first["copies"]] == [
        ON_DEMAND,
        PREFETCH,
    ]
    assert first["layers"][1]["copy_ms"] >= 1 and first["layers"][0]["copy_ms"] < 1
    assert timeline.collect() == []  # read once


def test_off_records_nothing_and_large_forwards_only() -> None:
    timeline = Timeline()
    timeline.add_layer(0)
    assert timeline.copy_started(object(), 1, ON_DEMAND, None) is None  # off: nothing is kept
    timeline.enable("x", 256)
    timeline.disable()
    assert not timeline.enabled
    from vllm_kt_plugin.hybrid.observers import RecordsTimeline

    class FakeForward:  # what path_taken reads of a forward
        capturing = False
        tokens = 100
        x = torch.zeros(1)

    timeline.enable("x", 256)
    observer = RecordsTimeline(timeline, 0)
    assert observer.path_taken(FakeForward(), "split") is NO_MARKS  # below min_tokens
    FakeForward.tokens = 300
    assert observer.path_taken(FakeForward(), "split") is not NO_MARKS
    FakeForward.capturing = True
    assert observer.path_taken(FakeForward(), "split") is NO_MARKS  # a graph capture runs no Python later


def test_summary_splits_a_step_into_experts_rest_and_copies() -> None:
    step = {
        "label": "one 16384",
        "tokens": 16384,
        "span_ms": 100.0,
        "host_ms": 5.0,
        "layers": [
            {
                "layer": 0,
                "path": "whole-layer",
                "start_ms": 0.0,
                "gpu_ms": 20.0,
                "wait_ms": 0.0,
                "cpu_ms": 20.0,
                "copy_ms": 15.0,
                "host_ms": 1.0,
                "staged": 95,
                "picked": 95,
            },
            {
                "layer": 1,
                "path": "split",
                "start_ms": 50.0,
                "gpu_ms": 10.0,
                "wait_ms": 20.0,
                "cpu_ms": 30.0,
                "copy_ms": 15.0,
                "host_ms": 1.0,
                "staged": 85,
                "picked": 95,
            },
        ],
        "copies": [
            {"layer": 1, "rows": 95, "kind": PREFETCH, "start_ms": 5.0, "ms": 15.0},
            {"layer": 0, "rows": 95, "kind": PREFETCH, "start_ms": 10.0, "ms": 15.0},
        ],
    }
    s = summarize(step)
    assert s["moe_ms"] == 50.0 and s["rest_ms"] == 50.0 and s["gpu_ms"] == 30.0 and s["wait_ms"] == 20.0
    assert s["copy_ms"] == 30.0 and s["copy_busy_ms"] == 20.0  # overlapping copies count once
    assert s["paths"] == {"whole-layer": 1, "split": 1} and s["staged_per_layer"] == 90.0


def test_the_split_probe_is_read_back_as_its_log_line_gives_it(fresh_process_state) -> None:
    """What the bench stores beside the timeline (``split_costs``): the process's probe, raw
    (the staged format's path-choice factor is each layer's), or nothing before one ran."""
    from vllm_kt_plugin.hybrid.staging.costs import SplitCosts
    from vllm_kt_plugin.hybrid.staging.probe import ProbedCosts
    from vllm_kt_tools.bench.timeline import split_costs_in_worker, timeline_record

    assert split_costs_in_worker() is None
    costs = SplitCosts(86e-6, 18.9e-6, 1.28e-6, 0.0, 0.026e-6, cpu_s_fixed=980e-6, split_over_model=1.9)
    fresh_process_state.split_probe = ProbedCosts(costs, 4718592)
    read = split_costs_in_worker()
    assert read is not None and read["expert_nbytes"] == 4718592 and read["cpu_s_fixed"] == 980e-6
    assert "split_over_model" not in read
    assert timeline_record([], read)["split_costs"] == read and "split_costs" not in timeline_record([])
