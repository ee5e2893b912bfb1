"""``vllm-kt make-tiny-model ARCH OUT``: write a tiny trained MoE checkpoint (BF16
safetensors and a tokenizer), made here without any download."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_kt_tools.support.tiny_models import ARCHITECTURES, write_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("out", type=Path)


def run(args: argparse.Namespace) -> int:
    print(write_tiny_model(args.arch, args.out))
    return 0
