"""Running the notebooks of examples/ in tests: a kernel on this interpreter, and readers
of the executed notebook's outputs."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 900
KERNEL_NAME = "vllm-kt-plugin-tests"


def notebook_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Any]:
    """``run(name)`` executes examples/<name> in a kernel running this interpreter
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

    def run(name: str) -> Any:
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


def outputs(nb: Any, output_type: str | None = None) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if output_type in (None, o.output_type)]


def stdout(nb: Any) -> str:
    return "".join(o.text for o in outputs(nb, "stream") if o.name == "stdout")


def answer_line(nb: Any) -> str:
    lines = [line for line in stdout(nb).splitlines() if line.startswith("answer:")]
    assert lines, stdout(nb)
    return lines[-1].removeprefix("answer:").strip()
