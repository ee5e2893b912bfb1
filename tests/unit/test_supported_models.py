"""The Supported-models table (vllm_kt_tools/support/supported_models.py): every MoE
architecture of the installed vLLM's registry with its status, generated from the model
check's committed JSON; the committed README section and docs page equal what it
generates (so a table edited by hand, or JSON the table does not show, fails here); the
config-time refusals it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_kt_plugin.architectures import KT_KERNEL_CANNOT, architecture_refusal, check_architecture
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_tools.model_check.recipes import RECIPES, TAKES_ROW_OF
from vllm_kt_tools.support import supported_models

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_tables_are_the_generated_ones() -> None:
    readme = (ROOT / "README.md").read_text()
    assert supported_models.replace_readme_section(readme) == readme, (
        "README.md's Supported-models summary is stale: run `python -m vllm_kt_tools.support.supported_models`"
    )
    assert (ROOT / "docs" / "supported_models.md").read_text() == supported_models.docs_page(), (
        "docs/supported_models.md is stale: run `python -m vllm_kt_tools.support.supported_models`"
    )


def test_every_registry_moe_architecture_has_a_status() -> None:
    rows = {row.architecture: row for row in supported_models.rows()}
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"} <= set(rows)
    assert "LlamaForCausalLM" not in rows and "Qwen3ForCausalLM" not in rows  # dense
    # Modules that build no MoE layer of their own but reuse another's (a multimodal wrapper,
    # a draft, a variant; imported relatively or absolutely) are rows too.
    assert "qwen3_moe" in supported_models.reused_moe_modules("qwen3_vl_moe")
    assert "deepseek_v2" in supported_models.reused_moe_modules("vllm.models.deepseek_v32")
    assert {r.status for r in rows.values()} <= set(supported_models.STATUSES)


def test_the_committed_runs_hold_what_the_table_shows() -> None:
    """Each committed run is the tool's JSON: per architecture its status, and for a served one
    the tokens compared, the drift, the backend and the time taken; only registry MoE
    architectures."""
    results = supported_models.load_results()
    known = supported_models.moe_architectures()
    assert set(results) <= set(known), sorted(set(results) - set(known))
    for arch, result in results.items():
        statuses = ("served", "refused at config time", "cannot be checked here", "failed", "no recipe")
        assert result["status"] in statuses, arch
        assert result["seconds"] >= 0 and (result["reason"] or result["status"] == "served"), arch
        if result["status"] == "served":
            bf16 = result["checks"]["bfloat16"]
            assert bf16["problem"] is None and bf16["drift"] <= bf16["bound"] and bf16["tokens_compared"] > 0, arch
            assert bf16["backend"] and "4 CPU experts" in bf16["placement"], arch  # half of 8 on the CPU


def test_a_row_taken_from_another_is_built_on_its_moe_layers() -> None:
    """A draft or wrapper takes a base architecture's row only where its module imports the
    base's module (which builds the MoE layer) and the base is served on its own."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    rows = {row.architecture: row for row in supported_models.rows()}
    for arch, (base, _) in TAKES_ROW_OF.items():
        base_module = _VLLM_MODELS[base][0]
        if _VLLM_MODELS[arch][0] == base_module:  # the same module: a subclass of the base's class
            assert issubclass(_model_class(arch), _model_class(base)), (arch, base)
        else:
            assert _builds_on(_VLLM_MODELS[arch][0], base_module), (arch, base)
        if rows[arch].detail.startswith(f"as `{base}`"):
            assert rows[base].status == supported_models.SERVED, (arch, base)


def _builds_on(module: str, base_module: str) -> bool:
    """``module`` imports the MoE layers of ``base_module``'s row: reuses that module's (it builds
    them), or imports that module itself where it reuses another's (qwen3_5_mtp builds qwen3_5's
    decoder layers, whose MoE block is qwen3_next's)."""
    if base_module in supported_models.reused_moe_modules(module):
        return True
    imported = set(supported_models._MODULE_IMPORT.findall(supported_models._source(module)))
    return base_module in imported and bool(supported_models.reused_moe_modules(base_module))


def _model_class(architecture: str) -> type:
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    module, cls = _VLLM_MODELS[architecture]
    name = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    return getattr(importlib.import_module(name), cls)


