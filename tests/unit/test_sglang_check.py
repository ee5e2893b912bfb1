"""The sitting's first sglang-kt step (``python -m vllm_kt_tools.bench.sglang_check`` under
sglang-kt's Python): on the first failure, ONE line saying what failed and exit 1, so that the
sitting drops its sglang-kt part. What a CPU can show: the verdicts, and the step run as a
process against a broken install (a stand-in ``sgl_kernel`` that fails as 0.7.2's did on the
H100) and against this GPU-less host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_kt_tools.bench.sglang_check import CheckFailed, common_ops_verdict, one_line, run_steps

ROOT = Path(__file__).resolve().parents[2]
# sgl_kernel 0.3.21's error on an H100 without sm90/common_ops (the 2026-12-06 sitting's log)
SGL_KERNEL_ERROR = """
[sgl_kernel] CRITICAL: Could not load any common_ops library!

Attempted locations:
1. Architecture-specific pattern: /root/sglsite/sgl_kernel/sm90/common_ops.* - found files: []
"""


def test_sm90_ops_are_required_on_capability_9_0() -> None:
    sm90 = "/root/sglsite/sgl_kernel/sm90/common_ops.abi3.so"
    sm100 = (
        "/root/sglsite/sgl_kernel/_payload_cache/sgl-kernel-kt/0.3.21.post2/8f0b/sgl_kernel/sm100/common_ops.abi3.so"
    )
    assert common_ops_verdict((9, 0), sm90) is None
    assert common_ops_verdict((9, 0), sm100) == f"capability 9.0 loaded {sm100}, not sgl_kernel/sm90/common_ops"
    assert common_ops_verdict((10, 0), sm100) is None and common_ops_verdict(None, sm100) is None


def test_steps_stop_at_the_first_failure_in_one_line() -> None:
    ran: list[str] = []

    def fine() -> str:
        ran.append("fine")
        return "torch 2.9.1"

    def broken() -> None:
        raise ImportError(SGL_KERNEL_ERROR)

    def never() -> None:
        ran.append("never")

    notes, failure = run_steps([("torch", fine), ("sgl_kernel", broken), ("kt_kernel", never)])
    assert ran == ["fine"] and notes == ["torch 2.9.1"]
    assert failure == "sgl_kernel: ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!"

    def refused() -> None:
        raise CheckFailed("kt-kernel's MoE wrapper (kt_ep) is not registered")

    assert (
        run_steps([("model registry", refused)])[1]
        == "model registry: kt-kernel's MoE wrapper (kt_ep) is not registered"
    )
    assert (
        one_line(ModuleNotFoundError("No module named 'IPython'")) == "ModuleNotFoundError: No module named 'IPython'"
    )


def run_check(*argv: str, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    paths = [str(path)] if path else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)])}
    command = [sys.executable, "-m", "vllm_kt_tools.bench.sglang_check", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_a_broken_install_stops_the_sitting_with_one_line(tmp_path: Path) -> None:
    """torch imports (this CPU's, with --no-gpu), then sgl_kernel fails: one line of ours, exit 1."""
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text(f"raise ImportError({SGL_KERNEL_ERROR!r})\n")
    proc = run_check("--no-gpu", path=tmp_path)
    assert proc.returncode == 1
    ours = [line for line in proc.stdout.splitlines() if line.startswith("[sglang-check]")]
    assert ours == [
        "[sglang-check] FAILED sgl_kernel: ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!"
    ]
    assert proc.stdout.strip().splitlines()[-1] == ours[0]  # the last line: what the sitting's log shows


def test_no_gpu_is_a_failure_on_the_sitting_host() -> None:
    proc = run_check()
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1].startswith("[sglang-check] FAILED torch: torch ")
    assert proc.stdout.strip().endswith("sees no CUDA device")
