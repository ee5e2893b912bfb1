"""The notebooks in examples/ that start a vLLM engine run top to bottom (the others:
tests/unit/test_notebook_outputs.py)."""

from __future__ import annotations

import pytest
from kt_testing.notebooks import answer_line, outputs, stdout


def test_offline_llm_notebook(run_notebook, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KT_TEST_MODEL_CACHE", str(tiny_model("qwen3_moe").parent))
    nb = run_notebook("01_offline_llm.ipynb")
    assert not outputs(nb, "error")
    assert answer_line(nb) == "Paris is the capital of France."


def test_serving_openai_notebook(run_notebook, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KT_TEST_MODEL_CACHE", str(tiny_model("qwen3_moe").parent))
    nb = run_notebook("02_serving_openai.ipynb")
    assert not outputs(nb, "error")
    assert answer_line(nb) == "Paris is the capital of France."
    assert "server ready on http://127.0.0.1:" in stdout(nb)


def test_profile_frequency_placement_notebook(run_notebook, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KT_TEST_MODEL_CACHE", str(tiny_model("qwen3_moe").parent))
    nb = run_notebook("03_profile_frequency_placement.ipynb")
    assert not outputs(nb, "error")
    text = stdout(nb)
    uniform = int(text.split("CPU expert evaluations (uniform):")[-1].split()[0])
    frequency = int(text.split("CPU expert evaluations (frequency):")[-1].split()[0])
    assert 0 < frequency < uniform, text
