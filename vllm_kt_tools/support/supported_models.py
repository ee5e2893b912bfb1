"""The Supported-models table: every MoE architecture of the installed vLLM's model registry,
and what kt-hybrid does with it: served (and the test that checks it), refused at config
time (with the line the user reads), or not checked.

An architecture counts as MoE where its own model module builds vLLM's fused-MoE layer
(``FusedMoE(``, ``SharedFusedMoE(``, ``FusedMoEFactory(``), or imports from a module that
does (multimodal wrappers, MTP drafts, variants such as Qwen3.5-MoE: their rows name the
module whose MoE layers they reuse); of vLLM's Transformers backend, the classes named MoE.
Which placements each served architecture runs with is read from the end-to-end test's
``BF16_RUNS``, so the table cannot claim a run the tests do not make. The table is
written into README.md (served and refused rows) and docs/supported_models.md (every
row); ``tests/unit/test_supported_models.py`` checks both equal what this module
generates. Regenerate with ``python -m vllm_kt_tools.support.supported_models``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from vllm_kt_plugin.architectures import architecture_refusal
from vllm_kt_plugin.source_checkout import checkout_path
from vllm_kt_tools.support.tiny_models import ARCHITECTURES

COMMAND = "python -m vllm_kt_tools.support.supported_models"
README_START, README_END = "<!-- supported-models:start -->", "<!-- supported-models:end -->"
_MOE_LAYER = re.compile(r"\b(?:Shared)?FusedMoE\w*\(")
_RELATIVE_IMPORT = re.compile(r"^from \.(\w+) import", re.MULTILINE)
_E2E_TESTS = ("tests", "engine", "test_engine_e2e.py")  # read from the checkout (source_checkout)

SERVED, REFUSED, NOT_CHECKED = "served", "refused at config time", "not checked"
# How the served architectures are checked (tiny models trained on the spot, vLLM's CPU build
# in CI): tests/engine/test_engine_e2e.py, greedy tokens against plain vLLM on the same checkpoint.
_BF16_CHECK = "greedy tokens equal plain vLLM's with kt-kernel BF16 CPU experts"
_PLACEMENTS = {"half on CPU": "half", "all on CPU": "all", "one GPU expert": "all but one (the split forced)"}
# What else the tests check per architecture (test files under tests/engine/).
_CHECKS = {
    "qwen3_moe": "deferral, dynamic experts, AMXINT8, tensor parallelism, block-FP8/GPTQ checkpoints (GPU)",
    "mixtral": "online AMXINT8/AMXINT4 within their bounds",
    "deepseek_v3": "dynamic experts, tensor parallelism, block-FP8 and compressed-tensors INT4 checkpoints (GPU)",
    "glm4_moe": "exact in float32 with the torch backend",
    "qwen2_moe": "exact in float32 with the torch backend",
}


# The kt-kernel methods besides BF16 the tests run per architecture (CPU-build engine tests;
# GPU: the quantized checkpoints' tests on the GPU host). LLAMAFILE is read from the GGUF
# test's CASES and SERVED below, so the column cannot claim a run the tests do not make.
_METHODS = {
    "qwen3_moe": ("AMXINT8", "FP8 (GPU)", "GPTQ_INT4 (GPU)"),
    "mixtral": ("AMXINT4", "AMXINT8"),
    "deepseek_v3": ("FP8 (GPU)", "RAWINT4 (GPU)"),
    "glm4_moe": (),
    "qwen2_moe": (),
}
_GGUF_TESTS = ("tests", "engine", "test_gguf_e2e.py")


def _test_constant(test: tuple[str, ...], name: str) -> list:
    path = checkout_path(*test, needed_by=COMMAND)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(f"{path} has no {name}")


def bf16_runs() -> list[tuple[str, str]]:
    """The end-to-end test's ``BF16_RUNS`` (arch, placement), read from its source."""
    return [tuple(run) for run in _test_constant(_E2E_TESTS, "BF16_RUNS")]


def methods_tested(model_type: str) -> str:
    """The kt-kernel methods the tests run on the tiny ``model_type``."""
    cases = _test_constant(_GGUF_TESTS, "CASES") + _test_constant(_GGUF_TESTS, "SERVED")
    gguf = sorted({case[1] for case in cases if case[0] == model_type})
    llamafile = [f"LLAMAFILE ({', '.join(gguf)} GGUF)"] if gguf else []
    return ", ".join(["BF16", *_METHODS[model_type], *llamafile])


def how_checked(model_type: str) -> str:
    placements = [_PLACEMENTS[placement] for arch, placement in bf16_runs() if arch == model_type]
    return f"{_BF16_CHECK}, experts on the CPU: {', '.join(placements)}; {_CHECKS[model_type]}"


@dataclass(frozen=True)
class Row:
    architecture: str
    module: str
    status: str
    detail: str  # how it is checked, or the refusal
    methods: str = ""  # the kt-kernel methods the tests run (served rows)


def _module_name(module: str) -> str:
    return module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"


@cache
def _source(module: str) -> str:
    """The module's source; a package's: all its files."""
    spec = importlib.util.find_spec(_module_name(module))
    assert spec is not None and spec.origin is not None, module
    if spec.submodule_search_locations:
        return "\n".join(f.read_text() for d in spec.submodule_search_locations for f in sorted(Path(d).rglob("*.py")))
    return Path(spec.origin).read_text()


