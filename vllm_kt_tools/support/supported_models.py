"""The Supported-models table: every MoE architecture of the installed vLLM's model registry
and what kt-hybrid does with it, generated from the model check's committed results.

An architecture counts as MoE where its own model module builds vLLM's fused-MoE layer
(``FusedMoE(``, ``SharedFusedMoE(``, ``FusedMoEFactory(``), or imports from a module that
does (multimodal wrappers, MTP drafts, variants: their rows name the module whose MoE
layers they reuse); of vLLM's Transformers backend, the classes named MoE.

Each row's status comes from the JSON files ``vllm-kt check-models`` wrote under
``docs/model_checks/`` (``vllm_kt_tools.model_check``; a later file's entry for an
architecture replaces an earlier one's, numbers in names compared as numbers), or from the
row of the architecture it takes (``model_check.recipes.TAKES_ROW_OF``: the same class under another registry name, or a
draft or wrapper built on a served architecture's MoE layer class), or, for a draft or wrapper
with no status of its own, from its base's (``model_check.recipes.DRAFT_OF``: it runs only with
the base, so a base that cannot be checked here makes it so). The five architectures
the end-to-end tests train also say what else those tests check. README.md holds a short
summary between its markers, docs/supported_models.md every row;
``tests/unit/test_supported_models.py`` checks both equal what this module generates.
Regenerate with ``python -m vllm_kt_tools.support.supported_models``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from vllm_kt_plugin.source_checkout import checkout_path

COMMAND = "python -m vllm_kt_tools.support.supported_models"
README_START, README_END = "<!-- supported-models:start -->", "<!-- supported-models:end -->"
_MOE_LAYER = re.compile(r"\b(?:Shared)?FusedMoE\w*\(")
_MODULE_IMPORT = re.compile(r"^from (?:\.|vllm\.model_executor\.models\.)(\w+) import", re.MULTILINE)
_E2E_TESTS = ("tests", "engine", "test_engine_e2e.py")  # read from the checkout (source_checkout)

SERVED, REFUSED, CANNOT_CHECK, FAILED, NOT_CHECKED = (
    "served",
    "refused at config time",
    "cannot be checked here",
    "fails (a bug to fix)",
    "not checked",
)
STATUSES = (SERVED, REFUSED, CANNOT_CHECK, FAILED, NOT_CHECKED)

# The tiny models the end-to-end tests train (tests/engine/test_engine_e2e.py), by the
# architecture they are, and what else those tests check on them.
E2E_MODELS = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
_PLACEMENTS = {"half on CPU": "half", "all on CPU": "all", "one GPU expert": "all but one (the split forced)"}
_CHECKS = {
    "qwen3_moe": "deferral, dynamic experts, AMXINT8, tensor parallelism, block-FP8/GPTQ checkpoints (GPU)",
    "mixtral": "online AMXINT8/AMXINT4 within their bounds",
    "deepseek_v3": "dynamic experts, tensor parallelism, block-FP8 and compressed-tensors INT4 checkpoints (GPU)",
    "glm4_moe": "exact in float32 with the torch backend",
    "qwen2_moe": "exact in float32 with the torch backend",
}
# The kt-kernel methods besides BF16 the tests run per tiny model (CPU-build engine tests;
# GPU: the quantized checkpoints' tests on the GPU host). LLAMAFILE is read from the GGUF
# test's CASES and SERVED, so the column cannot claim a run the tests do not make.
_METHODS = {
    "qwen3_moe": ("AMXINT8", "FP8 (GPU)", "GPTQ_INT4 (GPU)"),
    "mixtral": ("AMXINT4", "AMXINT8"),
    "deepseek_v3": ("FP8 (GPU)", "RAWINT4 (GPU)"),
    "glm4_moe": (),
    "qwen2_moe": (),
}
_GGUF_TESTS = ("tests", "engine", "test_gguf_e2e.py")
# The README names these families where any of their architectures is served (first match).
FAMILIES = (
    ("DeepSeek", "Deepseek"),
    ("Qwen", "Qwen"),
    ("GLM", "Glm"),
    ("MiniMax", "MiniMax"),
    ("Mixtral", "Mixtral"),
    ("HunYuan", ("HunYuan", "HYV")),
    ("gpt-oss", "GptOss"),
    ("Llama 4", "Llama4"),
    ("Gemma 4", "Gemma4"),
    ("Granite", "Granite"),
    ("ERNIE", "Ernie"),
    ("EXAONE", "Exaone"),
    ("OLMoE", ("Olmoe", "FlexOlmo")),
    ("Cohere", "Cohere"),
    ("LFM2", "Lfm2"),
)


def _test_constant(test: tuple[str, ...], name: str) -> list:
    path = checkout_path(*test, needed_by=COMMAND)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(f"{path} has no {name}")


def bf16_runs() -> list[tuple[str, str]]:
    """The end-to-end test's ``BF16_RUNS`` (tiny model, placement), read from its source."""
    return [tuple(run) for run in _test_constant(_E2E_TESTS, "BF16_RUNS")]


