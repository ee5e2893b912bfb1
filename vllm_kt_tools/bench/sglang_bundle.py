"""sglang-kt's package set for the GPU host (``benchmarks/sglang-bundle.sh``): which wheels of
``ktransformers[sglang]==0.7.2`` travel, and the check that a set can start sglang-kt's server.

Why a check: the 2026-12-06 sitting carried 85 parts and sglang-kt still did not start, once
for a trimmed wheel (IPython, imported by ``sglang.utils``) and once for a file no wheel of
that set carried (``sgl_kernel/sm90/common_ops``, which only the ``ktransformers`` wheel
has). Both are visible in the wheels, without a GPU, before anything is carried.

What it checks (``check``), each failure one line:

- the files the H100 needs: ``sgl_kernel/sm90/common_ops.abi3.so`` (``sgl_kernel`` loads
  ``sm90/`` on compute capability 9.0 and nothing else);
- the payload modules ``sgl_kernel/_payload_manifest.py`` lists (five in 0.7.2; their
  ``payload.part`` files, concatenated in the manifest's order, must give its
  ``ARCHIVE_SHA256``: ``sgl_kernel.payload_runtime`` materialises ``flash_ops`` from them);
- one wheel per distribution (no two versions of one name);
- every module the server imports, by a static walk over the wheels' own sources from
  ``ROOTS``. The rule for an import statement, by where it stands:

  * at module level (class bodies and ``with``/``for`` blocks included), outside ``try`` and
    ``if``: **required** — it runs whenever its module is imported;
  * under an ``if`` (or in an ``except`` handler): **conditional** — it runs on some hosts
    (``if _is_cuda:`` / ``if _is_npu:``);
  * inside a ``try`` whose handlers catch ``ImportError`` (or a parent of it): **guarded**
    — its absence is handled;
  * inside a function: **lazy** — it runs only if the function does;
  * under ``if TYPE_CHECKING:``: never runs, not followed; ``if __name__ == "__main__":``
    counts as module level for the root that runs as ``-m`` only.

  A module's strength is that of the strongest path to it (a path is as weak as its weakest
  edge). A **required** module missing from the set fails. A **conditional** one fails only
  when a wheel of the reference set (the whole download) provides it, i.e. it was trimmed:
  modules no wheel provides are other platforms' (``torch_npu``, ``aiter``). Guarded and
  lazy ones never fail; where a trimmed wheel provides them they are listed, so each trim
  shows who could still want it. Extension modules are leaves (their own submodules, like
  ``torch._C._nn``, are accepted unseen).

The walk starts at ``sglang.launch_server`` (run as ``-m``) and at the modules the server
imports where no static walk can see it (``ROOTS``): ``launch_server`` imports its HTTP server
inside a function, and the model registry imports every model with ``importlib`` — one of
them, ``deepseek_v4``, is what registers kt-kernel's MoE wrapper for every model.

    python -m vllm_kt_tools.bench.sglang_bundle plan CACHE_DIR [--link-into DIR]
    python -m vllm_kt_tools.bench.sglang_bundle check WHEEL_DIR [--reference CACHE_DIR]

Standard library only: it runs under whatever Python builds the bundle.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import heapq
import json
import os
import re
import sys
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

# The set benchmarks/sglang-bundle.sh downloads: ktransformers[sglang]==KTRANSFORMERS_VERSION
KTRANSFORMERS_VERSION = "0.7.2"
# sgl_kernel's loader takes sm90/ on compute capability 9.0 (sgl_kernel/load_utils.py)
REQUIRED_FILES = ("sgl_kernel/sm90/common_ops.abi3.so",)
PAYLOAD_MANIFEST = "sgl_kernel/_payload_manifest.py"
# Where the walk starts: the server's entry point, then what it imports out of a static
# walk's sight (launch_server.run_server's import, the model registry's importlib) for a
# Qwen3-MoE served with kt-kernel's experts.
MAIN_ROOT = "sglang.launch_server"
ROOTS = (
    MAIN_ROOT,
    "sglang.srt.entrypoints.http_server",  # run_server's default mode, imported inside it
    "sglang.srt.managers.scheduler",  # the scheduler process (and its model runner)
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.registry",
    "sglang.srt.models.qwen3_moe",  # the benchmark's model, imported by the registry
    "sglang.srt.models.deepseek_v4",  # its import registers kt-kernel's MoE wrapper (all models)
    "sglang.srt.layers.moe.kt_ep_wrapper",
    "sglang.srt.layers.attention.flashattention_backend",  # fa3, the default on sm90
    "sglang.srt.layers.sampler",
    # the scheduler builds its grammar backend at start whether or not a request asks for one:
    # sglang-kt's server_args defaults it to llguidance (xgrammar would clash with transformers-kt);
    # trimming llguidance killed the scheduler on the H100 of 2026-12-06 after CUDA-graph capture
    "sglang.srt.constrained.llguidance_backend",
    "kt_kernel",
    "sgl_kernel",
)
# Left out of the package set, each with the reason it is not needed to serve a text-only
# Qwen3-MoE from a local folder with kt-kernel's CPU experts. The check fails if any of them
# is imported where it must be (required or conditional): a trim can only be of a wheel the
# server never imports unguarded.
TRIMMED: dict[str, str] = {
    "torchaudio": "audio inputs of multimodal models; nothing imports it unguarded",
    "torchcodec": "video/audio decoding for multimodal inputs",
    "av": "video decoding (PyAV) for multimodal inputs",
    "decord2": "video frame decoding for multimodal inputs",
    "timm": "vision backbones of vision-language models",
    "datasets": "datasets of SGLang's own benchmark and eval scripts, not of the server",
    "pyarrow": "the datasets library's storage",
    "multiprocess": "the datasets library's process pool",
    "py_spy": "a sampling profiler binary",
    "hf_transfer": "faster Hugging Face downloads; the host is offline and the model local",
    "tilelang": "DeepSeek-V4's kernels (sglang.jit_kernel.deepseek_v4 imports it inside its kernel builders)",
    "z3_solver": "SMT solver of sympy.logic's z3 wrapper and tilelang; imported only inside functions",
    "pycountry": "country names of outlines' structured-output types; no constrained decoding here",
    "flashinfer_cubin": "flashinfer's optional precompiled cubins (TensorRT-LLM-gen attention and MoE for "
    "Blackwell, its DeepGEMM for FP8); flashinfer runs without it, and the benchmark serves BF16 with FA3 "
    "attention and Triton MoE on sm90",
}
# Not a file in any wheel, yet importable: dropped from the standard library in 3.12 but
# still named in 3.11's list; the walk may run under either.
REMOVED_IN_312 = frozenset({"distutils", "imp", "asynchat", "asyncore", "smtpd"})
EXTENSION_RE = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(\.[A-Za-z0-9_-]+)*\.(so|pyd)$")


class Strength(IntEnum):
    """How surely an import runs when its module is imported (see the module's docstring)."""

    LAZY = 0
    GUARDED = 1
    CONDITIONAL = 2
    REQUIRED = 3


def normalized(dist: str) -> str:
    """A distribution's name as wheel files and pip compare it (PEP 503, underscores)."""
    return re.sub(r"[-_.]+", "_", dist).lower()


@dataclass
class Wheel:
    path: Path
    dist: str  # normalized
    version: str
    names: list[str]
    _archive: zipfile.ZipFile | None = field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, path: Path) -> Wheel:
        dist, version = path.name.split("-")[:2]
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        return cls(path, normalized(dist), version, names)

    def read(self, member: str) -> bytes:
        if self._archive is None:  # kept open: the walk reads thousands of members of a few wheels
            self._archive = zipfile.ZipFile(self.path)
        return self._archive.read(member)


