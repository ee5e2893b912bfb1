"""The GPU tests' committed summary (``bench/pytest_summary.py``) read from the JUnit XML a
real pytest run writes: ids, outcomes, the measured lines each test printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_kt_tools.bench.pytest_summary import summarize

SAMPLE = """
import pytest

def test_measures():
    print("split BF16: drift 0.00012 against GPU prefill off")
    print("unrelated chatter")

@pytest.mark.parametrize("n", [1, 2])
def test_fails_on_two(n):
    assert n == 1, "two is not one"

def test_skipped():
    pytest.skip("no GPU here")
"""


def test_a_real_pytest_run_is_summarized(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    xml = tmp_path / "out.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    command += ["-o", "junit_logging=system-out", "-o", "addopts=", "test_sample.py"]
    subprocess.run(command, cwd=tmp_path, capture_output=True, check=False, timeout=120)
    summary = summarize(xml.read_text())
    by_id = {t["id"]: t for t in summary["tests"]}
    assert summary["totals"] == {"passed": 2, "failed": 1, "skipped": 1}, summary
    assert by_id["test_sample.py::test_measures"]["measured"] == ["split BF16: drift 0.00012 against GPU prefill off"]
    failed = by_id["test_sample.py::test_fails_on_two[2]"]
    assert failed["outcome"] == "failed" and "two is not one" in failed["reason"]
    assert (
        by_id["test_sample.py::test_skipped"]["outcome"] == "skipped"
        and "no GPU" in by_id["test_sample.py::test_skipped"]["reason"]
    )


def test_a_run_killed_before_its_xml_says_so(tmp_path: Path) -> None:
    """run_h200.sh caps the GPU tests' time: pytest killed by it writes no XML, and the summary
    says that instead of failing (the H100 sitting of 2026-12-06 lost its gpu-tests JSON so)."""
    import json

    from vllm_kt_tools.bench.pytest_summary import main

    out = tmp_path / "summary.json"
    main([str(tmp_path / "missing.xml"), "--out", str(out), "--command", "pytest -m gpu"])
    summary = json.loads(out.read_text())
    assert summary["tests"] == [] and "did not finish" in summary["error"] and summary["command"] == "pytest -m gpu"
