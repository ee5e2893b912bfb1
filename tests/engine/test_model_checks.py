"""The model check's CI subset (``vllm_kt_tools.model_check.subset``): one architecture per
distinct MoE layer class, checked as ``vllm-kt check-models`` checks every architecture
(tiny model, plain vLLM in bf16 and float32, ``vllm serve --quantization kt-hybrid`` with
half the experts on the CPU), and served as the committed full run says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_kt_tools.model_check import run
from vllm_kt_tools.model_check.subset import CI_SUBSET
from vllm_kt_tools.support.supported_models import load_results


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = os.environ.get("VLLM_KT_TEST_MODEL_CACHE")
    return Path(root) / "model-check" if root else tmp_path_factory.mktemp("model-check")


@pytest.mark.parametrize("architecture", sorted(CI_SUBSET))
def test_the_subset_is_served_as_the_full_run_says(architecture: str, models: Path, tmp_path: Path) -> None:
    result = run.check(architecture, models, tmp_path)
    print(architecture, {k: v for k, v in result.items() if k != "checks"}, result.get("checks"))
    assert result["status"] == run.SERVED, result.get("reason")
    assert load_results()[architecture]["status"] == run.SERVED
    bf16 = result["checks"]["bfloat16"]
    assert bf16["placement"].endswith("4 CPU experts") and bf16["tokens_compared"] == 6 * run.MAX_TOKENS
