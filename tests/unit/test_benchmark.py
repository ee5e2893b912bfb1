"""The benchmark's planning (pure logic; the measurements themselves need a GPU)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from kt_testing.hardware import skip_without_kernel

from vllm_kt_plugin.settings.catalogue import GIB
from vllm_kt_tools.bench.engine_child import decode_summary
from vllm_kt_tools.bench.engine_runs import plan_runs
from vllm_kt_tools.bench.shapes import SHAPES, model_sizes, shape_config
from vllm_kt_tools.cli.bench import add_arguments


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_qwen3_30b_plan_holds_the_same_gpu_weight_memory() -> None:
    """57 GiB of weights (vLLM measured 56.88 GiB on the H200); 17 GiB on the GPU leaves
    room for 33 of 128 experts per layer, and --cpu-offload-gb 40 for plain vLLM."""
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    assert abs(sizes.total_bytes / GIB - 56.88) < 0.05
    runs = plan_runs(args("--gpu-weight-gb", "17"), "/m", "dummy", sizes)
    assert [(r.system, r.method) for r in runs] == [
        ("vllm-gpu", "bf16"),
        ("vllm-offload", "bf16"),
        ("kt-hybrid", "AMXINT4"),
        ("kt-hybrid", "AMXINT8"),
    ]
    assert runs[1].cpu_offload_gb == 40
    hybrid = runs[2]
    assert hybrid.env == {"KT_METHOD": "AMXINT4", "KT_NUM_GPU_EXPERTS": "33"}
    assert 16.5 < hybrid.gpu_weight_gb <= 17
    assert {r.gpu_memory_utilization for r in runs} == {0.9}
    shared = plan_runs(args("--gpu-memory-utilization", "0.5"), "/m", "dummy", sizes)
    assert {r.gpu_memory_utilization for r in shared} == {0.5}
    first_hybrid = plan_runs(args("--systems", "kt-hybrid,vllm-gpu"), "/m", "dummy", sizes)
    assert [(r.system, r.method) for r in first_hybrid] == [
        ("kt-hybrid", "AMXINT4"),
        ("kt-hybrid", "AMXINT8"),
        ("vllm-gpu", "bf16"),
    ]


def test_fp8_block_sitting_runs_every_system_on_the_fp8_checkpoint() -> None:
    """--checkpoint fp8-block: the shape as its FP8 release stores it (29 GiB); plain vLLM runs
    FP8 on the GPU, and kt-hybrid reads the routed experts written on the host with
    KT_METHOD=FP8. 9 GiB on the GPU holds 33 of 128 FP8 experts per layer (as 17 GiB of BF16)."""
    sizes = model_sizes(shape_config("qwen3-30b-a3b", "fp8-block"))
    assert abs(sizes.total_bytes / GIB - 29.03) < 0.05
    argv = ("--checkpoint", "fp8-block", "--gpu-weight-gb", "9")
    runs = plan_runs(args(*argv), "/m", "dummy", sizes, "/m-experts")
    assert [(r.system, r.method) for r in runs] == [("vllm-gpu", "fp8"), ("vllm-offload", "fp8"), ("kt-hybrid", "FP8")]
    assert runs[1].cpu_offload_gb == 21
    assert runs[2].env == {"KT_METHOD": "FP8", "KT_NUM_GPU_EXPERTS": "33", "KT_WEIGHT_PATH": "/m-experts"}
    assert shape_config("qwen3-30b-a3b", "fp8-block", layers=24)["num_hidden_layers"] == 24


def test_bf16_experts_sitting_gives_kt_hybrid_movable_experts() -> None:
    """--checkpoint bf16-experts: vLLM's dummy BF16 model everywhere, kt-hybrid's CPU experts
    read by kt-kernel's BF16 reader from files written on the host (the only kind that can
    move to the GPU), so --variant dynamic:KT_DYNAMIC_GPU_EXPERTS=1 runs on the real shape."""
    config = shape_config("qwen3-30b-a3b", "bf16-experts", layers=16)
    assert "quantization_config" not in config and config["num_hidden_layers"] == 16
    sizes = model_sizes(config)
    argv = ("--checkpoint", "bf16-experts", "--systems", "kt-hybrid", "--variant", "dynamic:KT_DYNAMIC_GPU_EXPERTS=1")
    runs = plan_runs(args(*argv), "/m", "dummy", sizes, "/m-experts")
    assert [r.name for r in runs] == ["kt-hybrid-bf16", "kt-hybrid-bf16-dynamic"]
    assert runs[0].env["KT_METHOD"] == "BF16" and runs[0].env["KT_WEIGHT_PATH"] == "/m-experts"
    assert runs[1].env["KT_DYNAMIC_GPU_EXPERTS"] == "1"


def test_real_weights_add_bf16_cpu_experts() -> None:
    runs = plan_runs(args("--systems", "kt-hybrid"), "/m", "auto", model_sizes(SHAPES["qwen3-30b-a3b"]))
    assert [r.method for r in runs] == ["AMXINT4", "AMXINT8", "BF16"]


def test_committed_h200_results_have_the_reported_fields() -> None:
    """The engine runs (every system, both prefill figures) and, from the same sitting,
    the layer timing with its GPU-prefill table."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    report = json.loads((results / "h200_qwen3_30b_a3b.json").read_text())
    systems = {r["system"] for r in report["runs"]}
    assert systems == {"vllm-gpu", "vllm-offload", "kt-hybrid"}
    fields = {"method", "gpu_weight_gb", "decode_bs1_tok_s", "decode_bs16_tok_s", "prefill_tok_s", "prefill_long_tok_s"}
    for run in report["runs"]:
        assert fields <= set(run), run
    assert any(r.get("variant") == "prefill-off" for r in report["runs"])
    layer = json.loads((results / "h200_layer_qwen3_30b_a3b.json").read_text())["layer_benchmark"]
    assert layer["method"] in {r["method"] for r in report["runs"] if r["system"] == "kt-hybrid"}
    table = layer["gpu_prefill"]
    assert layer["gpu_prefill_break_even_tokens"] == min(
        int(n) for n, t in table.items() if t["pipelined_ms"] < t["cpu_path_ms"]
    )
    # The block-FP8 sitting: every system on the FP8 checkpoint, its layer count and the
    # vLLM settings given to all of them recorded.
    fp8 = json.loads((results / "h200_fp8_qwen3_30b_a3b.json").read_text())
    assert {r["system"] for r in fp8["runs"]} == {"vllm-gpu", "vllm-offload", "kt-hybrid"}
    assert fp8["checkpoint"] == "fp8-block" and fp8["layers"] == 24
    assert fp8["host"]["vllm_env"]["VLLM_DEEP_GEMM_WARMUP"] == "skip"
    for run in fp8["runs"]:
        assert fields <= set(run), run


