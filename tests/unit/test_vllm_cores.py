"""KT_VLLM_CORES=free (cpu_backends/kt_kernel/cores.py) with real kt-kernel workers, in a child
process: every thread but kt-kernel's moves to the cores its workers leave free, threads started
later follow, kt-kernel's own stay, and its forward still runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_kt_tools.support.child import run_child

pytest.importorskip("kt_kernel")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for kt-kernel, one left free")
def test_free_moves_vllms_threads_off_kt_kernels_cores(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = {"workdir": str(tmp_path), "threads": 1}
    run = run_child("kt_testing.cores_check:pin_beside_kt_kernel", args, env=env, timeout_s=300)
    assert run.result is not None, run.tail()
    result = run.result
    assert result["free"] == cores[1:] and result["finite"], result
    kt = {name: mask for name, mask in result["threads"].items() if name.startswith("numa_")}
    others = {name: mask for name, mask in result["threads"].items() if not name.startswith("numa_")}
    assert kt and all(mask == cores[:1] for mask in kt.values()), kt
    assert result["started"] == {"before": cores[1:], "after": cores[1:]}
    assert all(mask == cores[1:] for mask in others.values()), others