def wheels_in(folder: Path) -> list[Wheel]:
    return [Wheel.open(path) for path in sorted(Path(folder).glob("*.whl"))]


def _installed_path(member: str) -> str | None:
    """Where a wheel member lands in site-packages (``*.data/purelib|platlib`` unwrapped);
    None for metadata and scripts."""
    first, _, rest = member.partition("/")
    if first.endswith(".dist-info"):
        return None
    if first.endswith(".data"):
        kind, _, inner = rest.partition("/")
        return inner if kind in ("purelib", "platlib") else None
    return member


@dataclass(frozen=True)
class Found:
    wheel: Wheel
    member: str | None  # the source file; None for an extension or a namespace package
    kind: str  # "source", "extension", "namespace"
    is_package: bool


class ModuleIndex:
    """Which wheel provides which importable module (by file layout, as Python finds them)."""

    def __init__(self, wheels: Iterable[Wheel]) -> None:
        self.sources: dict[str, tuple[Wheel, str, bool]] = {}
        self.extensions: dict[str, Wheel] = {}
        self.directories: dict[str, Wheel] = {}
        self.files: dict[str, Wheel] = {}
        for wheel in wheels:
            for member in wheel.names:
                path = _installed_path(member)
                if not path or path.endswith("/"):
                    continue
                self.files.setdefault(path, wheel)
                parts = path.split("/")
                for depth in range(1, len(parts)):
                    self.directories.setdefault(".".join(parts[:depth]), wheel)
                if path.endswith(".py"):
                    module = path[:-3].replace("/", ".")
                    package = module.endswith(".__init__")
                    module = module.removesuffix(".__init__")
                    # a package's __init__ wins over a same-named module of another wheel
                    if package or module not in self.sources:
                        self.sources[module] = (wheel, member, package)
                else:
                    match = EXTENSION_RE.match(parts[-1])
                    if match:
                        self.extensions.setdefault(".".join([*parts[:-1], match["name"]]), wheel)

    def find(self, module: str) -> Found | None:
        if module in self.sources:
            wheel, member, package = self.sources[module]
            return Found(wheel, member, "source", package)
        if module in self.extensions:
            return Found(self.extensions[module], None, "extension", False)
        parts = module.split(".")
        for depth in range(len(parts) - 1, 0, -1):  # inside an extension module: its own business
            parent = ".".join(parts[:depth])
            if parent in self.extensions:
                return Found(self.extensions[parent], None, "extension", False)
        if module in self.directories:
            return Found(self.directories[module], None, "namespace", True)
        return None


