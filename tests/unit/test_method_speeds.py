"""KT_METHOD=auto and doctor's "methods" line read the method table the plugin ships, which
is the reduction of the committed measurement (benchmarks/results/, written by `vllm-kt
bench --cpu-methods`); auto picks the fastest method the weights allow and says so in one
log line, naming what to point KT_WEIGHT_PATH at when a faster method needs other weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.cpu_backends.kt_kernel import backend as kt_backend
from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts
from vllm_kt_plugin.cpu_backends.kt_kernel.method_speeds import TABLE, MethodSpeed, measured_table, ranking
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_tools.bench.cpu_methods import METHODS, VARIANTS, plugin_table
from vllm_kt_tools.support.gguf_export import write_random_experts

ROOT = Path(__file__).resolve().parents[2]
FP8 = CheckpointFormat("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})


def committed_result() -> tuple[str, dict]:
    source = measured_table()["source"]
    return source, json.loads((ROOT / source).read_text())


def test_the_shipped_table_is_the_committed_measurement() -> None:
    """Regenerate with the command in the result file (``--plugin-table``)."""
    source, result = committed_result()
    assert source.startswith("benchmarks/results/")
    assert json.loads(TABLE.read_text()) == plugin_table(result, source)


def test_the_measurement_covers_every_variant_and_method() -> None:
    _, result = committed_result()
    assert result["command"].startswith("vllm-kt bench --cpu-methods")
    assert result["shape"]["num_experts"] == 128 and result["shape"]["hidden"] == 2048
    assert set(result["variants"]) == set(VARIANTS)  # the AMX box runs every variant
    for variant, measured in result["variants"].items():
        assert set(measured["methods"]) == {name for name, _, _ in METHODS}, variant
        for name, row in measured["methods"].items():
            assert "skipped" in row or (row["batch_1_ms"] > 0 and row["batch_16_ms"] > 0), (variant, name)


def settings(**env: str):  # noqa: ANN201 - KTSettings
    return load_settings({**env, "KT_METHOD": "auto"}, cores=4, numa_nodes=1)


def fake_ranking(rows: dict[str, float]):  # noqa: ANN201
    speeds = [MethodSpeed(row, {"1": ms, "16": ms * 4}) for row, ms in rows.items()]
    return lambda variant: sorted(speeds, key=lambda s: s.batch_ms["1"])


def test_auto_picks_the_fastest_method_the_checkpoint_allows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kt_backend, "ranking", fake_ranking({"LLAMAFILE Q4_K": 1.0, "AMXINT8": 2.0, "BF16": 3.0}))
    # a build without the AMXINT8 kernel (AVX2 only) skips it for the next the weights allow
    monkeypatch.setattr(kt_backend, "kernel_available", lambda method: method != "AMXINT8")
    assert KTKernelExperts.resolve_method(settings(), CheckpointFormat()).method == "BF16"
    monkeypatch.setattr(kt_backend, "kernel_available", lambda method: True)
    with caplog.at_level(logging.INFO, logger="vllm.kt_hybrid"):
        picked = KTKernelExperts.resolve_method(settings(), CheckpointFormat())
    assert picked.method == "AMXINT8" and picked.auto_method
    (line,) = [r.getMessage() for r in caplog.records if "KT_METHOD=auto" in r.getMessage()]
    assert "KT_METHOD=auto: AMXINT8, the fastest on kt-kernel's" in line
    assert "faster here: LLAMAFILE Q4_K (1 ms at batch 1, 4 ms at batch 16)" in line
    assert "point KT_WEIGHT_PATH at a Q4_K_M GGUF of this model" in line


def test_auto_reads_gguf_weights_with_llamafile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kt_backend, "ranking", fake_ranking({"AMXINT4": 1.0, "LLAMAFILE Q8_0": 2.0}))
    path = write_random_experts(tmp_path / "m.gguf", [0], 4, 64, 256, "Q8_0")
    assert KTKernelExperts.resolve_method(settings(KT_WEIGHT_PATH=str(path)), CheckpointFormat()).method == "LLAMAFILE"
    # a quantized checkpoint without GGUF: its own format (the table's methods cannot read it)
    assert KTKernelExperts.resolve_method(settings(), FP8).method == "FP8"


def test_auto_with_converted_weights_asks_for_their_method(tmp_path: Path) -> None:
    with pytest.raises(KTConfigError, match="KT_METHOD='auto' is invalid .* holds an empty folder; auto picks"):
        KTKernelExperts.resolve_method(settings(KT_WEIGHT_PATH=str(tmp_path)), CheckpointFormat())


def test_auto_on_the_real_table_picks_this_variants_fastest_allowed() -> None:
    import kt_kernel

    from vllm_kt_plugin.cpu_backends.kt_kernel.methods import kernel_available

    ranked = [s for s in ranking(str(kt_kernel.__cpu_variant__)) if kernel_available(s.method)]
    best = next(s for s in ranked if s.method != "LLAMAFILE")
    assert KTKernelExperts.resolve_method(settings(), CheckpointFormat()).method == best.method


def test_a_method_auto_picked_that_the_model_cannot_tile_says_auto() -> None:
    from vllm_kt_plugin.cpu_backends.kt_kernel.backend import check_alignment

    with pytest.raises(KTConfigError, match=r"KT_METHOD='auto \(which picked AMXINT4\)' is invalid"):
        check_alignment("AMXINT4", 128, 64, auto=True)


def test_the_docs_table_is_the_committed_measurement() -> None:
    from vllm_kt_tools.bench.cpu_methods import DOC, replace_doc_table

    source, result = committed_result()
    doc = ROOT.joinpath(*DOC).read_text()
    assert replace_doc_table(doc, result, source) == doc, (
        f"docs/cpu-methods.md's table is stale: run `python -m vllm_kt_tools.bench.cpu_methods {source}`"
    )


def test_doctor_ranks_the_methods_for_this_cpu(tmp_path: Path) -> None:
    """The methods line, on this machine's own kt-kernel build: its measured rows fastest
    first, the fastest named so, and what to point KT_WEIGHT_PATH at where that reads GGUF
    and none is given."""
    import kt_kernel

    from vllm_kt_plugin.cpu_backends.kt_kernel.diagnostics import fastest_here
    from vllm_kt_plugin.cpu_backends.kt_kernel.methods import kernel_available

    variant = str(kt_kernel.__cpu_variant__)
    ranked = [s for s in ranking(variant) if kernel_available(s.method)]
    reason = fastest_here(None).reason
    assert f"on kt-kernel's {variant} build, fastest first" in reason
    rows = [line.strip().split("  ")[0] for line in reason.splitlines()[1 : 1 + len(ranked)]]
    assert rows == [s.row for s in ranked], reason
    assert "the fastest here" in reason.splitlines()[1]
    assert ("point KT_WEIGHT_PATH at" in reason) == (ranked[0].method == "LLAMAFILE")
    gguf = write_random_experts(tmp_path / "m.gguf", [0], 4, 64, 256, "Q8_0")
    assert "point KT_WEIGHT_PATH at" not in fastest_here(str(gguf)).reason