def test_decode_summary_reports_median_and_spread() -> None:
    summary = decode_summary("decode_bs1", [40.0, 30.0, 50.0])
    assert summary == {
        "decode_bs1_tok_s": 40.0,
        "decode_bs1_spread": 0.5,
        "decode_bs1_discarded_pairs": 0,
        "decode_bs1_repeats_tok_s": [40.0, 30.0, 50.0],
    }


def test_decode_summary_without_a_valid_pair() -> None:
    """Every pair of runs discarded (the short run as slow as the long): no figure, not a
    negative rate."""
    summary = decode_summary("decode_bs16", [], discarded=3)
    assert summary["decode_bs16_tok_s"] is None and summary["decode_bs16_spread"] is None
    assert summary["decode_bs16_discarded_pairs"] == 3 and summary["decode_bs16_repeats_tok_s"] == []


def test_prefill_off_check_and_kt_env() -> None:
    """--prefill-off-check repeats the first method with staging off, as a run of its
    own name; --kt-env reaches every kt-hybrid run and is recorded in its env."""
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    argv = ["--systems", "kt-hybrid", "--methods", "AMXINT4", "--prefill-off-check"]
    runs = plan_runs(args(*argv, "--kt-env", "KT_STAGING_MIN_TOKENS=4096"), "/m", "dummy", sizes)
    assert [r.name for r in runs] == ["kt-hybrid-amxint4", "kt-hybrid-amxint4-prefill-off"]
    assert runs[0].env["KT_STAGING_MIN_TOKENS"] == "4096"
    assert runs[1].env["KT_STAGING_MIN_TOKENS"] == "0"
    assert runs[0].max_model_len > 16384  # room for the 16,384-token prompt of prefill_long_tok_s


def test_variants_repeat_the_first_method() -> None:
    """--variant NAME:KT_...: one more run of the first method per variant, its settings over
    --kt-env's, recorded under the run's env and named after the variant."""
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    argv = ["--systems", "kt-hybrid", "--methods", "AMXINT4,AMXINT8", "--kt-env", "KT_METRICS_INTERVAL=1"]
    argv += [
        "--variant",
        "defer-1:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=1",
        "--variant",
        "defer-2:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=2,KT_METRICS_INTERVAL=5",
    ]
    runs = plan_runs(args(*argv), "/m", "dummy", sizes)
    assert [r.name for r in runs] == [
        "kt-hybrid-amxint4",
        "kt-hybrid-amxint8",
        "kt-hybrid-amxint4-defer-1",
        "kt-hybrid-amxint4-defer-2",
    ]
    assert runs[2].env["KT_MAX_DEFERRED_EXPERTS_PER_TOKEN"] == "1" and runs[2].env["KT_METRICS_INTERVAL"] == "1"
    assert runs[3].env["KT_METRICS_INTERVAL"] == "5" and runs[3].method == "AMXINT4"
    for bad in ("defer", "defer:", ":KT_X=1", "defer:VLLM_X=1"):
        with pytest.raises(SystemExit):
            args("--variant", bad)


