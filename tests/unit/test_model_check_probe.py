"""The model check's verdicts where plain vLLM rejects the tiny model itself: a second run of
plain vLLM with its own dummy weights (``probe``) tells this build's failure from the recipe's."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kt_tools.model_check import engines, probe, run

REJECTED = "ValueError: There is no module or parameter named 'model.x' in M"
LOADER_LOG = f"INFO loading\n{REJECTED}"


@pytest.fixture
def rejected_tiny_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Plain vLLM rejects the tiny model's tensor names (no engine runs, no model is written)."""

    def in_process(*args: object, **kwargs: object) -> dict:
        raise engines.EngineFailed("plain vLLM", LOADER_LOG)

    monkeypatch.setattr(run, "checkpoint_dir", lambda architecture, models: tmp_path)
    monkeypatch.setattr(run, "prompt_ids", lambda model: [[1, 2, 3]])
    monkeypatch.setattr(run, "weights_of", lambda model: "random")
    monkeypatch.setattr(engines, "in_process", in_process)
    return tmp_path


def test_a_build_failure_with_dummy_weights_cannot_be_checked(
    rejected_tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_error = "TypeError: 'function' object is not subscriptable"
    monkeypatch.setattr(probe, "with_dummy_weights", lambda model, prompts, log: f"Traceback\n{build_error}")
    result = run._check("MixtralForCausalLM", rejected_tiny_model, rejected_tiny_model)
    assert result["status"] == run.CANNOT_CHECK
    assert result["reason"] == f"plain vLLM fails here with vLLM's own dummy weights: {build_error}"
    assert result["tiny_model_rejected"] == f"plain vLLM fails here: {REJECTED}"


@pytest.mark.parametrize("dummy_log", [None, f"Traceback\n{REJECTED}"])
def test_an_architecture_vllm_runs_with_dummy_weights_stays_the_recipes_fault(
    rejected_tiny_model: Path, monkeypatch: pytest.MonkeyPatch, dummy_log: str | None
) -> None:
    """Dummy weights answering (None), or failing for the tiny model's own reason: not checked."""
    monkeypatch.setattr(probe, "with_dummy_weights", lambda model, prompts, log: dummy_log)
    result = run._check("MixtralForCausalLM", rejected_tiny_model, rejected_tiny_model)
    assert result["status"] == run.NO_RECIPE and result["reason"] == f"plain vLLM fails here: {REJECTED}"