def standard_library() -> frozenset[str]:
    return frozenset(sys.stdlib_module_names) - REMOVED_IN_312 | {"__future__", "__main__"}


@dataclass(frozen=True)
class Edge:
    target: str
    strength: Strength
    line: int
    maybe_attribute: bool = False  # ``from a import b``: b may be a name, not a module


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        (isinstance(t, ast.Name) and t.id in names) or (isinstance(t, ast.Attribute) and t.attr in names) for t in types
    )


def _suppresses_import_error(item: ast.withitem) -> bool:
    """``with suppress(ImportError):`` (contextlib's), which guards as ``try`` does."""
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    caught = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    return name == "suppress" and any(
        (isinstance(a, ast.Name) and a.id in caught) or (isinstance(a, ast.Attribute) and a.attr in caught)
        for a in call.args
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _literal_imports(node: ast.AST) -> Iterator[tuple[str, int]]:
    """``importlib.import_module("x")`` / ``__import__("x")`` with a literal name, outside
    nested functions."""
    todo = [node]
    while todo:
        current = todo.pop()
        if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        if isinstance(current, ast.Call) and current.args:
            func = current.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            first = current.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                yield first.value, current.lineno
        todo.extend(ast.iter_child_nodes(current))


def sys_modules_aliases(tree: ast.Module) -> set[str]:
    """Names a module puts into ``sys.modules`` itself (``sys.modules["kt_kernel_ext"] = ...``:
    kt_kernel registers its CPU variant's extension so): importable once it ran."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "modules"
                    and isinstance(target.slice, ast.Constant)
                    and isinstance(target.slice.value, str)
                ):
                    names.add(target.slice.value)
    return names


def imports_of(source: str, module: str, is_package: bool, as_main: bool = False) -> list[Edge]:
    """The import edges of one module's source, each with its strength (module docstring)."""
    return _edges(ast.parse(source), module, is_package, as_main)


def _edges(tree: ast.Module, module: str, is_package: bool, as_main: bool) -> list[Edge]:
    package = module if is_package else module.rpartition(".")[0]
    edges: list[Edge] = []

    def absolute(level: int, name: str | None) -> str:
        if level == 0:
            return name or ""
        base = package.split(".") if package else []
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, name] if name else base)

    def visit(statements: list[ast.stmt], strength: Strength) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                edges.extend(Edge(alias.name, strength, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = absolute(node.level, node.module)
                edges.append(Edge(base, strength, node.lineno))
                for alias in node.names:
                    if alias.name != "*":
                        edges.append(Edge(f"{base}.{alias.name}", strength, node.lineno, maybe_attribute=True))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, Strength.LAZY)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, strength)
            elif isinstance(node, ast.If):
                if _is_type_checking(node.test):
                    visit(node.orelse, strength)
                elif _is_main_guard(node.test):
                    if as_main:
                        visit(node.body, strength)
                    visit(node.orelse, strength)
                else:
                    weaker = min(strength, Strength.CONDITIONAL)
                    visit(node.body, weaker)
                    visit(node.orelse, weaker)
            elif isinstance(node, ast.Try | ast.TryStar):
                guarded = any(_catches_import_error(h) for h in node.handlers)
                visit(node.body, min(strength, Strength.GUARDED) if guarded else strength)
                for handler in node.handlers:
                    visit(handler.body, min(strength, Strength.CONDITIONAL))
                visit(node.orelse, strength)
                visit(node.finalbody, strength)
            elif isinstance(node, ast.Match):
                for case in node.cases:
                    visit(case.body, min(strength, Strength.CONDITIONAL))
            elif isinstance(node, ast.With | ast.AsyncWith):
                guarded = any(_suppresses_import_error(item) for item in node.items)
                visit(node.body, min(strength, Strength.GUARDED) if guarded else strength)
            elif isinstance(node, ast.For | ast.AsyncFor | ast.While):
                visit(node.body, strength)
                visit(getattr(node, "orelse", []), min(strength, Strength.CONDITIONAL))
            else:
                edges.extend(Edge(name, strength, line) for name, line in _literal_imports(node))

    visit(tree.body, Strength.REQUIRED)
    return [edge for edge in edges if edge.target]