def test_gather_check_runs_the_first_method_behind_kt_hybrids_scheduler() -> None:
    """--gather-check: the first method again with --scheduler-cls (the engine argument reaches
    `vllm serve` and vLLM's LLM alike), at the plugin's window or at each window given."""
    from vllm_kt_plugin.settings.catalogue import GATHERING_SCHEDULER
    from vllm_kt_tools.bench.load_runs import serve_args
    from vllm_kt_tools.bench.peers import engine_kwargs

    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    argv = ["--systems", "kt-hybrid", "--methods", "AMXINT4,AMXINT8"]
    runs = plan_runs(args(*argv, "--gather-check"), "/m", "dummy", sizes)
    assert [r.name for r in runs] == ["kt-hybrid-amxint4", "kt-hybrid-amxint8", "kt-hybrid-amxint4-gather"]
    assert runs[0].engine_args == {} and runs[2].env == runs[0].env
    assert serve_args(runs[2], 512)[-4:] == ["--scheduler-cls", GATHERING_SCHEDULER, "--quantization", "kt-hybrid"]
    assert engine_kwargs(runs[2].engine_args) == {"scheduler_cls": GATHERING_SCHEDULER}
    runs = plan_runs(args(*argv, "--gather-check", "15,60"), "/m", "dummy", sizes)
    assert [(r.variant, r.env.get("KT_STAGING_GATHER_MS")) for r in runs[2:]] == [
        ("gather-15ms", "15"),
        ("gather-60ms", "60"),
    ]
    for bad in ("0", "fast", "20000"):
        with pytest.raises(SystemExit):
            args("--gather-check", bad)
    with pytest.raises(SystemExit):  # one name for two runs
        plan_runs(args(*argv, "--gather-check", "--variant", "gather:KT_METRICS_INTERVAL=1"), "/m", "dummy", sizes)


def test_kt_env_must_name_a_kt_variable() -> None:
    with pytest.raises(SystemExit):
        args("--kt-env", "VLLM_X=1")


def test_layer_metrics_from_an_engine_log() -> None:
    """KT_METRICS_INTERVAL's lines become per-batch layer timings in the run's JSON; windows
    that mixed batch sizes are left out."""
    from vllm_kt_tools.bench.report import layer_metrics

    def line(forwards: int, cpu: float, gpu: float, wait: float, tokens: float) -> str:
        return (
            f"(EngineCore pid=1) INFO 12-04 06:29:25 [metrics.py:173] kt-hybrid metrics: last 1 s, 48 layers, "
            f"{forwards} layer forwards: per layer forward CPU experts (submit to result) {cpu:.3f} ms, GPU experts "
            f"{gpu:.3f} ms, waiting on the CPU {wait:.3f} ms -> CPU-bound; longest wait: layer 3 (0.5 ms, "
            f"{tokens:.1f} tokens/forward)"
        )

    log = "\n".join(
        [line(100, 0.5, 0.3, 0.2, 1), line(300, 0.7, 0.3, 0.4, 1), line(50, 9, 9, 9, 7.4), line(10, 2, 1, 1, 16)]
    )
    metrics = layer_metrics(log)
    assert metrics == {
        "1": {"cpu_experts_ms": 0.65, "gpu_experts_ms": 0.3, "cpu_wait_ms": 0.35, "layer_forwards": 400, "windows": 2},
        "16": {"cpu_experts_ms": 2.0, "gpu_experts_ms": 1.0, "cpu_wait_ms": 1.0, "layer_forwards": 10, "windows": 1},
    }
    assert layer_metrics("no metrics here") == {}


def test_variant_runs_are_not_the_best_hybrid_and_names_are_unique() -> None:
    """The layer benchmark and the headline figures follow the best *plain* run of a method,
    never a variant (e.g. deferral, which changes the numbers); a variant name comes once."""
    from vllm_kt_tools.bench.report import best_hybrid

    runs = [
        {"system": "kt-hybrid", "method": "AMXINT4", "decode_bs1_tok_s": 40.0},
        {"system": "kt-hybrid", "method": "AMXINT4", "variant": "defer-1", "decode_bs1_tok_s": 50.0},
    ]
    assert best_hybrid(runs) is runs[0]
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    with pytest.raises(SystemExit):
        plan_runs(args("--prefill-off-check", "--variant", "prefill-off:KT_METRICS_INTERVAL=1"), "/m", "dummy", sizes)


