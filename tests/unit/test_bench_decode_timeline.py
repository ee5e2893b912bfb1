"""The bench's decode summary (vllm_kt_tools/bench/decode_timeline.py): medians per batch size
of each column's sum over the layers, and against the host's limit, where the gap goes."""

from __future__ import annotations

from vllm_kt_tools.bench.decode_timeline import add_limits, against_limit, summarize


def step(tokens: int, step_ms: float | None, submit: float, gpu: float, wait: float, rest: float) -> dict:
    layers = [
        {"layer": i, "submit_ms": submit, "gpu_ms": gpu, "wait_ms": wait, "cpu_ms": gpu + wait, "rest_ms": rest}
        for i in range(2)
    ]
    layers[-1]["rest_ms"] = None
    span = 2 * (submit + gpu + wait) + rest
    return {"tokens": tokens, "step_ms": step_ms, "span_ms": span, "layers": layers}


def test_summary_takes_the_steps_of_its_batch_size() -> None:
    steps = [step(1, 10.0, 0.1, 1.0, 2.0, 3.0), step(1, 12.0, 0.1, 1.0, 4.0, 3.0), step(16, 20.0, 1, 1, 1, 1)]
    steps.append(step(1, None, 9, 9, 9, 9))  # the last step read: no next step to end it
    summary = summarize(steps, 1)
    assert summary["steps"] == 2 and summary["layers"] == 2
    assert summary["step_ms"] == 11.0 and summary["step_ms_min_max"] == [10.0, 12.0]
    assert summary["sum_submit_ms"] == 0.2 and summary["sum_wait_ms"] == 6.0 and summary["sum_rest_ms"] == 3.0
    # 10 - (2 * 3.1 + 3) and 12 - (2 * 5.1 + 3), median
    assert summary["outside_ms"] == round(((10 - 9.2) + (12 - 13.2)) / 2, 4)
    assert summary["per_layer"][0]["wait_ms"] == 3.0 and "rest_ms" not in summary["per_layer"][1]
    assert summarize(steps, 4) is None


def test_the_gap_to_the_limit_is_accounted_for() -> None:
    summary = summarize([step(1, 10.0, 0.25, 1.0, 2.0, 3.0), step(1, 10.0, 0.25, 1.0, 2.0, 3.0)], 1)
    limit = {"bs1": {"tok_s": 250.0}}  # a step of 4 ms
    found = against_limit(summary, limit, 1)
    assert found["limit_step_ms"] == 4.0 and found["share_of_limit"] == 0.4 and found["gap_ms"] == 6.0
    gap = found["gap"]
    assert gap == {
        "cpu_side_beyond_read_ms": 2.0,  # 2 layers x (GPU 1 + wait 2) - 4
        "submit_ms": 0.5,
        "rest_of_model_ms": 3.0,
        "outside_moe_layers_ms": 10.0 - (2 * 3.25 + 3.0),
    }
    assert found["unexplained_ms"] == 0.0
    run = {"method": "AMXINT4", "decode_timeline": {"1": summary}}
    add_limits(run, {"decode_limit": {"AMXINT4": limit}})
    assert run["decode_timeline"]["1"]["against_limit"] == found
    # bare kt-kernel at 2.5 ms a layer: 5 ms of the 6 the CPU side takes, 1 ms beyond the read
    sweep = {"AMXINT4": {"tokens": {"1": {"per_layer_ms": 2.5}}}}
    add_limits(run, {"decode_limit": {"AMXINT4": limit}, "kernel_sweep": sweep})
    split = run["decode_timeline"]["1"]["against_limit"]
    assert split["gap"]["kt_kernel_beyond_read_ms"] == 1.0 and split["gap"]["cpu_side_beyond_kt_kernel_ms"] == 1.0
    assert "cpu_side_beyond_read_ms" not in split["gap"] and split["unexplained_ms"] == 0.0
