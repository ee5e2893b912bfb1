"""Files the packages read relative to their own location, found in their source (AST), for
checking that a built wheel holds each one (tests/unit/test_packaging.py).

A read is a path built from ``__file__`` or from ``importlib.resources.files(...)``
(``Path(__file__).with_name("x.json")``, ``.parent / "x"``, ``.parents[2] / "docs"``,
``files(__package__) / "x.json"``, ``os.path.join(os.path.dirname(__file__), "x")``, and
module-level names bound to such paths), worked out where the module lies in the wheel.
A path this cannot work out (a variable part) is reported too: it cannot be checked. Files
of a source checkout (README, docs/, tests/) are read through
``vllm_kt_plugin/source_checkout.py``, the one module left out here.
"""

from __future__ import annotations

import ast
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import tomllib

SOURCE_CHECKOUT = "vllm_kt_plugin/source_checkout.py"
_PATH_CALLS = {"Path", "PurePath", "PosixPath"}
_SAME = {"resolve", "absolute", "expanduser"}  # methods that keep the path


@dataclass(frozen=True)
class PackageRead:
    module: str  # the module's path in the wheel
    line: int
    code: str  # the expression, as written
    target: str | None  # the path it names in the wheel (posix); None: not worked out

    def __str__(self) -> str:
        where = self.target if self.target is not None else "a path with a variable part"
        return f"{self.module}:{self.line}: {self.code} -> {where}"


def package_sources(root: Path, prefixes: Iterable[str] = ("vllm_kt_plugin", "vllm_kt_tools")) -> dict[str, Path]:
    """Wheel path -> source file of every module of the packages pyproject.toml lists under
    ``prefixes`` (its package-dir mapping applied: configs/ is vllm_kt_plugin/configs/)."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    modules = {}
    for package in setuptools["packages"]:
        if not package.startswith(tuple(prefixes)):
            continue
        source = root / mapped.get(package, package.replace(".", "/"))
        for file in source.glob("*.py"):
            modules[f"{package.replace('.', '/')}/{file.name}"] = file
    return modules


def _up(path: str) -> str:
    """The folder holding ``path`` (``..`` above the wheel's top)."""
    return posixpath.normpath(posixpath.join(path or ".", ".."))


class _Evaluator:
    """Works out the path an expression names, in wheel coordinates."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.names: dict[str, str | None] = {}  # module-level names bound to a path

    def base(self, node: ast.AST) -> str | None | bool:
        """The path a base expression names (None: not worked out); False: not a base."""
        if isinstance(node, ast.Name) and node.id == "__file__":
            return self.module
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.names:
            return self.names[node.id]
        if isinstance(node, ast.Call) and _called(node) == "files" and len(node.args) == 1:
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id in ("__package__", "__name__"):
                return _up(self.module)  # this module's package folder
            anchor = _constant(arg)
            return anchor.replace(".", "/") if isinstance(anchor, str) else None
        return False

    def step(
        self, node: ast.AST, parent: ast.AST, grand: ast.AST | None, path: str
    ) -> tuple[ast.AST, str | None] | None:
        """The enclosing expression and the path it names, or None where ``node`` is the last."""
        if isinstance(parent, ast.Call) and parent.args[:1] == [node]:
            called = _called(parent)
            if called in _PATH_CALLS:
                return parent, path
            if called == "dirname":
                return parent, _up(path)
            if called == "join":
                return parent, _joined(path, parent.args[1:])
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div) and parent.left is node:
            return parent, _joined(path, [parent.right])
        if isinstance(parent, ast.Attribute) and parent.value is node:
            if parent.attr == "parent":
                return parent, _up(path)
            if parent.attr == "parents" and isinstance(grand, ast.Subscript):
                index = _constant(grand.slice)
                if not isinstance(index, int):
                    return grand, None
                for _ in range(index + 1):
                    path = _up(path)
                return grand, path
            if isinstance(grand, ast.Call) and grand.func is parent:
                if parent.attr in _SAME:
                    return grand, path
                if parent.attr == "with_name":
                    return grand, _joined(_up(path), grand.args)
                if parent.attr == "joinpath":
                    return grand, _joined(path, grand.args)
        return None


def _joined(path: str, parts: list[ast.expr]) -> str | None:
    names = [_constant(part) for part in parts]
    if not all(isinstance(name, str) for name in names):
        return None
    return posixpath.normpath(posixpath.join(path, *names))  # type: ignore[arg-type]


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _constant(node: ast.AST) -> str | int | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, (str, int)) else None


def module_reads(module: str, source: str) -> list[PackageRead]:
    """The reads of one module (``module``: its path in the wheel)."""
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    evaluator = _Evaluator(module)

    def outermost(node: ast.AST, path: str | None) -> tuple[ast.AST, str | None]:
        while path is not None and (parent := parents.get(node)) is not None:
            stepped = evaluator.step(node, parent, parents.get(parent), path)
            if stepped is None:
                break
            node, path = stepped
        return node, path

    # module-level names bound to a path (``HERE = Path(__file__).parent``): a use that
    # builds on one (``HERE / "x.json"``) is a read of its own
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and [type(t) for t in statement.targets] == [ast.Name]:
            for node in ast.walk(statement.value):
                base = evaluator.base(node)
                if base is not False:
                    top, path = outermost(node, base)  # type: ignore[arg-type]
                    if top is statement.value:
                        evaluator.names[statement.targets[0].id] = path  # type: ignore[attr-defined]
    reads = []
    for node in ast.walk(tree):
        base = evaluator.base(node)
        if base is False:
            continue
        top, path = outermost(node, base)  # type: ignore[arg-type]
        if top is not node or not isinstance(node, ast.Name) or node.id == "__file__":
            reads.append(PackageRead(module, getattr(top, "lineno", 0), ast.unparse(top), path))
    return reads


def package_reads(root: Path) -> list[PackageRead]:
    """Every read of both packages but source_checkout's (the files of a source checkout)."""
    reads = []
    for module, file in sorted(package_sources(root).items()):
        if file.relative_to(root).as_posix() != SOURCE_CHECKOUT:
            reads += module_reads(module, file.read_text())
    return reads


def not_in_wheel(reads: Iterable[PackageRead], names: Iterable[str]) -> list[PackageRead]:
    """The reads whose path the wheel (its member ``names``) lacks, as a file or as a folder
    holding one; and those whose path was not worked out."""
    present = set(names)
    for name in list(present):
        while (name := posixpath.dirname(name)) and name not in present:
            present.add(name)
    return [read for read in reads if read.target not in present]