def test_append_continues_the_same_sitting(tmp_path: Path) -> None:
    """--append puts an earlier invocation's runs first and keeps both commands; a JSON of
    another shape, checkpoint or GPU weight target is refused."""
    from vllm_kt_tools.cli.bench import continue_sitting

    out = tmp_path / "fp8.json"
    earlier = {"model": "qwen3-30b-a3b", "load_format": "dummy", "target_gpu_weight_gb": 5.0}
    earlier |= {"checkpoint": "fp8-block", "layers": 24, "command": "vllm-kt bench --systems vllm-gpu"}
    sweep = {"AMXINT4": {"layers": 48}}
    out.write_text(json.dumps({**earlier, "runs": [{"system": "vllm-gpu"}], "kernel_sweep": sweep}))
    report = {**earlier, "command": "vllm-kt bench --systems kt-hybrid --append", "runs": []}
    continue_sitting(report, out)
    assert report["runs"] == [{"system": "vllm-gpu"}] and "command" not in report
    assert report["kernel_sweep"] == sweep  # kept: a later --kernel-sweep adds its methods
    assert report["commands"] == ["vllm-kt bench --systems vllm-gpu", "vllm-kt bench --systems kt-hybrid --append"]
    with pytest.raises(SystemExit, match="layers 24 != 48"):
        continue_sitting({**report, "layers": 48}, out)
    continue_sitting(fresh := {**earlier, "runs": []}, tmp_path / "none.json")  # nothing to continue
    assert fresh["runs"] == [] and "commands" not in fresh
    # a second --append to a JSON appended to once (it holds "commands", no "command": the H100
    # sitting of 2026-12-06 stopped here with a KeyError before sglang-kt's retry)
    out.write_text(json.dumps({**{k: v for k, v in report.items() if k != "command"}}))
    third = {**earlier, "command": "vllm-kt bench --systems sglang-kt --append", "runs": []}
    continue_sitting(third, out)
    assert third["commands"] == [*report["commands"], "vllm-kt bench --systems sglang-kt --append"]


def test_prepare_quantizes_what_the_engine_would_load(tmp_path: Path) -> None:
    """--prepare-only fills KT_CACHE_DIR with the random AMX experts an engine start would
    quantize, in the folder that start reads (once: a second call finds them cached)."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import cache_folder, layer_is_cached
    from vllm_kt_tools.bench.engine_runs import RunSpec
    from vllm_kt_tools.bench.prepare import fill_online_cache

    skip_without_kernel("AMXINT8")
    hf_config = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 2, "num_experts": 4, "hidden_size": 128}
    hf_config |= {"moe_intermediate_size": 64, "num_experts_per_tok": 2}
    env = {"KT_METHOD": "AMXINT8", "KT_CACHE_DIR": str(tmp_path / "cache"), "KT_CPUINFER": "1"}
    spec = RunSpec("kt-hybrid", "AMXINT8", model=str(tmp_path / "model"), load_format="dummy", gpu_weight_gb=1, env=env)
    assert fill_online_cache(spec, hf_config) == 2
    folder = cache_folder(
        env["KT_CACHE_DIR"], model=spec.model, model_dir=None, method="AMXINT8", pools=1, shape=(4, 128, 64)
    )
    assert all(layer_is_cached(folder, layer, 4) for layer in (0, 1))
    assert fill_online_cache(spec, hf_config) == 0
    plain = RunSpec("vllm-gpu", "bf16", model=spec.model, load_format="dummy", gpu_weight_gb=1)
    assert fill_online_cache(plain, hf_config) == 0


def test_kernel_sweep_only_before_engines() -> None:
    from vllm_kt_tools.cli.bench import run_sitting

    for mode in ("--prepare-only", "--layer-only"):
        with pytest.raises(SystemExit, match="--kernel-sweep"):
            run_sitting(args("--kernel-sweep", mode))


def test_a_load_sitting_sweeps_the_kernel_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sitting carries its host's speed: --kernel-sweep with --load times bare
    kt-kernel before the first server starts (the sweep and the load stand in here)."""
    from vllm_kt_tools.cli import bench

    order: list[str] = []
    monkeypatch.setattr(bench, "host_info", lambda *a: {})
    monkeypatch.setattr(bench, "sweep_kernels", lambda runs, report, log_dir, a: order.append("sweep"))
    monkeypatch.setattr(bench, "run_load", lambda a, runs, hybrid, report, log_dir: order.append("load") or report)
    argv = ("--kernel-sweep", "--load", "10:2", "--systems", "kt-hybrid", "--workdir", str(tmp_path))
    bench.run_sitting(args(*argv, "--out", str(tmp_path / "load.json")))
    assert order == ["sweep", "load"]


def test_kernel_sweep_runs_bare_kt_kernel_through_every_layer(tmp_path: Path) -> None:
    """--kernel-sweep: each MoE layer's own CPU experts (from the cache an engine reads),
    timed per layer at batch 1 and 16, beside one layer called with one routing."""
    import json

    from vllm_kt_tools.bench.kernel_sweep import kernel_sweep

    skip_without_kernel("AMXINT8")
    hf_config = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 3, "num_experts": 8, "hidden_size": 128}
    hf_config |= {"moe_intermediate_size": 64, "num_experts_per_tok": 2}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf_config))
    env = {"KT_METHOD": "AMXINT8", "KT_CACHE_DIR": str(tmp_path / "cache"), "KT_CPUINFER": "1"}
    result = kernel_sweep(str(model), "dummy", {**env, "KT_NUM_GPU_EXPERTS": "2"}, tokens=[1, 16], steps=3)
    assert result["layers"] == 3 and result["cpu_experts_per_layer"] == 6 and result["threads"] == 1
    assert sorted(result["tokens"]) == ["1", "16"]
    for n, timing in result["tokens"].items():
        assert timing["per_layer_ms"] > 0 and timing["same_layer_same_routing_ms"] > 0
        rate = int(n) / (timing["per_layer_ms"] * 3 / 1e3)
        assert timing["kernel_alone_tok_s"] == pytest.approx(rate, rel=0.01)  # its own rate: no bound


