"""``vllm-kt check-models [ARCH ...]``: check that kt-hybrid serves each MoE architecture of
vLLM's registry with plain vLLM's greedy tokens (``vllm_kt_tools.model_check``), writing one
JSON for the run. ``--out docs/model_checks.json`` rewrites the committed results, from
which ``python -m vllm_kt_tools.support.supported_models`` regenerates the tables."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("architectures", nargs="*", help="registry names (default: every MoE architecture)")
    parser.add_argument("--subset", choices=["ci"], help="ci: one architecture per distinct MoE layer class")
    parser.add_argument("--out", type=Path, default=Path("model_checks.json"), help="the run's JSON")
    parser.add_argument("--models", type=Path, help="where the tiny models are written and reused")
    parser.add_argument("--logs", type=Path, help="where the engines' logs go (default: a temporary folder)")
    parser.add_argument(
        "--torchvision",
        action="store_true",
        help="vLLM's CPU build: install torchvision's Python part apart, so that the model modules "
        "importing it load (model_check/vision_shim.py)",
    )


def run(args: argparse.Namespace) -> int:
    if args.torchvision:  # before transformers is imported: it decides once which processors torchvision backs
        from vllm_kt_tools.model_check import vision_shim

        vision_shim.enable(Path(tempfile.gettempdir()) / "vllm-kt-torchvision")
    from vllm_kt_tools.model_check.run import SERVED, run
    from vllm_kt_tools.model_check.subset import CI_SUBSET
    from vllm_kt_tools.support.supported_models import moe_architectures

    known = moe_architectures()
    chosen = list(args.architectures) or (list(CI_SUBSET) if args.subset else list(known))
    unknown = [a for a in chosen if a not in known]
    if unknown:
        print(f"not a MoE architecture of vLLM's registry: {', '.join(unknown)}", file=sys.stderr)
        return 2
    models = args.models or Path(tempfile.gettempdir()) / "vllm-kt-model-check"
    logs = args.logs or Path(tempfile.mkdtemp(prefix="vllm-kt-model-check-logs-"))
    print(f"checking {len(chosen)} architectures; logs in {logs}", flush=True)

    def show(result: dict[str, Any]) -> None:
        why = f": {result['reason']}" if result.get("reason") else ""
        print(f"{result['architecture']}: {result['status']} ({result['seconds']:.0f} s){why}", flush=True)

    command = shlex.join(["vllm-kt", "check-models", *sys.argv[2:]])
    report = run(chosen, args.out, models, logs, command, progress=show)
    served = sum(r["status"] == SERVED for r in report["architectures"].values())
    print(f"{served} of {len(chosen)} served in {report['seconds']:.0f} s; wrote {args.out}")
    return 0
