"""The GGML types the plugin accepts for LLAMAFILE experts are the ones kt-kernel computes
correctly (real kt-kernel, one small layer per type against gguf-py's dequantization:
``vllm_kt_tools.support.llamafile_check``), in this CPU's own variant and in the AVX2 one;
and the types it refuses do fail: Q4_1 aborts the process, BF16 is NaN below AVX512-BF16.
Each variant runs in a child process (kt-kernel loads one per process)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from kt_testing.hardware import kt_variant

from vllm_kt_plugin.cpu_backends.kt_kernel.gguf_files import LLAMAFILE_TYPES, llamafile_types
from vllm_kt_tools.cli.doctor import cpu_flags_from_cpuinfo
from vllm_kt_tools.support.child import run_child

pytest.importorskip("kt_kernel")

TARGET = "vllm_kt_tools.support.llamafile_check:relative_errors"
# Measured 0.002 (F32, F16, BF16), 0.011-0.012 (Q8_0, Q4_0, Q5_0), 0.017-0.022 (Q4_K, Q5_K,
# Q6_K) in every variant on the AMX box, 2026-12-06: the activations are quantized to 8 bits
# as llama.cpp does. Bound: 0.05, over twice the largest; a wrong layout gives ~1.
ERROR_BOUND = 0.05


def in_variant(variant: str, types: list[str], workdir: Path, hidden: int = 256):  # noqa: ANN201 - ChildRun
    env = {**os.environ, "KT_KERNEL_CPU_VARIANT": variant}
    return run_child(TARGET, {"workdir": str(workdir), "types": types, "hidden": hidden}, env=env, timeout_s=300)


@pytest.mark.parametrize("variant", sorted({"avx2", "here"}))
def test_accepted_types_compute_correctly(tmp_path: Path, variant: str) -> None:
    variant = kt_variant() if variant == "here" else variant
    types = list(llamafile_types(variant))
    run = in_variant(variant, types, tmp_path)
    assert run.result is not None, run.tail()
    assert run.result["variant"] == variant
    for type_name in types:
        worst = max(run.result["errors"][type_name])
        print(f"{variant} {type_name}: {worst:.4f}")
        assert worst < ERROR_BOUND, f"{variant} {type_name}: relative error {worst:.4f}"


def test_refused_q4_1_does_fail(tmp_path: Path) -> None:
    """The refusal is needed: Q4_1 aborts kt-kernel's process ("llamafile not supported")."""
    assert "Q4_1" not in LLAMAFILE_TYPES
    run = in_variant(kt_variant(), ["Q4_1"], tmp_path / "q4_1")
    assert run.result is None and run.returncode != 0 and "llamafile not supported" in run.log, run.tail()


def test_refused_bf16_does_fail_below_avx512_bf16(tmp_path: Path) -> None:
    """The refusal is needed: BF16 experts come out NaN or wrong with the AVX-512 builds
    without AVX512-BF16 (run here in kt-kernel's avx512_base build, which an AVX2-only CPU
    cannot execute: SIGILL)."""
    assert "BF16" not in llamafile_types("avx512_base")
    if "avx512f" not in cpu_flags_from_cpuinfo(Path("/proc/cpuinfo").read_text()):
        pytest.skip("this CPU has no AVX-512, so it cannot run kt-kernel's avx512_base build")
    run = in_variant("avx512_base", ["BF16"], tmp_path / "bf16")
    assert run.result is not None, run.tail()
    error = run.result["errors"]["BF16"][0]
    assert math.isnan(error) or error > 0.5, error


def test_hidden_sizes_off_the_256_grid_compute_wrongly(tmp_path: Path) -> None:
    """Why LLAMAFILE needs hidden_size % 256 == 0 too (backend.check_alignment): Q8_0 experts
    of hidden 128 come out zero, of 384 wrong, for 16 tokens (one token is right), with no
    error from kt-kernel."""
    for hidden, least in ((128, 0.99), (384, 0.3)):
        run = in_variant(kt_variant(), ["Q8_0"], tmp_path / str(hidden), hidden=hidden)
        assert run.result is not None, run.tail()
        assert max(run.result["errors"]["Q8_0"]) > least, (hidden, run.result)  # at 16 tokens (1 is right)