def test_engine_starts_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_KT_ENGINE_LOCK: while one process starts or stops its engine, another's start
    or stop waits (flock, as a second process would see it); unset, nothing is locked."""
    import fcntl

    from vllm_kt_tools.support.engine_lock import LOCK_VARIABLE, engine_lock

    lock = tmp_path / "engine-start.lock"
    monkeypatch.delenv(LOCK_VARIABLE, raising=False)
    with monkeypatch.context() as patch:
        calls: list[tuple] = []
        patch.setattr(fcntl, "flock", lambda *args: calls.append(args))
        with engine_lock():
            pass
        assert calls == []  # unset: nothing is locked
    monkeypatch.setenv(LOCK_VARIABLE, str(lock))
    with engine_lock(), open(lock) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


def test_host_info_records_the_vllm_settings_every_system_ran_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_* variables set for a whole sitting land in the JSON; ours and per-run ones do not."""
    from vllm_kt_tools.bench.host import host_info

    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    monkeypatch.setenv("VLLM_KT_ENGINE_LOCK", "/tmp/lock")
    monkeypatch.setenv("VLLM_API_KEY", "not-for-the-json")
    vllm_env = host_info()["vllm_env"]
    assert vllm_env["VLLM_DEEP_GEMM_WARMUP"] == "skip"
    assert "VLLM_KT_ENGINE_LOCK" not in vllm_env and "VLLM_API_KEY" not in vllm_env


def test_decode_rate_is_the_difference_of_two_runs() -> None:
    """N and 2N new tokens: the N extra decode steps of ``batch`` sequences over the extra
    time; a short run that took as long or longer (a stall) gives no rate."""
    from vllm_kt_tools.bench.engine_child import decode_rate

    assert decode_rate(16, 32, short_s=1.5, long_s=2.5) == 16 * 32 / 1.0
    assert decode_rate(1, 64, short_s=0.5, long_s=1.3) == pytest.approx(80.0)
    assert decode_rate(16, 32, short_s=2.0, long_s=2.0) is None
    assert decode_rate(16, 32, short_s=2.5, long_s=2.0) is None


def test_host_records_cpu_commit_and_kt_kernel_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sittings describe themselves: CPU model, usable cores, kt-kernel's loaded variant, commit."""
    import os

    import kt_kernel

    from vllm_kt_tools.bench.host import COMMIT_VARIABLE, host_info

    monkeypatch.setenv(COMMIT_VARIABLE, "abc1234")
    host = host_info()
    assert "probe_error" not in host, host
    assert host["cpu_model"] and host["cores"] == len(os.sched_getaffinity(0))
    assert host["commit"] == "abc1234"
    assert host["kt_cpu_variant"] == kt_kernel.__cpu_variant__
    monkeypatch.delenv(COMMIT_VARIABLE)
    assert len(host_info()["commit"].removesuffix("-dirty")) == 40  # git's, in this checkout


def test_expected_distinct_experts_of_independent_tokens() -> None:
    """E(1-(1-k/E)^n) against a draw of independent top-k sets: k at n=1, about 82 of 128
    for 16 tokens of top-8 (issue 27), 7.92 of 8 for the tiny model's top-2 at 16."""
    import random

    from vllm_kt_tools.bench.routing import expected_distinct

    assert expected_distinct(128, 8, 1) == pytest.approx(8.0)
    assert 81 < expected_distinct(128, 8, 16) < 83
    rng = random.Random(0)
    for experts, top_k, tokens in ((128, 8, 16), (8, 2, 16), (64, 4, 3)):
        trials = [len({e for _ in range(tokens) for e in rng.sample(range(experts), top_k)}) for _ in range(4000)]
        assert sum(trials) / len(trials) == pytest.approx(expected_distinct(experts, top_k, tokens), rel=0.01)


def test_routing_summary_flags_greedy_like_routing() -> None:
    """Measured sums per layer forward, compared with independent tokens: 16 tokens that
    route like one (greedy dummy decoding) are far outside; a missing count is an error."""
    from vllm_kt_tools.bench.routing import _difference, expected_distinct, routing_summary

    independent = {"layers": 3, "distinct": {"1": 8 * 30, "16": 82 * 30}, "forwards": {"1": 30, "16": 30}}
    summary = routing_summary(independent, 128, 8)
    assert summary["bs1"]["within_tolerance"] and summary["bs16"]["within_tolerance"]
    assert summary["bs16"]["expected_independent"] == round(expected_distinct(128, 8, 16), 2)
    greedy = {**independent, "distinct": {"1": 8 * 30, "16": 8 * 30}}
    assert routing_summary(greedy, 128, 8)["bs16"]["within_tolerance"] is False
    assert "error" in routing_summary({"layers": 0, "error": "none"}, 128, 8)
    since = _difference(independent, {"layers": 3, "distinct": {"1": 8, "16": 82}, "forwards": {"1": 1, "16": 1}})
    assert since["forwards"] == {"1": 29, "16": 29} and since["distinct"]["16"] == 82 * 29


