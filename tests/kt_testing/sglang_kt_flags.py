"""sglang-kt's server flags, copied from its wheel, so the bench's sglang-kt command line is
parsed in CI as sglang-kt's own parser would (sglang-kt itself needs torch 2.9.1 and CUDA
libraries, so it cannot be imported here).

``python tests/kt_testing/sglang_kt_flags.py WHEEL > tests/kt_testing/sglang_kt_flags.json``
reads ``ServerArgs.add_cli_args`` in the wheel's ``sglang/srt/server_args.py`` (AST only) and
writes every flag, whether it takes a value, and its choices where they are literal."""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

FLAGS_FILE = Path(__file__).with_name("sglang_kt_flags.json")
SERVER_ARGS = "sglang/srt/server_args.py"
# argparse actions that take no value on the command line
NO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version"}


def _literal_lists(tree: ast.Module) -> dict[str, list[Any]]:
    """Module-level ``NAME = [literal, ...]`` (the choices lists server_args names)."""
    lists: dict[str, list[Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(value, list | tuple):
                lists[node.targets[0].id] = list(value)
    return lists


def flags_from_source(source: str) -> dict[str, dict[str, Any]]:
    """Flag -> {"value": takes a value, "choices": list or None} for every ``add_argument``
    call inside ``add_cli_args``."""
    tree = ast.parse(source)
    lists = _literal_lists(tree)
    (add_cli_args,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args"]
    flags: dict[str, dict[str, Any]] = {}
    for call in ast.walk(add_cli_args):
        if not (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
        keywords = {k.arg: k.value for k in call.keywords}
        action = keywords.get("action")
        nargs = keywords.get("nargs")
        takes_value = not (
            (isinstance(action, ast.Constant) and action.value in NO_VALUE_ACTIONS)
            or (isinstance(nargs, ast.Constant) and nargs.value == 0)
        )
        choices: list[Any] | None = None
        node = keywords.get("choices")
        if isinstance(node, ast.Name):
            choices = lists.get(node.id)
        elif node is not None:
            try:
                choices = list(ast.literal_eval(node))
            except ValueError:
                choices = None  # computed at run time: not checked here
        for name in names:
            flags[name] = {
                "value": takes_value,
                "optional_value": isinstance(nargs, ast.Constant) and nargs.value == "?",
                "choices": choices,
            }
    return flags


def parser_from(flags: dict[str, dict[str, Any]]) -> argparse.ArgumentParser:
    """An argparse parser that refuses what sglang-kt's would: unknown flags, a missing value,
    a value outside literal choices."""
    parser = argparse.ArgumentParser(
        prog="sglang.launch_server", add_help=False, allow_abbrev=False, exit_on_error=False
    )
    for name, flag in sorted(flags.items()):
        choices = [str(c) for c in flag["choices"]] if flag["choices"] else None
        if not flag["value"]:
            parser.add_argument(name, action="store_true")
        elif flag["optional_value"]:
            parser.add_argument(name, nargs="?", choices=choices)
        else:
            parser.add_argument(name, choices=choices)
    return parser


def committed() -> dict[str, Any]:
    return json.loads(FLAGS_FILE.read_text())


def main() -> None:
    wheel = Path(sys.argv[1])
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(SERVER_ARGS).decode()
    version = re.match(r"sglang_kt-([^-]+)-", wheel.name)
    json.dump(
        {
            "wheel": wheel.name,
            "version": version.group(1) if version else None,
            "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
            "command": f"python tests/kt_testing/sglang_kt_flags.py {wheel.name} > {FLAGS_FILE.name}",
            "flags": flags_from_source(source),
        },
        sys.stdout,
        indent=1,
        sort_keys=True,
    )
    print()


if __name__ == "__main__":
    main()