def moe_architectures() -> dict[str, str]:
    """Architecture -> its module, for every registry entry whose module builds fused-MoE
    layers or reuses those of a module that does."""
    from vllm_kt_tools.support.vllm_internals import registry_models

    return {
        arch: module
        for arch, (module, cls) in sorted(registry_models().items())
        if _is_moe(module, cls) or reused_moe_modules(module)
    }


@cache
def _builds_moe() -> frozenset[str]:
    from vllm_kt_tools.support.vllm_internals import registry_models

    return frozenset(
        module for module, cls in registry_models().values() if module != "transformers" and _is_moe(module, cls)
    )


def reused_moe_modules(module: str) -> list[str]:
    """The registry modules that build fused-MoE layers and ``module`` imports from, where
    it builds none itself (a wrapper, a draft, a variant)."""
    if module == "transformers" or module in _builds_moe():
        return []
    return sorted(set(_RELATIVE_IMPORT.findall(_source(module))) & _builds_moe())


def _is_moe(module: str, cls: str) -> bool:
    if module == "transformers":  # vLLM's Transformers backend: generic classes, MoE ones by name
        return "MoE" in cls
    return bool(_MOE_LAYER.search(_source(module)))


def served_architectures() -> dict[str, str]:
    """Hugging Face architecture name -> tiny model type, for the tested tiny models."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]: model_type for model_type in ARCHITECTURES}


def rows() -> list[Row]:
    served = served_architectures()
    result = []
    for arch, module in moe_architectures().items():
        refusal = architecture_refusal({"architectures": [arch]})
        if arch in served:
            detail = f"tiny `{served[arch]}`: {how_checked(served[arch])}"
            result.append(Row(arch, module, SERVED, detail, methods_tested(served[arch])))
        elif refusal is not None:
            result.append(Row(arch, module, REFUSED, refusal.split(": ", 1)[1]))
        else:
            reused = reused_moe_modules(module)
            detail = f"reuses the MoE layers of {', '.join(f'`{m}`' for m in reused)}" if reused else ""
            result.append(Row(arch, module, NOT_CHECKED, detail))
    return result


def _table(selected: list[Row]) -> list[str]:
    lines = [
        "| architecture | vLLM module | kt-hybrid | kt-kernel methods tested | how we know |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| `{r.architecture}` | `{r.module}` | {r.status} | {r.methods} | {r.detail} |" for r in selected]
    return lines


def readme_section() -> str:
    """What README.md holds between its markers: the served and refused rows."""
    all_rows = rows()
    shown = [r for r in all_rows if r.status != NOT_CHECKED]
    others = len(all_rows) - len(shown)
    return "\n".join(
        [
            README_START,
            *_table(shown),
            "",
            f"The other {others} MoE architectures of vLLM's registry are not checked: "
            "[docs/supported_models.md](docs/supported_models.md) lists them.",
            README_END,
        ]
    )


def docs_page() -> str:
    """docs/supported_models.md."""
    import vllm

    all_rows = rows()
    counts = {status: sum(r.status == status for r in all_rows) for status in (SERVED, REFUSED, NOT_CHECKED)}
    return "\n".join(
        [
            "# Supported models",
            "",
            f"Every MoE architecture in the model registry of vLLM {vllm.__version__} (an architecture whose model "
            "module builds vLLM's fused-MoE layer, or reuses those of a module that does: multimodal wrappers, MTP "
            f"drafts, variants): {counts[SERVED]} served, {counts[REFUSED]} refused at config time, "
            f"{counts[NOT_CHECKED]} not checked.",
            "",
            "- **served**: a tiny model of the architecture, trained on the spot, gives plain vLLM's greedy tokens "
            "through kt-hybrid (`tests/engine/test_engine_e2e.py`; the last column says what else is checked).",
            "- **kt-kernel methods tested**: the `KT_METHOD`s the tests run on that tiny model: BF16 everywhere, "
            "AMXINT4/AMXINT8 quantized online, LLAMAFILE from GGUF experts exported in the test "
            "(`tests/engine/test_gguf_e2e.py`), the quantized checkpoints' own methods on the GPU host. Which "
            "method is fastest depends on the CPU, not the model: `vllm-kt doctor` ranks them, `KT_METHOD=auto` "
            "picks it ([cpu-methods.md](cpu-methods.md)).",
            "- **refused at config time**: `--quantization kt-hybrid` stops with one line before any weight loads "
            "(`vllm_kt_plugin/architectures.py`; the column gives the reason).",
            "- **not checked**: nothing here says whether kt-hybrid serves it. Its MoE layers are refused when "
            "built where kt-kernel cannot compute them (experts that are not SiLU-gated, have biases, or take "
            "router weights on the input).",
            "",
            "Generated by `python -m vllm_kt_tools.support.supported_models` (checked by "
            "`tests/unit/test_supported_models.py`).",
            "",
            *_table(all_rows),
            "",
        ]
    )


def replace_readme_section(readme: str) -> str:
    start, end = readme.index(README_START), readme.index(README_END) + len(README_END)
    return readme[:start] + readme_section() + readme[end:]


def main() -> None:
    readme = checkout_path("README.md", needed_by=COMMAND)
    readme.write_text(replace_readme_section(readme.read_text()))
    docs = checkout_path("docs", "supported_models.md", needed_by=COMMAND)
    docs.parent.mkdir(exist_ok=True)
    docs.write_text(docs_page())
    print(f"wrote {readme} and {docs}")


if __name__ == "__main__":
    main()