def test_a_draft_follows_its_base() -> None:
    """A draft or wrapper (DRAFT_OF) is in its base's module or imports it, and where its own
    run gave it no status: cannot be checked here with the base's reason where the base cannot
    be, else not checked, naming the base (a served base's row is taken only by TAKES_ROW_OF)."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from vllm_kt_tools.model_check.recipes import DRAFT_OF

    rows = {row.architecture: row for row in supported_models.rows()}
    assert not set(DRAFT_OF) & set(TAKES_ROW_OF)
    followed = [a for a, (b, kind) in DRAFT_OF.items() if rows[a].detail.startswith(f"{kind} of `{b}`")]
    assert followed  # the rule below is exercised on the committed rows
    for arch, (base, kind) in DRAFT_OF.items():
        module, base_module = _VLLM_MODELS[arch][0], _VLLM_MODELS[base][0]
        assert module == base_module or _builds_on(module, base_module), (arch, base)
        if rows[arch].detail.startswith(f"{kind} of `{base}`"):
            base_row = rows[base]
            if base_row.status in (supported_models.CANNOT_CHECK, supported_models.REFUSED):
                assert rows[arch].status == base_row.status and base_row.detail in rows[arch].detail
            else:
                assert rows[arch].status == supported_models.NOT_CHECKED, arch
    base = supported_models.Row("B", "b", supported_models.CANNOT_CHECK, "", "plain vLLM fails here: E")
    draft = supported_models._draft_row(
        supported_models.Row("D", "d", "not checked", "", ""), "B", "an MTP draft", base
    )
    assert draft.status == supported_models.CANNOT_CHECK and draft.detail.endswith("plain vLLM fails here: E")
    refused = supported_models.Row("B", "b", supported_models.REFUSED, "", "no routed experts")
    refusal = supported_models._draft_row(
        supported_models.Row("D", "d", "not checked", "", ""), "B", "an MTP draft", refused
    )
    assert refusal.status == supported_models.REFUSED and refusal.detail.endswith("no routed experts")
    served = supported_models.Row("B", "b", supported_models.SERVED, "kt_kernel", "x")
    assert supported_models._draft_row(draft, "B", "an MTP draft", served).status == supported_models.NOT_CHECKED


def test_why_an_architecture_cannot_be_checked_is_measured() -> None:
    """With no recipe: vLLM's CPU stub of a model class gives its own NotImplementedError; an
    architecture transformers ships no model class of cannot be written (checkpoint.py draws
    its weights with that class), its config class looked up where its model_type is known;
    a KeyError loading a checkpoint of the released tensor names is vLLM's loader's."""
    from vllm_kt_tools.model_check import run

    assert "not implemented on CPU" in (run.refuses_this_platform("DeepSeekV4MTPModel") or "")
    assert run.refuses_this_platform("MixtralForCausalLM") is None  # a real class: no stub
    assert "ships no `BailingMoeForCausalLM` model class" in (run.unbuildable("BailingMoeForCausalLM") or "")
    assert "nor a config class for its model_type 'bailing_moe'" in (run.unbuildable("BailingMoeForCausalLM") or "")
    assert "its config class: vLLM's KimiK3Config" in (run.unbuildable("KimiK3ForConditionalGeneration") or "")
    assert run.unbuildable("MixtralForCausalLM") is None and run.unbuildable("TransformersMoEForCausalLM") is None
    assert run.config_class("mixtral") == "transformers' MixtralConfig" and run.config_class("no_such_type") is None
    released = run.plain_failure_reason(RECIPES["DbrxForCausalLM"], "KeyError: 'a'")
    assert run.plain_failure_status(released) == run.CANNOT_CHECK
    missing = "ValueError: There is no module or parameter named 'score' in X"
    assert run.plain_failure_status(run.plain_failure_reason(RECIPES["DbrxForCausalLM"], missing)) == run.CANNOT_CHECK
    # a processor file vLLM loads at start, missing from the tiny model (EmbeddingGemma2's audio one)
    no_extractor = "OSError: Can't load feature extractor for '/tmp/m'."
    for error in ("KeyError: 'a'", missing, no_extractor):
        ours = run.plain_failure_reason(RECIPES["MixtralForCausalLM"], error)
        assert run.plain_failure_status(ours) == run.NO_RECIPE


def test_a_raw_error_gets_its_cause_in_words() -> None:
    """A Triton launch on vLLM's CPU build (no triton-cpu) says so; another error stays as it came."""
    triton = "plain vLLM fails here: TypeError: 'function' object is not subscriptable (x.py:1)"
    other = "plain vLLM fails here: NotImplementedError: Sparse Attention is not supported on CPU."
    for reason, cause in ((triton, "triton-cpu, which PyPI does not have"), (other, None)):
        row = supported_models._row("A", "a", {"status": "cannot be checked here", "reason": reason})
        assert row.detail.startswith(reason) and (cause in row.detail if cause else row.detail == reason)


