"""The packages' shape: a one-way stack of modules (no import cycles, deferred and
type-only imports included), the settings catalogue at the bottom, the runtime apart from
the tooling, hybrid/'s paths and observers below what builds and holds layers, and
kt-kernel's method list in step with the copy the catalogue keeps."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME, TOOLS = "vllm_kt_plugin", "vllm_kt_tools"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """module -> package modules it imports anywhere: in functions too, and under ``if
    TYPE_CHECKING:`` (a type-only import is still a dependency: a circle of them is a
    circle of modules that need each other to be read)."""
    modules = {module_name(p): p for package in (RUNTIME, TOOLS) for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycles_counting_deferred_and_type_only_imports() -> None:
    graph = package_imports()
    assert len(graph) > 30  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_runtime_imports_no_tooling() -> None:
    """Serving a model loads vllm_kt_plugin only: the command line, the benchmark and
    their helpers (vllm_kt_tools) import the runtime, never the other way round."""
    graph = package_imports()
    runtime = {m for m in graph if m.startswith(RUNTIME)}
    assert len(runtime) > 20 and len(graph) > len(runtime)
    into_tools = {m: sorted(n for n in graph[m] if n.startswith(TOOLS)) for m in runtime}
    assert not any(into_tools.values()), {m: n for m, n in into_tools.items() if n}


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_settings_catalogue_is_the_bottom() -> None:
    """Like vLLM's envs.py: the catalogue imports nothing else from the package, the error
    type only the catalogue."""
    graph = package_imports()
    assert graph["vllm_kt_plugin.settings.catalogue"] == set()
    assert graph["vllm_kt_plugin.settings.errors"] == {"vllm_kt_plugin.settings.catalogue"}
    assert not any(m.startswith(("vllm_kt_plugin.hybrid", "vllm_kt_tools.cli")) for m in _reachable(graph))


def _reachable(graph: dict[str, set[str]], start: str = "vllm_kt_plugin.settings.loader") -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_catalogue_methods_are_kt_kernels() -> None:
    pytest.importorskip("kt_kernel")
    from vllm_kt_plugin.cpu_backends.kt_kernel.methods import kt_inference_methods
    from vllm_kt_plugin.settings.catalogue import KT_METHODS
    from vllm_kt_plugin.settings.model_memory import KT_METHOD_BYTES_PER_WEIGHT

    assert set(KT_METHODS) == kt_inference_methods()
    assert set(KT_METHOD_BYTES_PER_WEIGHT) == set(KT_METHODS) - {"LLAMAFILE"}  # GGUF: size per tensor type


SOURCE_CHECKOUT = f"{RUNTIME}.source_checkout"


def test_settings_import_nothing_above_them() -> None:
    """Settings (with the model facts planning reads) sit below planning, the layers and the
    backends: nothing in settings/ imports them."""
    graph = package_imports()
    settings = sorted(m for m in graph if m.startswith(f"{RUNTIME}.settings"))
    assert len(settings) >= 7  # catalogue, errors, variables, presets, loader, model facts
    assert graph[SOURCE_CHECKOUT] == set()  # below everything: presets read configs/ of a checkout through it
    upward = {
        m: sorted(n for n in graph[m] if not n.startswith(f"{RUNTIME}.settings") and n != SOURCE_CHECKOUT)
        for m in settings
    }
    assert not any(upward.values()), {m: n for m, n in upward.items() if n}


# hybrid/'s top: what builds a layer (the config, the method), what holds the layers of a
# process, and the engine core's scheduler, which reads both. Everything else in hybrid/ (the
# contracts, the paths, the observers and what they use) sits below it and reaches the process
# state only through contracts.ProcessState.
HYBRID = f"{RUNTIME}.hybrid"
HYBRID_TOP = frozenset(f"{HYBRID}.{m}" for m in ("quant_config", "moe_method", "process_state", "scheduler"))


def test_hybrid_paths_and_observers_import_nothing_above_them() -> None:
    graph = package_imports()
    below = sorted(m for m in graph if m.startswith(f"{HYBRID}.") and m not in HYBRID_TOP)
    assert {f"{HYBRID}.{m}" for m in ("contracts", "paths", "cpu_path", "staging.split", "observers")} <= set(below)
    upward = {m: sorted(_reachable(graph, m) & HYBRID_TOP) for m in below}
    assert not any(upward.values()), {m: n for m, n in upward.items() if n}


STAGING_PLAN = f"{HYBRID}.staging.plan"


def test_the_staging_plan_is_pure_and_below_planning() -> None:
    """The one staging decision (``hybrid/staging/plan.py``) imports no torch, no vLLM and
    nothing of the package above the settings, so planning, serve's checks and doctor ask it
    as each layer does; planning reads nothing else of ``hybrid/``."""
    graph = package_imports()
    assert graph[STAGING_PLAN] and all(m.startswith(f"{RUNTIME}.settings") for m in graph[STAGING_PLAN])
    tree = ast.parse((ROOT / RUNTIME / "hybrid" / "staging" / "plan.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "vllm", "kt_kernel"}, imported
    planning = {m: graph[m] for m in graph if m.startswith(f"{RUNTIME}.planning")}
    reaches = {n for deps in planning.values() for n in deps if n.startswith(HYBRID)}
    assert reaches == {STAGING_PLAN}, reaches


def test_the_process_state_keeps_its_contract() -> None:
    """The one ProcessState (process_state.HybridProcessState) has every member of the
    Protocol the layers call, methods with the Protocol's parameters."""
    import inspect

    from vllm_kt_plugin.hybrid.contracts import ProcessState
    from vllm_kt_plugin.hybrid.process_state import HybridProcessState

    state = HybridProcessState()
    attributes = set(ProcessState.__annotations__)
    methods = {n for n, v in vars(ProcessState).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert {"staging", "host_experts_after", "split_path_after", "split_probe", "timeline"} <= attributes | methods
    assert not [a for a in sorted(attributes) if not hasattr(state, a)]
    for name in sorted(methods):
        wanted = list(inspect.signature(getattr(ProcessState, name)).parameters)[1:]
        assert list(inspect.signature(getattr(state, name)).parameters) == wanted, name


# vLLM's public interfaces, the only vLLM imports allowed outside hybrid/vllm_compat.py:
# the quantization-method plugin interface kt-hybrid implements (vLLM calls it with these
# types: the config, the MoE method and the layer it is given, its FusedMoEConfig, ...),
# vLLM's logger, platform, config context and custom-op helper, and the Hugging Face config
# reader `vllm serve` itself uses. Everything else of vLLM's is an internal: it goes through
# vllm_compat, with a TOUCHES entry that tests/unit/test_vllm_compat.py checks on the
# installed vLLM.
PUBLIC_VLLM_IMPORTS: dict[str, frozenset[str]] = {
    "vllm.config": frozenset({"CUDAGraphMode", "VllmConfig", "get_current_vllm_config", "set_current_vllm_config"}),
    "vllm.logger": frozenset({"init_logger"}),
    "vllm.platforms": frozenset({"current_platform"}),
    "vllm.utils.torch_utils": frozenset({"direct_register_custom_op"}),
    "vllm.transformers_utils.config": frozenset({"get_config"}),
    "vllm.model_executor.layers.quantization": frozenset({"get_quantization_config", "register_quantization_config"}),
    "vllm.model_executor.layers.quantization.base_config": frozenset(
        {"QuantizationConfig", "QuantizeMethodBase", "resolve_quant_method"}
    ),
    "vllm.model_executor.layers.linear": frozenset({"LinearBase", "UnquantizedLinearMethod"}),
    "vllm.model_executor.models.utils": frozenset({"WeightsMapper"}),
    "vllm.model_executor.layers.fused_moe": frozenset({"RoutedExperts"}),
    "vllm.model_executor.layers.fused_moe.fused_moe_method_base": frozenset({"FusedMoEMethodBase"}),
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method": frozenset({"UnquantizedFusedMoEMethod"}),
    "vllm.model_executor.layers.fused_moe.config": frozenset(
        {"FusedMoEConfig", "FusedMoEParallelConfig", "FusedMoEQuantConfig"}
    ),
    "vllm.model_executor.layers.fused_moe.modular_kernel": frozenset({"FusedMoEKernel"}),
    "vllm.model_executor.layers.fused_moe.runner.shared_experts": frozenset({"SharedExperts"}),
}
# What the tooling may use besides: the offline engine and its settings (vllm.LLM), the
# config a layer is built under, the factory models build MoE layers with, and
# ``import vllm`` (its version). Its internals are in vllm_kt_tools/support/vllm_internals.py.
PUBLIC_VLLM_TOOL_IMPORTS: dict[str, frozenset[str]] = {
    "vllm": frozenset({"LLM", "SamplingParams"}),
    "vllm.inputs": frozenset({"TokensPrompt"}),  # prompts as token ids (the model check's teacher forcing)
    "vllm.entrypoints.cli.main": frozenset(),  # the module the `vllm` command runs (vllm serve)
    "vllm.config": frozenset({"ModelConfig"}),
    "vllm.model_executor.layers.fused_moe": frozenset({"FusedMoEFactory"}),
}
COMPAT = ROOT / RUNTIME / "hybrid" / "vllm_compat.py"
TOOLS_COMPAT = ROOT / TOOLS / "support" / "vllm_internals.py"
_VLLM_MODULE_NAME = re.compile(r"vllm(\.\w+)+")


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def _names_a_vllm_module(node: ast.AST) -> bool:
    import importlib.util

    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    return bool(_VLLM_MODULE_NAME.fullmatch(node.value)) and importlib.util.find_spec(node.value) is not None


def vllm_imports_outside_compat(package: str = RUNTIME) -> list[tuple[str, str, str | None]]:
    """Every use of a vLLM module in ``package`` outside its compat module (vllm_compat.py,
    vllm_internals.py), as (where, module, name): each ``from vllm... import name`` and
    ``import vllm...`` (TYPE_CHECKING ones too), and each string naming an importable vLLM
    module (``importlib.import_module("vllm....")``)."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path in (COMPAT, TOOLS_COMPAT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_vllm(node.module):
                found += [(where, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(where, alias.name, None) for alias in node.names if _is_vllm(alias.name)]
            elif _names_a_vllm_module(node):
                found.append((where, node.value, None))
    return found


def unlisted_vllm_imports(
    found: list[tuple[str, str, str | None]], extra: dict[str, frozenset[str]] | None = None
) -> list[str]:
    """The uses not on PUBLIC_VLLM_IMPORTS (nor on ``extra``, with ``import vllm`` itself)."""
    allowed = {
        m: PUBLIC_VLLM_IMPORTS.get(m, frozenset()) | (extra or {}).get(m, frozenset())
        for m in {*PUBLIC_VLLM_IMPORTS, *(extra or {})}
    }
    return [
        f"{where} {module}{f'.{name}' if name else ''}"
        for where, module, name in found
        if not (extra is not None and name is None and module in {"vllm", *extra})
        and (name is None or name not in allowed.get(module, ()))
    ]


def test_vllm_is_imported_through_its_public_interfaces_only() -> None:
    """Outside vllm_compat.py every vLLM import is on PUBLIC_VLLM_IMPORTS: any other — a new
    one included, whatever its name — fails here, to be moved into vllm_compat with a
    TOUCHES entry (or, if it is an interface vLLM offers plugins, added above with why)."""
    found = vllm_imports_outside_compat()
    assert len(found) > 20  # the walk found the package's imports
    unlisted = unlisted_vllm_imports(found)
    assert not unlisted, "vLLM internals outside hybrid/vllm_compat.py: " + "; ".join(unlisted)


def test_the_tooling_imports_vllm_internals_in_one_module_only() -> None:
    """The same guard over vllm_kt_tools: its public interfaces (the runtime's and
    PUBLIC_VLLM_TOOL_IMPORTS), and every internal through support/vllm_internals.py, whose
    TOUCHES tests/unit/test_vllm_compat.py checks on the installed vLLM."""
    found = vllm_imports_outside_compat(TOOLS)
    assert len(found) > 5  # the walk found the tooling's imports
    unlisted = unlisted_vllm_imports(found, PUBLIC_VLLM_TOOL_IMPORTS)
    assert not unlisted, "vLLM internals outside vllm_kt_tools/support/vllm_internals.py: " + "; ".join(unlisted)
    used = {(module, name) for _, module, name in found}
    listed = {(module, name) for module, names in PUBLIC_VLLM_TOOL_IMPORTS.items() for name in names}
    assert listed <= used, sorted(listed - used)
    assert unlisted_vllm_imports([("a.py:1", "vllm.distributed", "init_distributed_environment")], {}) == [
        "a.py:1 vllm.distributed.init_distributed_environment"
    ]


def test_the_public_vllm_imports_exist_and_are_used() -> None:
    """The allow-list against the installed vLLM (an upgrade that moves one fails here), and
    no stale entry: each is imported somewhere."""
    import importlib

    missing = [
        f"{module}.{name}"
        for module, names in PUBLIC_VLLM_IMPORTS.items()
        for name in sorted(names)
        if not hasattr(importlib.import_module(module), name)
    ]
    assert not missing, missing
    used = {(module, name) for _, module, name in vllm_imports_outside_compat()}
    listed = {(module, name) for module, names in PUBLIC_VLLM_IMPORTS.items() for name in names}
    assert listed <= used, sorted(listed - used)


def test_the_import_guard_finds_what_it_was_not_told_about() -> None:
    """A new import is caught by what it is, not by its name being on some list."""
    found = [
        ("a.py:1", "vllm.envs", "VLLM_CPU_KVCACHE_SPACE"),
        ("a.py:2", "vllm.config", "get_current_vllm_config"),
        ("a.py:3", "vllm.model_executor.layers.fused_moe.config", "some_new_helper"),
        ("a.py:4", "vllm.distributed", None),
    ]
    assert unlisted_vllm_imports(found) == [
        "a.py:1 vllm.envs.VLLM_CPU_KVCACHE_SPACE",
        "a.py:3 vllm.model_executor.layers.fused_moe.config.some_new_helper",
        "a.py:4 vllm.distributed",
    ]


# vLLM (and torch.nn.Module) internals that kt-hybrid reads or writes.
PRIVATE_VLLM_ATTRIBUTES = frozenset(
    {"_buffers", "_parameters", "_modules", "_expert_map", "_init_moe_kernel", "_verify_quantization"}
)


def test_vllm_internals_are_touched_in_one_module() -> None:
    """Like kt-kernel's breaks in ``cpu_backends/kt_kernel/compat.py``: every use of a
    private vLLM attribute, and of every attribute TOUCHES lists, is in
    ``hybrid/vllm_compat.py`` (the tooling's: in ``support/vllm_internals.py``), whose
    TOUCHES a unit test checks against the installed vLLM."""
    from vllm_kt_plugin.hybrid.vllm_compat import TOUCHES
    from vllm_kt_tools.support.vllm_internals import TOUCHES as TOOL_TOUCHES

    touched = PRIVATE_VLLM_ATTRIBUTES | {touch.attribute for touch in (*TOUCHES, *TOOL_TOUCHES)}
    # strings count too (getattr(obj, "name")), but these config.json keys and checkpoint tensor names
    # are not vLLM's attributes: Mixtral's num_local_experts, MiniMax-M2's scoring_func, the
    # routers' e_score_correction_bias tensor
    config_keys = {(name, "num_local_experts") for name in ("model_memory.py", "gguf_export.py", "recipes.py")}
    config_keys |= {("recipes.py", "scoring_func"), ("checkpoint.py", "e_score_correction_bias")}
    found = []
    for path in sorted([*(ROOT / RUNTIME).rglob("*.py"), *(ROOT / TOOLS).rglob("*.py")]):
        if path in (COMPAT, TOOLS_COMPAT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            if name in touched and (path.name, name) not in config_keys:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not found, found


MODULE_DOCSTRING_LINES = 8  # about a screen's top (issue 46); measurements and reasoning live in docs/


def test_runtime_module_docstrings_fit_on_a_screens_top() -> None:
    """A module docstring says what the module is for and why, in a few sentences; dated
    measurements, lists of kt-kernel's quirks and design reasoning go to the docs/ page of
    their topic, where a reader of that topic finds them."""
    modules = sorted((ROOT / RUNTIME).rglob("*.py"))
    assert len(modules) > 20
    too_long = {}
    for path in modules:
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=True) or ""
        if len(docstring.splitlines()) > MODULE_DOCSTRING_LINES:
            too_long[str(path.relative_to(ROOT))] = len(docstring.splitlines())
    assert not too_long, too_long