def test_workload_records_the_independent_token_expectation() -> None:
    from vllm_kt_tools.bench.routing import expected_distinct
    from vllm_kt_tools.cli.bench import workload_info

    info = workload_info(args())
    assert info["temperature"] == 1.0
    assert info["expected_distinct_experts"] == {
        "bs1": 8.0,
        "bs16": round(expected_distinct(128, 8, 16), 2),
    }


def _vllm_engine_args(flags: list[str]):
    """vLLM's own parser and EngineArgs on ``vllm serve`` flags: the settings vLLM would take."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", "/m", *flags]))


def test_peers_hold_the_same_gpu_weight_budget() -> None:
    """vllm-offload and vllm-offload-experts offload the 40 GiB beyond 17 (experts only for the
    latter); each prefetch point keeps the fewest offloaded layers whose GPU weights fit 17 GiB."""
    from vllm_kt_tools.bench.peers import DEFAULT_PREFETCH_SWEEP, offloaded_layers

    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    runs = plan_runs(
        args("--systems", "vllm-offload,vllm-offload-experts,vllm-prefetch,kt-hybrid", "--methods", "AMXINT4"),
        "/m",
        "dummy",
        sizes,
    )
    by_system = {}
    for run in runs:
        by_system.setdefault(run.system, []).append(run)
    assert by_system["vllm-offload"][0].cpu_offload_gb == 40
    experts = by_system["vllm-offload-experts"][0]
    assert experts.engine_args == {"cpu_offload_gb": 40.0, "cpu_offload_params": ["experts"]}
    prefetch = by_system["vllm-prefetch"]
    points = [(r.engine_args["offload_group_size"], r.engine_args["offload_prefetch_step"]) for r in prefetch]
    assert tuple(points) == DEFAULT_PREFETCH_SWEEP
    layer = sizes.num_experts * sizes.expert_bytes
    for run in prefetch:
        a = run.engine_args
        group, n, step = a["offload_group_size"], a["offload_num_in_group"], a["offload_prefetch_step"]
        assert a["offload_params"] == ["experts"]

        def gpu(n: int, group: int = group, step: int = step) -> int:
            return sizes.non_expert_bytes + (sizes.layers - offloaded_layers(sizes.layers, group, n) + step) * layer

        assert gpu(n) <= 17 * GIB < gpu(n - 1)  # the fewest offloaded layers that fit
        assert run.variant == f"g{group}-n{n}-p{step}"
        assert run.gpu_weight_gb == round(gpu(n) / GIB, 2)
    assert offloaded_layers(48, 8, 2) == 12  # layers 6, 7, 14, 15, ... (vLLM's own example)


def test_peer_command_lines_are_what_vllm_takes() -> None:
    """The serve flags of each vLLM peer parsed by vLLM 0.32's own CLI; the engine kwargs
    equal; the load generator samples at temperature 1."""
    from vllm_kt_tools.bench.load_runs import bench_serve_command, serve_args
    from vllm_kt_tools.bench.peers import engine_kwargs

    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    runs = plan_runs(args("--systems", "vllm-offload-experts,vllm-prefetch"), "/m", "dummy", sizes)
    experts = _vllm_engine_args(serve_args(runs[0], 256)[2:])  # past --served-model-name NAME
    assert (experts.cpu_offload_gb, set(experts.cpu_offload_params)) == (40.0, {"experts"})
    assert engine_kwargs(runs[0].engine_args)["cpu_offload_params"] == {"experts"}
    prefetch = _vllm_engine_args(serve_args(runs[-1], 256)[2:])
    want = runs[-1].engine_args
    got = (prefetch.offload_group_size, prefetch.offload_num_in_group, prefetch.offload_prefetch_step)
    assert got == (want["offload_group_size"], want["offload_num_in_group"], want["offload_prefetch_step"])
    assert set(prefetch.offload_params) == {"experts"}
    from vllm.config.offload import OffloadConfig, PrefetchOffloadConfig

    OffloadConfig(prefetch=PrefetchOffloadConfig(*got, {"experts"}))  # vLLM's own checks pass
    command = bench_serve_command("http://x", "/m", 10, 2, 128, 16, Path("/tmp/o.json"))
    assert command[command.index("--temperature") + 1] == "1.0"


def test_prefetch_sweep_argument() -> None:
    assert args("--prefetch-sweep", "8:1,16:2").prefetch_sweep == ((8, 1), (16, 2))
    with pytest.raises(SystemExit):
        args("--prefetch-sweep", "8")
    with pytest.raises(SystemExit):
        args("--prefetch-sweep", "8:0")


def test_sglang_kt_launch_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """sglang-kt 0.7.2's server under its own Python, reading the AMX folder the bench
    prepared (one thread pool), 33 GPU experts, dummy GPU weights, FA3 attention and torch's
    sampling (flashinfer's would compile with nvcc); a clear error without SGLANG_PYTHON."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import cache_folder
    from vllm_kt_tools.bench.peers import SGLANG_PYTHON_VARIABLE, SglangKt, prepared_amx_folder

    folder = prepared_amx_folder(str(tmp_path), "/w/model-qwen3-30b-a3b", "AMXINT4", (128, 2048, 768))
    assert folder == cache_folder(
        str(tmp_path), model="/w/model-qwen3-30b-a3b", model_dir=None, method="AMXINT4", pools=1, shape=(128, 2048, 768)
    )
    assert folder.name == "AMXINT4-pools1"
    config = SglangKt(model="/w/m", weight_path=str(folder), cpuinfer=14, max_deferred_experts_per_token=2)
    monkeypatch.delenv(SGLANG_PYTHON_VARIABLE, raising=False)
    with pytest.raises(SystemExit, match=SGLANG_PYTHON_VARIABLE):
        config.command()
    monkeypatch.setenv(SGLANG_PYTHON_VARIABLE, "/opt/sgl/bin/python")
    command = config.command()
    assert command[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"]
    assert "--disable-radix-cache" in command and "--enable-mixed-chunk" not in command
    flags = {f: command[command.index(f) + 1] for f in command if f.startswith("--kt-") or f.endswith("-backend")}
    assert flags == {
        "--attention-backend": "fa3",
        "--sampling-backend": "pytorch",
        "--grammar-backend": "none",
        "--kt-weight-path": str(folder),
        "--kt-method": "AMXINT4",
        "--kt-cpuinfer": "14",
        "--kt-threadpool-count": "1",
        "--kt-num-gpu-experts": "33",
        "--kt-max-deferred-experts-per-token": "2",
        "--kt-gpu-prefill-token-threshold": "0",
    }


def test_sglang_points_refuse_what_sglang_kt_cannot_run() -> None:
    """Its layerwise GPU prefill needs kt-kernel to write experts in GPU layout, which the AMX
    wrapper cannot (AMXMoEWrapper has no submit_write_weight_scale_to_buffer in kt-kernel 0.7.2):
    a threshold with AMX experts is refused before any GPU time, as is the dynamic expert
    update without the layerwise prefill it runs in; native BF16 experts may have both."""
    from vllm_kt_tools.bench.peers import SglangKt

    for method in ("AMXINT4", "AMXINT8"):
        with pytest.raises(ValueError, match="submit_write_weight_scale_to_buffer"):
            SglangKt(model="/m", weight_path="/w", method=method, gpu_prefill_token_threshold=4096)
    with pytest.raises(ValueError, match="layerwise prefill"):
        SglangKt(model="/m", weight_path="/w", method="BF16", dynamic_expert_update=True)
    native = SglangKt(
        model="/m", weight_path="/w", method="BF16", gpu_prefill_token_threshold=4096, dynamic_expert_update=True
    )
    command = native.command(python="py")
    assert command[command.index("--kt-gpu-prefill-token-threshold") + 1] == "4096"
    assert "--kt-enable-dynamic-expert-update" in command


def _sglang_sitting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[list, dict, int]:
    from vllm_kt_plugin.settings.loader import load_settings
    from vllm_kt_tools.cli.bench import sglang_configs

    monkeypatch.setenv("KT_CACHE_DIR", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SHAPES["qwen3-30b-a3b"]))
    bench_args = args("--methods", "AMXINT4", *argv)
    runs = plan_runs(bench_args, str(model), "dummy", model_sizes(SHAPES["qwen3-30b-a3b"]))
    section: dict = {}
    threads = load_settings({"KT_METHOD": "AMXINT4"}).cpuinfer_threads
    return sglang_configs(bench_args, runs, section), section, threads


def test_sglang_kt_takes_kt_hybrids_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang-kt runs kt-hybrid's first method with its GPU experts per layer, on the AMX
    folder --prepare-only fills (KT_CACHE_DIR); --sglang-sweep without a value runs
    KTransformers' documented point first (kt run's 0.8 x logical threads, deferral 2, 4,096-token
    chunks mixed with decodes, 0.92 of the GPU), then kt-hybrid's own settings (its threads, no
    deferral, vllm serve's 8,192-token chunks, 0.9); without kt-hybrid listed, a clear error."""
    import os

    from vllm_kt_tools.bench.peers import prepared_amx_folder
    from vllm_kt_tools.cli.bench import sglang_configs

    configs, section, threads = _sglang_sitting(
        tmp_path, monkeypatch, "--systems", "kt-hybrid,sglang-kt", "--sglang-sweep"
    )
    assert [c.name for c in configs] == ["sglang-kt-documented", "sglang-kt-mirror"]
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    folder = str(prepared_amx_folder(str(tmp_path), str(tmp_path / "model"), "AMXINT4", (128, 2048, 768)))
    assert {(c.method, c.num_gpu_experts, c.weight_path) for c in configs} == {("AMXINT4", 33, folder)}
    assert sizes.gpu_experts_for(17 * GIB) == 33
    documented, mirror = configs
    assert documented.cpuinfer == int(0.8 * os.cpu_count()) and mirror.cpuinfer == threads
    assert (documented.max_deferred_experts_per_token, mirror.max_deferred_experts_per_token) == (2, 0)
    assert (documented.chunked_prefill_size, mirror.chunked_prefill_size) == (4096, 8192)
    assert (documented.mem_fraction_static, mirror.mem_fraction_static) == (0.92, 0.9)
    assert documented.enable_mixed_chunk and mirror.enable_mixed_chunk
    assert {c.gpu_prefill_token_threshold for c in configs} == {0}  # AMX experts: no layerwise prefill
    assert section["sglang_kt"]["weight_path"] == folder
    assert section["sglang_kt"]["sweep"] == ["documented", "mirror"]
    recorded = section["sglang_kt"]["points"]["sglang-kt-documented"]
    assert recorded[recorded.index("--chunked-prefill-size") + 1] == "4096" and "--enable-mixed-chunk" in recorded
    single, _, _ = _sglang_sitting(tmp_path, monkeypatch, "--systems", "kt-hybrid,sglang-kt")
    assert [c.name for c in single] == ["sglang-kt-documented"]  # without the flag: the documented point
    with pytest.raises(SystemExit, match="kt-hybrid"):
        sglang_configs(args("--systems", "sglang-kt"), [], section)


