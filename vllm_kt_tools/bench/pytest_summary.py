"""A sitting's GPU tests as a committed summary (issue 27): each test's id, outcome and
time, and the lines it printed that carry a measurement (``drift``, ``differ``, ``swaps``),
from the JUnit XML pytest writes (``--junitxml``, with ``-o junit_logging=system-out`` so
that what a test printed is kept beside it).

    python -m vllm_kt_tools.bench.pytest_summary gpu-tests.xml --out h200_gpu_tests.json

The JSON is the tool's, never edited: a bound set from a sitting names this file.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench.host import host_info

# Words of the lines a test prints with what it measured (tests/engine/test_gpu.py and the like).
MEASURED = ("drift", "differ", "swaps", "staged")


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    return "passed"


def _test_id(case: ET.Element) -> str:
    """pytest's node id back from JUnit's classname (dotted module path) and name."""
    classname, name = case.get("classname", ""), case.get("name", "")
    return f"{classname.replace('.', '/')}.py::{name}" if classname else name


def summarize(junit_xml: str) -> dict[str, Any]:
    """Each test case's id, outcome, seconds, measured lines (and the reason where it did
    not pass), with the totals per outcome."""
    root = ET.fromstring(junit_xml)
    tests: list[dict[str, Any]] = []
    for case in root.iter("testcase"):
        entry: dict[str, Any] = {
            "id": _test_id(case),
            "outcome": _outcome(case),
            "seconds": round(float(case.get("time") or 0.0), 1),
        }
        printed = "\n".join(node.text or "" for node in case.iter("system-out"))
        measured = [line.strip() for line in printed.splitlines() if any(word in line for word in MEASURED)]
        if measured:
            entry["measured"] = measured
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                entry["reason"] = (found.get("message") or "").strip()[:500]
        tests.append(entry)
    totals: dict[str, int] = {}
    for entry in tests:
        totals[entry["outcome"]] = totals.get(entry["outcome"], 0) + 1
    return {"totals": totals, "tests": tests}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", default="", help="the pytest command that wrote the XML, recorded")
    args = parser.parse_args(argv)
    if args.junit_xml.exists():
        results = summarize(args.junit_xml.read_text())
    else:  # pytest killed before it wrote the XML (run_h200.sh's GPU_TESTS_TIMEOUT): said, not lost
        results = {"totals": {}, "tests": [], "error": f"no {args.junit_xml.name}: pytest did not finish"}
    summary = {"host": host_info(), "command": args.command, **results}
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{args.out}: {summary['totals']}")


if __name__ == "__main__":
    main()
