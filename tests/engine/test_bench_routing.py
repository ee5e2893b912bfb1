"""The bench's workload routes like independent tokens (issue 27), on vLLM's CPU build: one
engine start of the bench's own measuring child (``engine_child.run_in_child``, the recorder
preloaded into vLLM's spawned engine processes), on the tiny Qwen3-MoE's shape with dummy
weights as the bench runs a built-in shape. Each decode batch repeats one prompt, so with
greedy decoding its 16 tokens would route like one (2 distinct experts of 8 at batch 16,
against 7.92 for independent tokens): the bs16 assertion fails unless the sampling works.
Measured on the 2-core dev box (run below with temperature 0, same engine): bs16 2.0."""

from __future__ import annotations

from pathlib import Path

import pytest
from kt_testing.engines import clean_env

from vllm_kt_tools.bench.engine_child import run_in_child
from vllm_kt_tools.bench.engine_runs import RunSpec
from vllm_kt_tools.bench.routing import COUNTED_TOKENS, TOLERANCE, expected_distinct

TINY_DECODE_TOKENS = 16
TINY_DECODE_REPEATS = 3  # the sittings run 5: fewer here keeps CI's time (the figures are not read)


@pytest.fixture(scope="module")
def bench_run(tiny_model, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module) -> dict:
    model = tiny_model("qwen3_moe")
    for name, value in clean_env().items():
        monkeypatch_module.setenv(name, value)
    spec = RunSpec(
        "vllm-gpu",
        "bf16",
        model=str(model),
        load_format="dummy",
        gpu_weight_gb=0.0,
        decode_tokens=TINY_DECODE_TOKENS,
        decode_repeats=TINY_DECODE_REPEATS,
    )
    result = run_in_child(spec, tmp_path_factory.mktemp("bench-logs"), timeout_s=900)
    assert "error" not in result, result["error"]
    return result


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _config(tiny_model) -> tuple[int, int]:
    import json

    config = json.loads((Path(tiny_model("qwen3_moe")) / "config.json").read_text())
    return config.get("num_experts") or config["num_local_experts"], config["num_experts_per_tok"]


def test_bench_records_routing_of_independent_tokens(bench_run: dict, tiny_model) -> None:
    """Every counted batch size has a measured figure within TOLERANCE of E(1-(1-k/E)^n),
    computed here from the model's config, and from enough layer forwards to mean something."""
    experts, top_k = _config(tiny_model)
    routing = bench_run["routing"]
    assert "error" not in routing, routing
    assert (routing["num_experts"], routing["top_k"]) == (experts, top_k)
    for tokens in COUNTED_TOKENS:
        figure = routing[f"bs{tokens}"]
        want = expected_distinct(experts, top_k, tokens)
        assert figure["expected_independent"] == pytest.approx(want, abs=0.01)
        # the decode repeats: TINY_DECODE_REPEATS pairs of runs, each decode_tokens steps at least
        assert figure["layer_forwards"] >= TINY_DECODE_TOKENS, figure
        measured = figure["measured_distinct_per_layer_step"]
        assert abs(measured - want) / want <= TOLERANCE, (tokens, measured, want)
        assert figure["within_tolerance"] is True


def test_bench_samples_every_workload(bench_run: dict) -> None:
    """The run says how it sampled, and the batch-1 decode is not a greedy two-token cycle."""
    assert bench_run["sampling"] == {"temperature": 1.0, "engine_seed": 0}
    tokens = bench_run["tokens_bs1"]
    assert len(tokens) == TINY_DECODE_TOKENS
    assert len(set(tokens)) > 2, tokens  # greedy dummy decoding alternates two tokens


def test_bench_times_one_prompt_alone(bench_run: dict) -> None:
    """Issue 28's time to first token of one 1,024-token prompt alone is measured (its value
    on vLLM's CPU build means nothing)."""
    assert bench_run["ttft_one_prompt_s"] > 0
