"""The README stays a short user guide, and its benchmark table is the tool's output for the
JSON it names, not typed by hand."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_kt_tools.bench.table import markdown_table, table_of

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300  # a user guide; design notes, every setting, benchmarks and contributing live in docs/
MARKER = re.compile(r"<!-- generated: python -m vllm_kt_tools\.bench\.table (?P<paths>[^>]+?) -->\n")


def test_readme_table_is_generated_from_the_sitting_it_names() -> None:
    readme = (ROOT / "README.md").read_text()
    found = MARKER.search(readme)
    assert found, "the README's benchmark table must name the JSON it was generated from"
    table = table_of([ROOT / path for path in found["paths"].split()])
    assert readme[found.end() : found.end() + len(table)] == table, (
        "regenerate it: python -m vllm_kt_tools.bench.table " + found["paths"]
    )


def test_table_rows_say_what_was_not_measured() -> None:
    run = {"system": "sglang-kt", "method": "AMXINT4", "via": "server", "decode_bs1_tok_s": 12.34, "error": "x"}
    [row] = markdown_table({"runs": [run]}).splitlines()[2:]
    assert row.startswith("| sglang-kt AMXINT4, through its server (failed: see the JSON) | n/a | 12.3 tok/s | n/a")


def test_a_failed_run_that_a_retry_measured_is_left_out() -> None:
    failed = {"system": "sglang-kt", "method": "AMXINT4", "variant": "documented", "error": "x"}
    other = {**failed, "variant": "mirror"}
    retry = {"system": "sglang-kt", "method": "AMXINT4", "variant": "documented", "decode_bs1_tok_s": 30.0}
    rows = markdown_table({"runs": [failed, other, retry]}).splitlines()[2:]
    assert len(rows) == 2
    assert "(mirror) (failed" in rows[0] and "(documented)" in rows[1] and "30.0 tok/s" in rows[1]


def test_readme_stays_a_user_guide() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/ (at most {README_MAX_LINES})"
    for link in re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text()):
        assert (ROOT / link).is_file(), f"README links {link}, which does not exist"