@dataclass(frozen=True)
class Reached:
    strength: Strength
    importer: str  # the module whose import made it (the root's own name for a root)
    line: int


@dataclass
class Walk:
    """Modules reached from the roots and their strength; what could not be found."""

    reached: dict[str, Reached] = field(default_factory=dict)
    missing: dict[str, Reached] = field(default_factory=dict)
    unparsed: dict[str, str] = field(default_factory=dict)  # module -> the parser's error
    aliases: set[str] = field(default_factory=set)  # put into sys.modules by a reached module

    def wheels(self, index: ModuleIndex) -> dict[str, Strength]:
        """The strongest reach of each wheel's modules."""
        strengths: dict[str, Strength] = {}
        for module, how in self.reached.items():
            found = index.find(module)
            if found:
                dist = found.wheel.dist
                strengths[dist] = max(strengths.get(dist, Strength.LAZY), how.strength)
        return strengths


def walk(
    index: ModuleIndex, roots: Iterable[str] = ROOTS, main: str = MAIN_ROOT, reference: ModuleIndex | None = None
) -> Walk:
    """Every module reached from ``roots``, at the strength of its strongest path
    (``reference``: ``from a import b`` names a module there, so b is missing, not a name)."""
    stdlib = standard_library()
    result = Walk()
    queue: list[tuple[int, str, str, int]] = [(-Strength.REQUIRED, root, root, 0) for root in roots]
    parsed: dict[str, list[Edge]] = {}
    while queue:
        negative, module, importer, line = heapq.heappop(queue)
        strength = Strength(-negative)
        known = result.reached.get(module) or result.missing.get(module)
        if known and known.strength >= strength:
            continue
        if module.split(".")[0] in stdlib:
            continue
        found = index.find(module)
        if found is None:
            result.missing[module] = Reached(strength, importer, line)
            continue
        result.reached[module] = Reached(strength, importer, line)
        parts = module.split(".")
        for depth in range(1, len(parts)):  # importing a.b.c runs a and a.b first
            heapq.heappush(queue, (-strength, ".".join(parts[:depth]), module, 0))
        if found.kind != "source" or found.member is None:
            continue
        if module not in parsed:
            try:
                with warnings.catch_warnings():  # invalid escapes in some sources: not ours to report
                    warnings.simplefilter("ignore")
                    tree = ast.parse(found.wheel.read(found.member).decode("utf-8", errors="replace"))
                parsed[module] = _edges(tree, module, found.is_package, as_main=module == main)
                result.aliases |= sys_modules_aliases(tree)
            except SyntaxError as exc:
                result.unparsed[module] = f"{found.member}: {exc.msg} (line {exc.lineno})"
                parsed[module] = []
        for edge in parsed[module]:
            unknown = index.find(edge.target) is None and (reference is None or reference.find(edge.target) is None)
            if edge.maybe_attribute and unknown:
                continue  # ``from a import name``: a name, not a module
            heapq.heappush(queue, (-min(strength, edge.strength), edge.target, module, edge.line))
    for module in list(result.missing):  # an alias and what lies inside it (an extension's own submodules)
        parts = module.split(".")
        if any(".".join(parts[:depth]) in result.aliases for depth in range(1, len(parts) + 1)):
            del result.missing[module]
    return result


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wheels: int = 0
    bytes: int = 0
    modules_reached: int = 0
    reach: dict[str, str] = field(default_factory=dict)  # dist -> strongest reach
    trimmed_optional_users: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


