"""The notebooks in examples/ run top to bottom, and are committed without outputs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 900
KERNEL_NAME = "vllm-kt-plugin-tests"


def test_notebooks_committed_without_outputs() -> None:
    assert NOTEBOOKS, f"no notebooks in {EXAMPLES}"
    dirty = []
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                dirty.append(f"{path.name} cell {i}")
    assert not dirty, f"clear the outputs before committing (e.g. `jupyter nbconvert --clear-output`): {dirty}"


@pytest.fixture
def run_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``run_notebook(name)`` executes examples/<name> in a kernel running this interpreter
    (a kernel spec in a temp dir, first on JUPYTER_PATH: no user or system kernel named
    python3 can pick another Python), with the repository root as cwd. Returns the
    executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL_NAME, "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    for name in [k for k in os.environ if k.startswith("KT_")]:  # the notebooks set their own
        monkeypatch.delenv(name)

    def run(name: str) -> nbformat.NotebookNode:
        nb = nbformat.read(EXAMPLES / name, as_version=4)
        client = NotebookClient(
            nb,
            kernel_name=KERNEL_NAME,
            timeout=CELL_TIMEOUT_S,
            resources={"metadata": {"path": str(ROOT)}},
        )
        client.execute()  # raises CellExecutionError, with the traceback, when a cell fails
        return nb

    return run


def outputs(nb, output_type: str | None = None) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if output_type in (None, o.output_type)]


def stdout(nb) -> str:
    return "".join(o.text for o in outputs(nb, "stream") if o.name == "stdout")


def answer_line(nb) -> str:
    lines = [line for line in stdout(nb).splitlines() if line.startswith("answer:")]
    assert lines, stdout(nb)
    return lines[-1].removeprefix("answer:").strip()


@pytest.mark.engine
def test_offline_llm_notebook(run_notebook, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KT_TEST_MODEL_CACHE", str(tiny_model("qwen3_moe").parent))
    nb = run_notebook("01_offline_llm.ipynb")
    assert not outputs(nb, "error")
    assert answer_line(nb) == "Paris is the capital of France."


@pytest.mark.engine
def test_serving_openai_notebook(run_notebook, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KT_TEST_MODEL_CACHE", str(tiny_model("qwen3_moe").parent))
    nb = run_notebook("02_serving_openai.ipynb")
    assert not outputs(nb, "error")
    assert answer_line(nb) == "Paris is the capital of France."
    assert "server ready on http://127.0.0.1:" in stdout(nb)


def test_benchmark_plot_notebook(run_notebook) -> None:
    nb = run_notebook("04_benchmark_plot.ipynb")
    assert not outputs(nb, "error")
    table = stdout(nb)
    assert "kt-hybrid" in table and "AMXINT4" in table and "vllm-offload" in table, table
    images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) == 1, outputs(nb)


@pytest.mark.engine
def test_profile_frequency_placement_notebook(run_notebook, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KT_TEST_MODEL_CACHE", str(tiny_model("qwen3_moe").parent))
    nb = run_notebook("03_profile_frequency_placement.ipynb")
    assert not outputs(nb, "error")
    text = stdout(nb)
    uniform = int(text.split("CPU expert evaluations (uniform):")[-1].split()[0])
    frequency = int(text.split("CPU expert evaluations (frequency):")[-1].split()[0])
    assert 0 < frequency < uniform, text
