"""``vllm-kt``: the command line of vllm-kt-plugin.

Only the chosen command's module is imported, so ``vllm-kt --help`` and light commands
do not wait for torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module under vllm_kt_tools.cli, one-line help)
COMMANDS = {
    "demo": ("demo", "serve a tiny generated MoE with kt-hybrid and ask it one chat question"),
    "doctor": ("doctor", "check this machine and the KT_* settings (OK / WARN / ERROR per check)"),
    "profile": ("profile", "record per-layer expert activation counts for KT_EXPERT_PLACEMENT=frequency"),
    "bench": ("bench", "kt-hybrid vs plain vLLM vs --cpu-offload-gb on one GPU"),
    "make-tiny-model": ("make_tiny_model", "write a tiny trained MoE checkpoint (no download)"),
    "check-models": ("check_models", "check kt-hybrid against plain vLLM on a tiny model of every MoE architecture"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="vllm-kt", description="kt-kernel CPU experts inside vLLM: tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if argv[:1] == [name]:
            chosen = importlib.import_module(f"{__package__}.{module}")
            chosen.add_arguments(command_parser)
    args = parser.parse_args(argv)
    assert chosen is not None  # parse_args exits on an unknown command
    return int(chosen.run(args))


if __name__ == "__main__":
    sys.exit(main())