def test_json_written_by_the_tool_round_trips(tmp_path: Path) -> None:
    """The table reads whatever runs are committed, a later file replacing an earlier one's
    entry for the same architecture."""
    entry = {"status": "cannot be checked here", "reason": "x", "seconds": 1.0}
    (tmp_path / "a.json").write_text(json.dumps({"architectures": {"MixtralForCausalLM": entry}}))
    later = {**entry, "reason": "y"}
    (tmp_path / "b.json").write_text(json.dumps({"architectures": {"MixtralForCausalLM": later}}))
    results = supported_models.load_results(tmp_path)
    assert results["MixtralForCausalLM"]["reason"] == "y" and results["MixtralForCausalLM"]["run"] == "b.json"
    ten = {**entry, "reason": "ten"}  # run 10 comes after run 9, though "1" sorts before "9"
    (tmp_path / "2026-12-07-9.json").write_text(json.dumps({"architectures": {"OlmoeForCausalLM": entry}}))
    (tmp_path / "2026-12-07-10.json").write_text(json.dumps({"architectures": {"OlmoeForCausalLM": ten}}))
    assert supported_models.load_results(tmp_path)["OlmoeForCausalLM"]["reason"] == "ten"


def test_the_end_to_end_tests_run_the_models_the_table_names() -> None:
    assert {model for model, _ in supported_models.bf16_runs()} == set(supported_models.E2E_MODELS.values())


def test_every_recipe_is_a_registry_moe_architecture() -> None:
    assert set(RECIPES) <= set(supported_models.moe_architectures())


@pytest.mark.parametrize("architecture", sorted(KT_KERNEL_CANNOT))
def test_no_backend_for_the_configuration_is_refused_in_one_line(architecture: str) -> None:
    config = {"architectures": [architecture], "model_type": "whatever"}
    assert architecture_refusal(config) is None  # the torch backend serves it
    for backend, quantization in (("kt_kernel", None), (None, "fp8")):
        with pytest.raises(KTConfigError) as error:
            check_architecture(config, backend, quantization)
        message = str(error.value)
        assert message.startswith("--quantization='kt-hybrid' is invalid (") and "\n" not in message
        assert architecture in message and KT_KERNEL_CANNOT[architecture] in message


def test_a_config_naming_only_its_model_type_is_known_too() -> None:
    assert "gpt-oss" in (architecture_refusal({"model_type": "gpt_oss"}, "kt_kernel") or "")
    llama4 = {"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}
    assert "Llama 4" in (architecture_refusal(llama4, None, "fp8") or "")
    qwen3 = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    assert architecture_refusal(qwen3, "kt_kernel") is None


def test_a_recipe_trained_longer_keeps_the_other_recipes_cached_models() -> None:
    """A recipe's own training steps change its cached model's key, not the others' (the
    steps are not in a recipe's repr; the key names the steps used)."""
    from vllm_kt_tools.model_check.checkpoint import TRAIN_STEPS, train_steps
    from vllm_kt_tools.model_check.recipes import Recipe

    assert train_steps(Recipe("granitemoe")) == TRAIN_STEPS
    assert train_steps(Recipe("granitemoe", train_steps=400)) == 400
    assert repr(Recipe("granitemoe", train_steps=400)) == repr(Recipe("granitemoe"))


def test_a_reference_with_a_fix_of_vllm_says_so() -> None:
    """Where a recipe's plain-vLLM reference loads one of our fixes of vLLM's CPU build, its
    result says which and why, and so does its row; each named fix is an entry point of
    ours, and one that is not installed stops the check (vLLM would skip it silently)."""
    import tomllib

    from vllm_kt_tools.model_check import engines
    from vllm_kt_tools.model_check.recipes import CPU_ROUTER, REFERENCE_PLUGINS
    from vllm_kt_tools.model_check.run import reference

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert set(REFERENCE_PLUGINS) <= set(declared["vllm.general_plugins"])
    assert {a for a, r in RECIPES.items() if r.reference_plugins} >= {"MiniMaxM2ForCausalLM", "LagunaForCausalLM"}
    assert reference(RECIPES["MixtralForCausalLM"]) is None
    said = reference(RECIPES["MiniMaxM2ForCausalLM"])
    assert said == f"plain vLLM with {CPU_ROUTER} ({REFERENCE_PLUGINS[CPU_ROUTER]})"
    result = {"status": "served", "reason": None, "seconds": 1.0, "run": "x.json", "reference": said, "checks": {}}
    row = supported_models._row("MiniMaxM2ForCausalLM", "minimax_m2", result)
    assert row.detail.startswith(f"reference: {said}; ")
    assert engines.missing_plugins(["no_such_plugin_of_ours"]) == ["no_such_plugin_of_ours"]
    with pytest.raises(RuntimeError, match="no_such_plugin_of_ours"):
        engines.in_process(Path("unused"), [], 1, [], None, Path("unused.log"), ["no_such_plugin_of_ours"])
