"""The Supported-models table (vllm_kt_tools/support/supported_models.py): every MoE
architecture of the installed vLLM's registry with its status, the committed README section
and docs page equal to what it generates, and the config-time refusals it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vllm_kt_plugin.architectures import REFUSED_ARCHITECTURES, architecture_refusal, check_architecture
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_tools.support import supported_models
from vllm_kt_tools.support.tiny_models import ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_tables_are_the_generated_ones() -> None:
    readme = (ROOT / "README.md").read_text()
    assert supported_models.replace_readme_section(readme) == readme, (
        "README.md's Supported-models table is stale: run `python -m vllm_kt_tools.support.supported_models`"
    )
    assert (ROOT / "docs" / "supported_models.md").read_text() == supported_models.docs_page(), (
        "docs/supported_models.md is stale: run `python -m vllm_kt_tools.support.supported_models`"
    )


def test_every_registry_moe_architecture_has_a_status() -> None:
    rows = {row.architecture: row for row in supported_models.rows()}
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"} <= set(rows)
    assert "LlamaForCausalLM" not in rows and "Qwen3ForCausalLM" not in rows  # dense
    # Modules that build no MoE layer of their own but reuse another's (a multimodal wrapper,
    # a variant) are rows too, named with the module they reuse.
    assert "`qwen3_moe`" in rows["Qwen3VLMoeForConditionalGeneration"].detail
    assert "`granitemoe`" in rows["GraniteMoeSharedForCausalLM"].detail
    assert {r.status for r in rows.values()} == {
        supported_models.SERVED,
        supported_models.REFUSED,
        supported_models.NOT_CHECKED,
    }
    served = {a for a, r in rows.items() if r.status == supported_models.SERVED}
    assert served == set(supported_models.served_architectures())


def test_served_means_the_end_to_end_tests_run_it() -> None:
    """Every tiny architecture the table calls served runs in the BF16 token comparison."""
    path = ROOT / "tests" / "engine" / "test_engine_e2e.py"
    spec = importlib.util.spec_from_file_location("_engine_e2e", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {arch for arch, _ in module.BF16_RUNS} == set(ARCHITECTURES)


@pytest.mark.parametrize("architecture", sorted(REFUSED_ARCHITECTURES))
def test_refused_architectures_fail_with_one_line(architecture: str) -> None:
    with pytest.raises(KTConfigError) as error:
        check_architecture({"architectures": [architecture], "model_type": "whatever"})
    message = str(error.value)
    assert message.startswith("--quantization='kt-hybrid' is invalid (") and "\n" not in message
    assert architecture in message and REFUSED_ARCHITECTURES[architecture] in message


def test_a_config_naming_only_its_model_type_is_refused_too() -> None:
    assert "gpt-oss" in (architecture_refusal({"model_type": "gpt_oss"}) or "")
    assert "Llama 4" in (
        architecture_refusal({"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}) or ""
    )
    assert architecture_refusal({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}) is None