def methods_tested(model_type: str) -> str:
    """The kt-kernel methods the end-to-end tests run on the tiny ``model_type``."""
    cases = _test_constant(_GGUF_TESTS, "CASES") + _test_constant(_GGUF_TESTS, "SERVED")
    gguf = sorted({case[1] for case in cases if case[0] == model_type})
    llamafile = [f"LLAMAFILE ({', '.join(gguf)} GGUF)"] if gguf else []
    return ", ".join(["BF16", *_METHODS[model_type], *llamafile])


def e2e_checks(model_type: str) -> str:
    placements = [_PLACEMENTS[placement] for arch, placement in bf16_runs() if arch == model_type]
    return f"end-to-end tests (tiny `{model_type}`): CPU experts {', '.join(placements)}; {_CHECKS[model_type]}"


@dataclass(frozen=True)
class Row:
    architecture: str
    module: str
    status: str
    backend: str  # the CPU backend that served its bf16 run ("" where none)
    detail: str  # what the check measured, or why not
    methods: str = ""  # the kt-kernel methods the end-to-end tests run (their five architectures)


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
    """The registry modules that build fused-MoE layers and ``module`` imports from (relative
    or absolute imports), where it builds none itself (a wrapper, a draft, a variant)."""
    if module == "transformers" or module in _builds_moe():
        return []
    return sorted(set(_MODULE_IMPORT.findall(_source(module))) & _builds_moe())


def _is_moe(module: str, cls: str) -> bool:
    if module == "transformers":  # vLLM's Transformers backend: generic classes, MoE ones by name
        return "MoE" in cls
    return bool(_MOE_LAYER.search(_source(module)))


def results_folder() -> Path:
    """docs/model_checks/: the runs ``vllm-kt check-models`` wrote, in the checkout."""
    return checkout_path("docs", "model_checks", needed_by=COMMAND)


