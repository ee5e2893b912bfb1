"""The notebooks in examples/ are committed without outputs, and the one that starts no
engine (the benchmark plot) runs top to bottom (the others: tests/engine/test_notebooks.py)."""

from __future__ import annotations

import json

from kt_testing.notebooks import EXAMPLES, NOTEBOOKS, outputs, stdout


def test_notebooks_committed_without_outputs() -> None:
    assert NOTEBOOKS, f"no notebooks in {EXAMPLES}"
    dirty = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                dirty.append(f"{path.name} cell {i}")
    assert not dirty, f"clear the outputs before committing (e.g. `jupyter nbconvert --clear-output`): {dirty}"


def test_benchmark_plot_notebook(run_notebook) -> None:
    nb = run_notebook("04_benchmark_plot.ipynb")
    assert not outputs(nb, "error")
    table = stdout(nb)
    assert "kt-hybrid" in table and "AMXINT4" in table and "vllm-offload" in table, table
    images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) == 1, outputs(nb)
