"""The notebooks in examples/ are committed without outputs, and the one that starts no
engine (the benchmark plot) runs top to bottom (the others: tests/engine/test_notebooks.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kt_testing.notebooks import EXAMPLES, NOTEBOOKS, ROOT, outputs, stdout

from vllm_kt_tools.bench.report import newest_sitting, run_label, sitting_runs

RESULTS = ROOT / "benchmarks" / "results"


def test_notebooks_committed_without_outputs() -> None:
    assert NOTEBOOKS, f"no notebooks in {EXAMPLES}"
    dirty = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                dirty.append(f"{path.name} cell {i}")
    assert not dirty, f"clear the outputs before committing (e.g. `jupyter nbconvert --clear-output`): {dirty}"


def test_benchmark_plot_notebook(run_notebook) -> None:
    """04 shows the newest sitting with engine or server runs, each run labelled with its
    variant, then kt-hybrid's per-forward timeline of its long prompt where it has one."""
    nb = run_notebook("04_benchmark_plot.ipynb")
    assert not outputs(nb, "error")
    table = stdout(nb)
    newest = newest_sitting(RESULTS)
    assert f"sitting: {newest.name}" in table, table
    runs = sitting_runs(json.loads(newest.read_text()))
    for run in runs:
        if "error" not in run:
            assert run_label(run) in table, (run_label(run), table)
    timelines = sum("timeline" in run for run in runs)
    images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) == 1 + min(timelines, 1), outputs(nb)


def test_newest_sitting_follows_the_commit_time(tmp_path: Path) -> None:
    """The sitting is picked by when its file was committed, not by its name."""
    run = {"system": "kt-hybrid", "method": "AMXINT4", "decode_bs1_tok_s": 1.0}
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for name, when in (("b_older.json", "2026-01-01T00:00:00"), ("a_newer.json", "2026-02-01T00:00:00")):
        (tmp_path / name).write_text(json.dumps({"runs": [run]}))
        subprocess.run(["git", "add", name], cwd=tmp_path, check=True)
        dated = {**env, "GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
        subprocess.run(["git", "commit", "-qm", name], cwd=tmp_path, check=True, env=dated)
    (tmp_path / "layer_only.json").write_text(json.dumps({"runs": []}))  # no engine runs: never picked
    assert newest_sitting(tmp_path).name == "a_newer.json"
    assert run_label({"system": "kt-hybrid", "method": "AMXINT4", "variant": "defer-1"}) == "kt-hybrid AMXINT4 defer-1"