def test_sglang_sweep_points_run_in_the_order_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--sglang-sweep takes point names and THRESHOLD:DEFERRED pairs (on the documented point)
    in the order given; a threshold AMX experts cannot run stops the bench before any GPU time,
    and a malformed list is refused by the parser, naming what it expects."""
    argv = ("--systems", "sglang-kt,kt-hybrid", "--sglang-sweep", "mirror,0:1,documented")
    configs, section, _ = _sglang_sitting(tmp_path, monkeypatch, *argv)
    assert [c.name for c in configs] == ["sglang-kt-mirror", "sglang-kt-t0-d1", "sglang-kt-documented"]
    assert configs[1].max_deferred_experts_per_token == 1 and configs[1].chunked_prefill_size == 4096
    assert section["sglang_kt"]["sweep"] == ["mirror", [0, 1], "documented"]
    with pytest.raises(SystemExit, match="submit_write_weight_scale_to_buffer"):
        _sglang_sitting(tmp_path, monkeypatch, "--systems", "kt-hybrid,sglang-kt", "--sglang-sweep", "4096:2")
    for bad in ("4096", "fastest", ""):
        with pytest.raises(SystemExit):
            args("--systems", "kt-hybrid", "--sglang-sweep", bad)


def test_sglang_run_without_kt_kernels_wrapper_is_failed(tmp_path: Path) -> None:
    """sglang-kt registers kt-kernel's MoE wrapper in an import its model registry only logs
    when it fails; without it the server would hold every expert on the GPU and look fast. A
    run whose log lacks the wrapper's line is marked failed; its GPU weights are read too."""
    from vllm_kt_tools.bench.peers import KT_ACTIVE_LINE, check_sglang_run

    log = tmp_path / "serve.log"
    weights = (
        "[2026-12-07] Load weight end. elapsed=30.1 s, type=Qwen3MoeForCausalLM, avail mem=60.2 GB, mem usage=16.93 GB."
    )
    log.write_text(f"{weights}\n")
    plain = check_sglang_run({"decode_bs1_tok_s": 99.0}, log)
    assert plain["kt_wrapper_active"] is False and "kt-kernel's MoE wrapper" in plain["error"]
    assert plain["gpu_weight_gb"] == 16.93
    log.write_text(f"{weights}\n[KT] ... {KT_ACTIVE_LINE}: 32.0 MiB (shape=...)\n")
    hybrid = check_sglang_run({"decode_bs1_tok_s": 40.0}, log)
    assert hybrid["kt_wrapper_active"] is True and "error" not in hybrid
    failed = check_sglang_run({"error": "RuntimeError: did not start"}, tmp_path / "absent.log")
    assert failed == {"error": "RuntimeError: did not start"}


@pytest.mark.parametrize(
    ("systems", "order"), [("sglang-kt,kt-hybrid", ["sglang", "vllm"]), ("kt-hybrid,sglang-kt", ["vllm", "sglang"])]
)
def test_server_engine_runs_the_systems_in_the_order_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, systems: str, order: list[str]
) -> None:
    """--server-engine starts sglang-kt first when it is listed first (a sitting that may be cut
    short names the figure it needs most first); the servers themselves stand in here."""
    from vllm_kt_tools.cli import bench

    started: list[str] = []
    monkeypatch.setenv("KT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "host_info", lambda *a: {})
    monkeypatch.setattr(bench, "VLLMServer", lambda *a, **k: argparse.Namespace(name="vllm", command=[]))
    monkeypatch.setattr(bench, "sglang_server", lambda *a, **k: argparse.Namespace(name="sglang", command=[]))
    monkeypatch.setattr(bench, "server_engine_run", lambda server, n, res, work, *_: started.append(server.name) or res)
    argv = ("--server-engine", "--systems", systems, "--methods", "AMXINT4", "--workdir", str(tmp_path))
    bench.run_sitting(args(*argv, "--out", str(tmp_path / "server.json")))
    assert started == order
