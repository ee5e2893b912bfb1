"""model_check.run's verdict where plain vLLM answers in bf16 but not in float32 (pure logic:
the engines are replaced by recorded answers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_kt_tools.model_check import engines, run

ARCH = "Qwen3MoeForCausalLM"
PLACED = (
    "kt-hybrid: each MoE layer keeps experts 0-3 on the GPU and 4-7 on the CPU; "
    "GPU side: UnquantizedFusedMoEMethod, CPU side: kt_kernel BF16 with 2 threads\n"
)


def _answers(ids: list[int]) -> list[dict[str, Any]]:
    step = {"ids": ids, "top2": [[-0.1, -3.0]] * len(ids), "top2_ids": [[t, 0] for t in ids]}
    return [{**step, "forced": [-0.1] * len(ids), "forced_ids": ids}] * 6


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(run, "checkpoint_dir", lambda arch, models: tmp_path)
    monkeypatch.setattr(run, "weights_of", lambda model: "trained")
    monkeypatch.setattr(run, "prompt_ids", lambda model: [[1, 2]] * 6)
    monkeypatch.setattr(engines, "served", lambda *a, **k: _answers([5, 6]))
    (tmp_path / f"{ARCH}-kt-bfloat16.log").write_text(PLACED)


def test_plain_vllm_failing_in_float32_leaves_the_bf16_verdict_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_model: None
) -> None:
    plain = {"bfloat16": _answers([5, 6]), "float32_error": "RuntimeError: bf16 only"}
    monkeypatch.setattr(engines, "in_process", lambda *a, **k: plain)
    result = run._check(ARCH, tmp_path, tmp_path)
    assert result["status"] == run.SERVED
    assert result["float32"] == "plain vLLM float32 fails here: RuntimeError: bf16 only"
    assert set(result["checks"]) == {"bfloat16"}


def test_kt_hybrid_missing_its_float32_answers_still_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_model: None
) -> None:
    plain = {"bfloat16": _answers([5, 6]), "float32": _answers([5, 6])}
    monkeypatch.setattr(engines, "in_process", lambda *a, **k: plain)
    (tmp_path / f"{ARCH}-plain.log").write_text("RuntimeError: torch backend broke\n")
    result = run._check(ARCH, tmp_path, tmp_path)
    assert result["status"] == run.FAILED
    assert "float32" in result["reason"]


def test_nan_logprobs_on_both_sides_fail_the_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_model: None
) -> None:
    # a tiny model with unloaded weights: NaN logits, token 0 everywhere, on both sides alike
    nan = [{**a, "top2": [[float("nan")] * 2] * 2, "forced": [float("nan")] * 2} for a in _answers([0, 0])]
    monkeypatch.setattr(engines, "in_process", lambda *a, **k: {"bfloat16": nan, "float32_error": "bf16 only"})
    monkeypatch.setattr(engines, "served", lambda *a, **k: nan)
    result = run._check(ARCH, tmp_path, tmp_path)
    assert result["status"] == run.FAILED
    assert "NaN" in result["reason"]


def test_equal_tokens_without_a_placed_moe_layer_fail_the_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_model: None
) -> None:
    # a tiny model written with dense layers only (GLM-5's once): kt-hybrid wraps nothing, and
    # its tokens equal plain vLLM's without any expert on the CPU
    monkeypatch.setattr(engines, "in_process", lambda *a, **k: {"bfloat16": _answers([5, 6]), "float32_error": "x"})
    (tmp_path / f"{ARCH}-kt-bfloat16.log").write_text("kt-hybrid's server log, no MoE layer\n")
    result = run._check(ARCH, tmp_path, tmp_path)
    assert result["status"] == run.FAILED
    assert "no MoE layer placement" in result["reason"]


def test_a_draft_or_wrapper_without_a_recipe_follows_its_base(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # an MTP draft transformers ships no class of: not "no tiny model can be written" (which the
    # table would show as its status) but no recipe, so that the table gives it its base's row
    monkeypatch.setitem(run.DRAFT_OF, "X", ("Base", "an MTP draft"))
    monkeypatch.setattr(run, "import_failure", lambda arch: None)
    monkeypatch.setattr(run, "refuses_this_platform", lambda arch: None)
    monkeypatch.setattr(run, "unbuildable", lambda arch: "transformers ships no `X` model class")
    result = run._check("X", tmp_path, tmp_path)
    assert result["status"] == run.NO_RECIPE and "`Base`" in result["reason"]
    monkeypatch.setattr(run, "import_failure", lambda arch: "ModuleNotFoundError: No module named 'torchvision'")
    assert run._check("X", tmp_path, tmp_path)["status"] == run.CANNOT_CHECK  # its module must import here