def _payload_manifest(index: ModuleIndex) -> dict[str, object] | None:
    wheel = index.files.get(PAYLOAD_MANIFEST)
    if wheel is None:
        return None
    member = next(m for m in wheel.names if _installed_path(m) == PAYLOAD_MANIFEST)
    values: dict[str, object] = {}
    for node in ast.parse(wheel.read(member)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


def check_payload(index: ModuleIndex, verify_sha256: bool = True) -> list[str]:
    """The payload modules the manifest lists, each with its part; their concatenation's
    sha256 as the manifest records it (``sgl_kernel.payload_runtime._materialize_all``)."""
    manifest = _payload_manifest(index)
    if manifest is None:
        return [f"no wheel carries {PAYLOAD_MANIFEST} (sgl_kernel's payload manifest)"]
    modules = list(manifest.get("PAYLOAD_MODULES", ()))  # type: ignore[call-overload]
    failures = []
    digest = hashlib.sha256()
    for module in modules:
        part = f"{module}/payload.part"
        wheel = index.files.get(part)
        if wheel is None:
            failures.append(f"payload module {module} missing (listed by {PAYLOAD_MANIFEST})")
            continue
        if verify_sha256 and not failures:
            member = next(m for m in wheel.names if _installed_path(m) == part)
            with zipfile.ZipFile(wheel.path) as archive, archive.open(member) as stream:
                for block in iter(lambda: stream.read(8 << 20), b""):
                    digest.update(block)
    if verify_sha256 and not failures and digest.hexdigest() != manifest.get("ARCHIVE_SHA256"):
        failures.append(f"the payload parts of {', '.join(modules)} do not give the manifest's ARCHIVE_SHA256")
    return failures


def check(
    bundle: list[Wheel],
    reference: list[Wheel] | None = None,
    roots: Iterable[str] = ROOTS,
    verify_sha256: bool = True,
    imports: bool = True,
) -> Verdict:
    """Whether ``bundle`` (the wheels that travel) can start sglang-kt's server on an H100;
    ``reference`` (the full download) tells trimmed modules from other platforms' ones;
    ``imports=False`` checks the files alone (the walk reads ~10,000 modules: a minute)."""
    verdict = Verdict(wheels=len(bundle), bytes=sum(w.path.stat().st_size for w in bundle))
    seen: dict[str, str] = {}
    for wheel in bundle:
        if wheel.dist in seen:
            verdict.failures.append(f"two versions of {wheel.dist}: {seen[wheel.dist]} and {wheel.version}")
        seen[wheel.dist] = wheel.version
    index = ModuleIndex(bundle)
    verdict.failures += [f"no wheel carries {path}" for path in REQUIRED_FILES if path not in index.files]
    verdict.failures += check_payload(index, verify_sha256)
    if not imports:
        return verdict
    roots = list(roots)
    full = ModuleIndex(reference) if reference else None
    result = walk(index, roots, reference=full)
    verdict.modules_reached = len(result.reached)
    verdict.reach = {dist: s.name.lower() for dist, s in sorted(result.wheels(index).items())}
    for module, how in sorted(result.missing.items()):
        provider = full.find(module) if full else None
        where = f"{how.importer}:{how.line}" if how.line else how.importer
        if how.strength == Strength.REQUIRED and module in roots:
            verdict.failures.append(f"{module}: not in the set (a root of the walk)")
        elif how.strength == Strength.REQUIRED:
            source = f"wheel {provider.wheel.dist}, left out" if provider else "no wheel of the download"
            verdict.failures.append(f"{module}: imported by {where} at module level, provided by {source}")
        elif how.strength == Strength.CONDITIONAL and provider:
            verdict.failures.append(
                f"{module}: imported by {where} under a condition, provided by wheel {provider.wheel.dist}, left out"
            )
        elif provider:
            verdict.trimmed_optional_users.setdefault(provider.wheel.dist, []).append(
                f"{module} ({how.strength.name.lower()}, {where})"
            )
    for module, error in sorted(result.unparsed.items()):
        verdict.notes.append(f"{module}: not parsed ({error}); its imports were not followed")
    return verdict


def plan(cache: Path, trimmed: dict[str, str] = TRIMMED) -> tuple[list[Wheel], list[Wheel]]:
    """The download split into the wheels that travel and those left out (``trimmed``)."""
    wheels = wheels_in(cache)
    left_out = {normalized(name) for name in trimmed}
    return [w for w in wheels if w.dist not in left_out], [w for w in wheels if w.dist in left_out]


def _print_verdict(verdict: Verdict) -> None:
    print(
        f"[sglang-bundle] {verdict.wheels} wheels, {verdict.bytes / 2**20:.0f} MiB, "
        f"{verdict.modules_reached} modules reached from {len(ROOTS)} roots"
    )
    for dist, users in sorted(verdict.trimmed_optional_users.items()):
        print(f"[sglang-bundle] left out {dist}: imported only guarded or inside functions by {'; '.join(users[:4])}")
    for note in verdict.notes:
        print(f"[sglang-bundle] note: {note}")
    for failure in verdict.failures:
        print(f"[sglang-bundle] FAIL: {failure}")
    print(f"[sglang-bundle] verdict: {'ok' if verdict.ok else f'{len(verdict.failures)} failures'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_kt_tools.bench.sglang_bundle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    planned = sub.add_parser("plan", help="split the download into kept and left-out wheels")
    planned.add_argument("cache", type=Path)
    planned.add_argument("--link-into", type=Path, help="hard-link (else copy) the kept wheels into this folder")
    checked = sub.add_parser("check", help="check a folder of wheels (exit 1 on a failure)")
    checked.add_argument("wheels", type=Path)
    checked.add_argument("--reference", type=Path, help="the full download, to tell trimmed modules apart")
    checked.add_argument("--json", type=Path, help="also write the verdict here")
    args = parser.parse_args(argv)
    if args.command == "plan":
        kept, left_out = plan(args.cache)
        size = sum(w.path.stat().st_size for w in kept)
        for wheel in left_out:
            print(f"left out {wheel.path.name}: {TRIMMED.get(wheel.dist) or TRIMMED[wheel.dist]}")
        print(f"kept {len(kept)} wheels, {size / 2**20:.0f} MiB; left out {len(left_out)}")
        if args.link_into:
            args.link_into.mkdir(parents=True, exist_ok=True)
            for wheel in kept:
                target = args.link_into / wheel.path.name
                try:
                    os.link(wheel.path, target)
                except OSError:
                    target.write_bytes(wheel.path.read_bytes())
        return 0
    reference = wheels_in(args.reference) if args.reference else None
    verdict = check(wheels_in(args.wheels), reference)
    _print_verdict(verdict)
    if args.json:
        args.json.write_text(json.dumps(verdict.__dict__ | {"ok": verdict.ok}, indent=1, default=str))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
