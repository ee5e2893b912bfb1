"""Run one function in a fresh Python process and read its JSON result back.

The benchmark runs every engine in a process of its own (so each gets the whole GPU and
a timeout can end it with vLLM's engine-core grandchild), and the end-to-end tests run
one engine per configuration the same way. The child prints one line
``RESULT <json>``; everything else it prints (vLLM's logs) is kept as its log.

    python -m vllm_kt_tools.support.child package.module:function '<json keyword arguments>'
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kt_tools.support import process_groups

RESULT_PREFIX = "RESULT "
# "module:function,...": called when this module is imported, i.e. in the child and in every
# process vLLM spawns from it (spawn re-imports the parent's main module, this one), before
# anything else happens there. The bench installs its routing recorder so (vLLM's CPU build
# spawns its workers; the CUDA build forks its engine core).
PRELOAD_VARIABLE = "VLLM_KT_CHILD_PRELOAD"


def _preload() -> None:
    for target in filter(None, os.environ.get(PRELOAD_VARIABLE, "").split(",")):
        module, function = target.split(":")
        getattr(importlib.import_module(module), function)()


@dataclass(frozen=True)
class ChildRun:
    result: Any  # the function's return value; None when it printed none (failed)
    returncode: int
    log: str  # everything the child printed

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.strip().splitlines()[-lines:])


def parse_result(log: str) -> Any:
    for line in log.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return None


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def run_child(
    target: str,
    kwargs: Mapping[str, Any],
    *,
    env: Mapping[str, str],
    timeout_s: float,
    log_path: Path | None = None,
) -> ChildRun:
    """``target`` ("module:function") called with ``kwargs`` in a process group of its own
    (``process_groups``); the whole group is stopped when it returns, fails or times out
    (vLLM's engine core is the child's child). Output goes to ``log_path`` (or a temporary
    file)."""
    command = [sys.executable, "-m", __name__, target, json.dumps(dict(kwargs))]
    with open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+") as log:  # noqa: SIM115
        proc = process_groups.start(command, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process_groups.stop(proc)
            code = proc.wait()
            log.write(f"\n[child] stopped after {timeout_s:.0f} s\n")
        finally:
            process_groups.stop(proc)  # what it left behind, even after a clean exit
        if code != 0:  # a signal (negative) or a C abort says nothing in the log itself
            log.write(f"\n[child] exited with {_exit_status(code)}\n")
        log.flush()
        log.seek(0)
        text = log.read()
    return ChildRun(parse_result(text), code, text)


def main(argv: Sequence[str]) -> int:
    target, kwargs = argv[0], json.loads(argv[1])
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(**kwargs)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ in ("__main__", "__mp_main__"):
    _preload()
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
