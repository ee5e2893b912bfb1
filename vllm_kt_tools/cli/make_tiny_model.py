"""``vllm-kt make-tiny-model ARCH OUT``: write a tiny trained MoE checkpoint (BF16
safetensors and a tokenizer), made here without any download; the training prints its
step and loss every few seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_kt_tools.support.tiny_models import ARCHITECTURES, print_training_progress, write_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("out", type=Path)


def run(args: argparse.Namespace) -> int:
    print(f"training a tiny {args.arch} model into {args.out}", flush=True)
    print(write_tiny_model(args.arch, args.out, progress=print_training_progress))
    return 0
