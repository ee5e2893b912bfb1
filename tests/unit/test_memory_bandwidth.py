"""The host's memory bandwidth with kt-kernel's thread count, and the decode limit it implies
(issue 37): every sitting's JSON carries both, beside the engine figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from kt_testing.hardware import skip_without_kernel

from vllm_kt_tools.bench.memory_bandwidth import decode_limit, expert_bytes, read_bandwidth
from vllm_kt_tools.bench.shapes import SHAPES, model_sizes


def test_bandwidth_is_measured_with_the_threads_given() -> None:
    """Real passes over a buffer (a small one here, to be quick): the best of them, all recorded."""
    measured = read_bandwidth(threads=1, buffer_bytes=64 << 20, repeats=3)
    assert measured["threads"] == 1 and len(measured["passes_gb_s"]) == 3
    assert measured["read_gb_s"] == max(measured["passes_gb_s"]) > 0.1  # any machine reads 0.1 GB/s


@pytest.mark.parametrize("method", ["AMXINT4", "AMXINT8"])
def test_expert_bytes_are_kt_kernels_own(tmp_path: Path, method: str) -> None:
    """The bytes per expert the limit reads are those of the files kt-kernel writes for the
    method (its quantized weights and scales), on a shape whose gate/up and down differ."""
    from vllm_kt_tools.bench.kernel_sweep import kernel_sweep

    skip_without_kernel(method)
    config = {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2}
    config |= {"hidden_size": 256, "moe_intermediate_size": 128}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    env = {"KT_METHOD": method, "KT_CACHE_DIR": str(tmp_path / "cache"), "KT_CPUINFER": "1", "KT_NUM_GPU_EXPERTS": "0"}
    kernel_sweep(str(model), "dummy", env, tokens=[1], steps=1)  # quantizes the layer, as an engine would
    files = list((tmp_path / "cache").rglob("_numa_0/*.kt"))
    assert len(files) == 6 * 4
    assert sum(f.stat().st_size for f in files) == 4 * expert_bytes(method, 256, 128)


def test_decode_limit_reads_the_distinct_cpu_experts_of_a_step() -> None:
    """Qwen3-30B-A3B with 33 of 128 experts per layer on the GPU, AMXINT4: a batch-1 step
    reads 8 x 95/128 experts per layer, a batch-16 step 95 x (1 - (1 - 8/128)^16) ≈ 61.2."""
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    per_expert = expert_bytes("AMXINT4", 2048, 768)
    assert per_expert == 3 * 2048 * 768 // 2 + 4 * (2 * 768 + 2048)  # 4-bit weights, an fp32 scale per row
    limit = decode_limit(100.0, "AMXINT4", 2048, 768, sizes.layers, 128, 8, gpu_experts=33)
    assert limit["cpu_experts_per_layer"] == 95
    assert limit["bs1"]["distinct_cpu_experts_per_layer"] == pytest.approx(8 * 95 / 128, abs=0.01)
    assert limit["bs1"]["tok_s"] == pytest.approx(100e9 / (48 * 8 * 95 / 128 * per_expert), rel=1e-3)
    assert limit["bs16"]["distinct_cpu_experts_per_layer"] == pytest.approx(61.17, abs=0.01)
    assert limit["bs16"]["tok_s"] == pytest.approx(16 * 100e9 / (48 * 61.17 * per_expert), rel=1e-3)
    assert decode_limit(100.0, "LLAMAFILE", 2048, 768, 48, 128, 8, 33) is None  # a format it does not know
    assert decode_limit(100.0, "BF16", 128, 64, 3, 8, 2, gpu_experts=8) is None  # every expert on the GPU


def test_every_sitting_records_the_bandwidth_and_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """host_info measures with the thread count given; the bench puts the limit of each
    kt-hybrid method (not its variants) beside the runs, and the table shows it under them,
    with bare kt-kernel's own rate (old JSONs' decode_bound_tok_s read as such)."""
    from vllm_kt_tools.bench.engine_runs import plan_runs
    from vllm_kt_tools.bench.host import host_info
    from vllm_kt_tools.bench.table import markdown_table
    from vllm_kt_tools.cli.bench import add_arguments, decode_limits

    monkeypatch.setattr(read_bandwidth, "__defaults__", (64 << 20, 2))  # quick here; the sitting reads 2 GiB
    host = host_info(kt_threads=2)
    assert host["memory_bandwidth"]["threads"] == 2 and host["memory_bandwidth"]["read_gb_s"] > 0
    assert "memory_bandwidth" not in host_info()
    sizes = model_sizes(SHAPES["qwen3-30b-a3b"])
    argv = (
        "--systems",
        "kt-hybrid",
        "--methods",
        "AMXINT4,AMXINT8",
        "--variant",
        "d:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=1",
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    runs = plan_runs(parser.parse_args(list(argv)), "/m", "dummy", sizes)
    limits = decode_limits({"memory_bandwidth": {"read_gb_s": 200.0}}, runs, sizes)
    assert sorted(limits) == ["AMXINT4", "AMXINT8"]
    assert limits["AMXINT4"]["bs1"]["tok_s"] > limits["AMXINT8"]["bs1"]["tok_s"]  # half the bytes
    assert decode_limits({}, runs, sizes) == {}
    sweep = {"AMXINT4": {"tokens": {"1": {"decode_bound_tok_s": 44.8}, "16": {"kernel_alone_tok_s": 68.5}}}}
    header, _, *rows = markdown_table({"runs": [], "decode_limit": limits, "kernel_sweep": sweep}).splitlines()
    after_decode = header.count(" | ") + 1 - 4  # every column after the two decode ones shows "—"
    bs1, bs16 = (limits["AMXINT4"][f"bs{n}"]["tok_s"] for n in (1, 16))
    assert rows[0] == (
        f"| memory-bandwidth limit, AMXINT4 (200 GB/s read) | — | {bs1:.1f} tok/s | {bs16:.1f} tok/s |"
        + " — |" * after_decode
    )
    assert rows[2].startswith("| bare kt-kernel alone, AMXINT4 (kernel sweep) | — | 44.8 tok/s | 68.5 tok/s |")
    # the chart draws them over the decode panels only
    from vllm_kt_tools.bench.report import _decode_limits

    report = {"decode_limit": limits}
    assert _decode_limits(report, "decode_bs16_tok_s")[0] == ("AMXINT4", bs16)
    assert _decode_limits(report, "prefill_long_tok_s") == []