def committed_runs(folder: Path | None = None) -> list[Path]:
    """The committed runs, in name order with numbers compared as numbers (``2026-12-07-10``
    after ``2026-12-07-9``)."""
    paths = (folder or results_folder()).glob("*.json")
    return sorted(paths, key=lambda p: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", p.name)])


# Runs of vLLM's CUDA build on the GPU host (benchmarks/sittings/model-check-cuda.sh), beside the CPU runs.
CUDA_RUNS = "cuda-host"


def cuda_runs(folder: Path | None = None) -> list[Path]:
    """The committed runs of vLLM's CUDA build (``CUDA_RUNS``), in ``committed_runs``' order."""
    cuda = (folder or results_folder()) / CUDA_RUNS
    return committed_runs(cuda) if cuda.is_dir() else []


def load_results(folder: Path | None = None) -> dict[str, dict[str, Any]]:
    """Architecture -> its latest result among the committed runs (``committed_runs``' order);
    then, for an architecture no CPU run serves, a CUDA run's where it is served (the CPU build
    cannot run it; its other CUDA outcomes are in that folder's README, not the table)."""
    folder = folder or results_folder()
    results: dict[str, dict[str, Any]] = {}
    for path in committed_runs(folder):
        run = json.loads(path.read_text())
        for arch, result in run["architectures"].items():
            results[arch] = {**result, "run": path.name, "machine": run.get("machine", {})}
    for path in cuda_runs(folder):
        run = json.loads(path.read_text())
        for arch, result in run["architectures"].items():
            if result["status"] == "served" and results.get(arch, {}).get("status") != "served":
                results[arch] = {**result, "run": f"{CUDA_RUNS}/{path.name}", "machine": run.get("machine", {})}
    return results


_STATUS = {
    "served": SERVED,
    "refused at config time": REFUSED,
    "cannot be checked here": CANNOT_CHECK,
    "failed": FAILED,
    "no recipe": NOT_CHECKED,
}


def _measured(result: dict[str, Any]) -> str:
    checks = result.get("checks") or {}
    parts = []
    bf16 = checks.get("bfloat16")
    if bf16:
        parts.append(
            f"bf16: {bf16['tokens_compared']} greedy tokens, {bf16['differing']} of 6 completions part at a tie, "
            f"drift {bf16['drift']:.2g}"
        )
    f32 = checks.get("float32")
    if f32:
        # the backend alone: the torch backend computes in float32 whatever KT_METHOD the log names
        parts.append(f"float32 ({str(f32['backend']).split()[0]}): drift {f32['drift']:.1g}")
    elif result.get("float32"):
        parts.append(f"float32 not run: {result['float32']}")
    parts.append(f"{result.get('weights', '')}; {result.get('seconds', 0):.0f} s ({result['run']})")
    machine = result.get("machine") or {}
    if machine.get("vllm_build") == "cuda":  # both sides on vLLM's CUDA build (the GPU host's sitting)
        parts.insert(0, f"vLLM's CUDA build on {machine.get('gpu')}, kt-kernel {machine.get('kt_kernel_variant')}")
    return "; ".join(parts)


# What a raw error of plain vLLM means, where the error alone does not say (measured: see each).
_CAUSES = (
    # vllm/triton_utils/importing.py logs "Triton is installed, but doesn't include CPU backend.
    # Disabling Triton." and leaves @triton.jit kernels plain functions; `pip download
    # triton-cpu` finds none (vLLM's CPU image builds it from source)
    (
        "'function' object is not subscriptable",
        "a Triton kernel launch: vLLM's CPU build runs them through triton-cpu, which PyPI does not have",
    ),
    # the oracle logs each backend's reason at DEBUG only; VLLM_LOGGING_LEVEL=DEBUG on MiniMax-M3's tiny
    # model (2026-12-08): "kernel does not support MoEActivation.SWIGLUOAI_UNINTERLEAVE activation"
    (
        "No Unquantized MoE backend supports the deployment configuration",
        "vLLM's CPU MoE kernels take SiLU, swigluoai, GeLU and GeLU-tanh gated experts; MiniMax-M3's are "
        "swigluoai_uninterleave, which kt-hybrid's torch backend computes",
    ),
)


def _row(arch: str, module: str, result: dict[str, Any] | None) -> Row:
    if result is None:
        reused = reused_moe_modules(module)
        detail = f"reuses the MoE layers of {', '.join(f'`{m}`' for m in reused)}" if reused else ""
        return Row(arch, module, NOT_CHECKED, "", detail)
    from vllm_kt_tools.model_check.run import plain_failure_status

    status = _STATUS[result["status"]]
    if status == CANNOT_CHECK and plain_failure_status(str(result.get("reason"))) != result["status"]:
        status = NOT_CHECKED  # plain vLLM rejected the tiny model: the recipe is wrong, not this build
    bf16 = (result.get("checks") or {}).get("bfloat16") or {}
    backend = (bf16.get("backend") or "").split(" ")[0] if status == SERVED else ""
    detail = _measured(result) if status == SERVED else str(result.get("reason") or "")
    if status == CANNOT_CHECK:
        detail += "".join(f" ({cause})" for error, cause in _CAUSES if error in detail)
    if result.get("reference"):  # plain vLLM with a fix of its CPU build (model_check.run.reference)
        detail = f"reference: {result['reference']}; {detail}"
    model_type = E2E_MODELS.get(arch)
    if model_type and status == SERVED:
        return Row(arch, module, status, backend, f"{detail}; {e2e_checks(model_type)}", methods_tested(model_type))
    return Row(arch, module, status, backend, detail.replace("|", "\\|").replace("\n", " "))


def rows(results: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    from vllm_kt_tools.model_check.recipes import DRAFT_OF, TAKES_ROW_OF

    results = load_results() if results is None else results
    architectures = moe_architectures()
    table = {arch: _row(arch, module, results.get(arch)) for arch, module in architectures.items()}
    from vllm_kt_tools.support.vllm_internals import registry_models

    models = registry_models()
    same_class = {arch: b for arch in table for b in table if b != arch and models[b] == models[arch]}
    takes = {**{a: (b, "the same class under another registry name") for a, b in same_class.items()}, **TAKES_ROW_OF}
    for arch, (base, why) in takes.items():
        if arch in table and table[arch].status == NOT_CHECKED and table.get(base, table[arch]).status == SERVED:
            taken = table[base]
            table[arch] = Row(arch, architectures[arch], SERVED, taken.backend, f"as `{base}` ({why})")
    for arch, (base, kind) in DRAFT_OF.items():
        if arch in table and table[arch].status == NOT_CHECKED:
            table[arch] = _draft_row(table[arch], base, kind, table[base])
    return list(table.values())


# A base's statuses its drafts and wrappers take with it (``_draft_row``), and how their row says so.
_INHERITED = {CANNOT_CHECK: "which cannot be checked here", REFUSED: "which kt-hybrid refuses at config time"}


def _draft_row(row: Row, base: str, kind: str, base_row: Row) -> Row:
    """A draft's or wrapper's row (``DRAFT_OF``): it runs only with its base, so where the base
    cannot be checked here neither can it, for the base's reason, and where kt-hybrid refuses the
    base's config it refuses the draft's run with it; otherwise it stays not checked, saying whose
    status it follows."""
    if base_row.status in _INHERITED:
        said = _INHERITED[base_row.status]
        return Row(row.architecture, row.module, base_row.status, "", f"{kind} of `{base}`, {said}: {base_row.detail}")
    said = "served (a row taken only where it builds the base's MoE layers)" if base_row.status == SERVED else ""
    return Row(row.architecture, row.module, NOT_CHECKED, "", f"{kind} of `{base}`, {said or base_row.status}")


def _table(selected: list[Row]) -> list[str]:
    lines = [
        "| architecture | vLLM module | kt-hybrid | CPU backend | kt-kernel methods (e2e tests) | what was measured |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{r.architecture}` | `{r.module}` | {r.status} | {r.backend} | {r.methods} | {r.detail} |" for r in selected
    ]
    return lines


def counts(all_rows: list[Row]) -> dict[str, int]:
    return {status: sum(r.status == status for r in all_rows) for status in STATUSES}


def served_families(all_rows: list[Row]) -> list[str]:
    served = [r.architecture for r in all_rows if r.status == SERVED]
    return [
        label
        for label, prefixes in FAMILIES
        if any(a.startswith(prefixes if isinstance(prefixes, tuple) else (prefixes,)) for a in served)
    ]


def readme_section() -> str:
    """What README.md holds between its markers: the counts, the families served, the link."""
    all_rows = rows()
    n = counts(all_rows)
    line = (
        f"Of the {len(all_rows)} MoE architectures in vLLM's registry, {n[SERVED]} are served with their greedy "
        f"tokens checked against plain vLLM, {n[REFUSED]} refused at config time, {n[CANNOT_CHECK]} cannot be "
        f"checked on vLLM's CPU build"
    )
    rest = [f"{n[FAILED]} fail (bugs to fix)"] if n[FAILED] else []
    rest += [f"{n[NOT_CHECKED]} are not checked yet"] if n[NOT_CHECKED] else []
    line += (", " + ", ".join(rest) if rest else "") + "."
    return "\n".join(
        [
            README_START,
            line,
            f"Families served: {', '.join(served_families(all_rows))}.",
            "Every architecture, its CPU backend and what was measured: "
            "[docs/supported_models.md](docs/supported_models.md).",
            README_END,
        ]
    )


def _build(machine: dict[str, Any]) -> str:
    """Which vLLM build a run used, where not the CPU build (runs before the field: CPU), and
    torchvision's Python part where a CPU run had it (``check-models --torchvision``)."""
    if machine.get("vllm_build") == "cuda":
        return f"vLLM's CUDA build, {machine.get('gpu')}, "
    return f"torchvision {machine['torchvision']}'s Python part, " if machine.get("torchvision") else ""


def docs_page() -> str:
    """docs/supported_models.md."""
    import vllm

    from vllm_kt_tools.model_check.compare import FLOAT32_DRIFT_BOUND
    from vllm_kt_tools.model_check.run import BF16_DRIFT_BOUND

    all_rows = rows()
    n = counts(all_rows)
    runs, total_s = [], 0.0
    cuda = cuda_runs()
    for path in [*committed_runs(), *cuda]:
        run = json.loads(path.read_text())
        where = run.get("machine", {})
        total_s += run["seconds"] if where.get("vllm_build") != "cuda" else 0.0  # the CPU build's full run
        name = f"{CUDA_RUNS}/{path.name}" if path in cuda else path.name
        runs.append(
            f"`{name}`: {len(run['architectures'])} architectures in {run['seconds'] / 60:.0f} min "
            f"({_build(where)}{where.get('cores')} cores, kt-kernel {where.get('kt_kernel_variant')}, "
            f"started {run.get('started')})"
        )
    return "\n".join(
        [
            "# Supported models",
            "",
            f"Every MoE architecture in the model registry of vLLM {vllm.__version__} (an architecture whose model "
            "module builds vLLM's fused-MoE layer, or reuses those of a module that does: multimodal wrappers, MTP "
            f"drafts, variants): {n[SERVED]} served, {n[REFUSED]} refused at config time, {n[CANNOT_CHECK]} cannot be "
            f"checked here, {n[FAILED]} fail (bugs to fix), {n[NOT_CHECKED]} not checked.",
            "",
            "- **served**: a tiny model of the architecture (its config class, shrunk; weights briefly trained by "
            "transformers' model class) gives plain vLLM's greedy tokens through `vllm serve --quantization "
            "kt-hybrid` on vLLM's CPU build (where that build cannot run the architecture, its CUDA build on the "
            "GPU host: the row says so), with half of every MoE layer's experts on the CPU: bf16 with the "
            "default CPU backend (column 4), tokens equal but at a tie of plain vLLM's own and the chosen-token "
            f"logprob drift within {BF16_DRIFT_BOUND:g} nats; float32 with the torch backend, tokens equal and drift "
            f"within {FLOAT32_DRIFT_BOUND:g}, "
            "where plain vLLM runs float32 (`vllm_kt_tools/model_check`).",
            "- **CPU backend**: `kt_kernel` where kt-kernel computes the experts; `torch` where it cannot (biases, a "
            "clamped SwiGLU, other activations, router weights on the input): the plugin picks it for those layers "
            "unless `KT_BACKEND` is set, and says so in its log.",
            "- **refused at config time**: `--quantization kt-hybrid` stops with one line before any weight loads.",
            "- **cannot be checked here**: plain vLLM itself fails on this machine's vLLM build (the column gives "
            "its error), or vLLM's model class is a stub on this platform (its NotImplementedError), or no tiny "
            "model can be written (transformers ships no model class of the architecture to write its weights); "
            "a draft or multimodal wrapper of such a base cannot be checked either (it runs only with its base), "
            "for the base's reason.",
            "- **reference: plain vLLM with kt_cpu_router**: plain vLLM's CPU build asserts on this architecture's "
            "router (sigmoid top-k without expert groups), so the reference loads only the plugin's fix of that "
            "router (`VLLM_PLUGINS=kt_cpu_router`: vLLM's own grouped top-k with one group, as CUDA routes it), "
            "nothing of kt-hybrid.",
            "- an architecture that takes another's row (`as ...`) is the same class under another registry name, "
            "or a draft or wrapper built on that architecture's MoE layer class.",
            "- **kt-kernel methods (e2e tests)**: the `KT_METHOD`s the end-to-end tests run on their tiny models: "
            "BF16 everywhere, AMXINT4/AMXINT8 quantized online, LLAMAFILE from GGUF experts exported in the test "
            "(`tests/engine/test_gguf_e2e.py`), the quantized checkpoints' own methods on the GPU host. Which "
            "method is fastest depends on the CPU, not the model: `vllm-kt doctor` ranks them, `KT_METHOD=auto` "
            "picks it ([cpu-methods.md](cpu-methods.md)).",
            "",
            "Rerun: `vllm-kt check-models [ARCH ...] --out docs/model_checks/<name>.json` writes one JSON per run "
            "(per architecture: the tokens compared, the drift, the backend, the time taken); this page is generated "
            "from the committed JSON by `python -m vllm_kt_tools.support.supported_models`, and "
            "`tests/unit/test_supported_models.py` fails when the two disagree. "
            f"Runs: {'; '.join(runs) or 'none yet'}. Together (the full run's duration on the CPU build): "
            f"{total_s / 60:.0f} min. The CUDA runs serve only rows the CPU build cannot run "
            f"([{CUDA_RUNS}/README.md](model_checks/{CUDA_RUNS}/README.md) has all their outcomes).",
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
