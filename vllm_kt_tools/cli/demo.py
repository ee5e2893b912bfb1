"""``vllm-kt demo``: a tiny generated MoE model served by ``vllm serve --quantization
kt-hybrid`` (half of each layer's experts on kt-kernel), asked one chat question through
the OpenAI client."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_kt_plugin.settings.catalogue import cache_root
from vllm_kt_tools.support.server import VLLMServer
from vllm_kt_tools.support.tiny_models import ARCHITECTURES, tiny_model_dir


def _progress_line(label: str) -> Callable[[float], None]:
    """Elapsed time while waiting: one updating line on a terminal, a line per 15 s in logs."""
    tty = sys.stdout.isatty()
    shown = [-15.0]

    def show(elapsed: float) -> None:
        if tty:
            print(f"\r      {label}... {elapsed:4.0f} s", end="", flush=True)
        elif elapsed - shown[0] >= 15:
            shown[0] = elapsed
            print(f"      {label}... {elapsed:.0f} s", flush=True)

    return show


def run_demo(workdir: Path, question: str, gpu_experts: int, arch: str) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[1/3] tiny {arch} model in {workdir} (trained once, ~30-60 s)", flush=True)
    model = tiny_model_dir(arch, workdir)
    env = {"KT_NUM_GPU_EXPERTS": str(gpu_experts)}
    log = workdir / "vllm-serve.log"
    server = VLLMServer(
        model, ["--quantization", "kt-hybrid", "--served-model-name", "tiny-moe", "--max-model-len", "512"], env, log
    )
    print(f"[2/3] KT_NUM_GPU_EXPERTS={gpu_experts} vllm {' '.join(server.command[1:])}", flush=True)
    print(f"      (log: {log})", flush=True)
    try:
        server.start(progress=_progress_line("starting vLLM"))
        print(f"\r      server ready on {server.base_url}{' ' * 20}", flush=True)
        from openai import OpenAI  # deferred: a test extra, needed only once the server answers

        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY")
        reply = client.chat.completions.create(
            model="tiny-moe",
            messages=[{"role": "user", "content": question}],
            temperature=0.0,
            max_tokens=32,
        )
        print(f"[3/3] chat: {question}")
        print(f"      answer: {reply.choices[0].message.content}")
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"\nvllm serve failed: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=cache_root(), help="where the tiny model and the log go")
    parser.add_argument("--question", default="What is the capital of France?")
    parser.add_argument("--gpu-experts", type=int, default=4, help="experts per layer kept on the GPU (of 8)")
    parser.add_argument("--arch", default="qwen3_moe", choices=ARCHITECTURES)


def run(args: argparse.Namespace) -> int:
    return run_demo(args.workdir, args.question, args.gpu_experts, args.arch)
