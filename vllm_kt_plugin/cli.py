"""``vllm-kt``: the demo (a tiny generated MoE model served by ``vllm serve --quantization
kt-hybrid``, asked one chat question) and the tiny-model generator."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

DEFAULT_WORKDIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-kt-plugin"
SERVER_START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command() -> list[str]:
    """The ``vllm`` console script of this environment."""
    script = Path(sys.executable).with_name("vllm")
    found = str(script) if script.exists() else shutil.which("vllm")
    if not found:
        raise SystemExit("`vllm` is not installed in this environment; run scripts/setup.sh")
    return [found]


class VLLMServer:
    """``vllm serve MODEL ARGS`` in the background, ready when ``/health`` answers."""

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [*vllm_command(), "serve", str(model), "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # needed by vLLM's CPU engine on small hosts
        self.log_path = Path(log_path) if log_path else Path(os.devnull)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, progress: Callable[[float], None] | None = None) -> VLLMServer:
        log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the server's lifetime
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return self
            elapsed = time.monotonic() - start
            if elapsed > SERVER_START_TIMEOUT_S:
                self.stop()
                raise TimeoutError(f"vllm serve not ready after {elapsed:.0f} s:\n{self.log_tail()}")
            if progress:
                progress(elapsed)
            time.sleep(1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


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
    from vllm_kt_plugin.tiny_models import tiny_model_dir

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
        from openai import OpenAI

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-kt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a tiny generated MoE with kt-hybrid and ask it one chat question")
    demo.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="where the tiny model and the log go")
    demo.add_argument("--question", default="What is the capital of France?")
    demo.add_argument("--gpu-experts", type=int, default=4, help="experts per layer kept on the GPU (of 8)")
    demo.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "deepseek_v3"])
    tiny = sub.add_parser("make-tiny-model", help="write a tiny trained MoE checkpoint (no download)")
    tiny.add_argument("arch", choices=["qwen3_moe", "mixtral", "deepseek_v3"])
    tiny.add_argument("out", type=Path)
    sub.add_parser(
        "bench",
        help="kt-hybrid vs plain vLLM vs --cpu-offload-gb on one GPU (see `vllm-kt bench --help`)",
        add_help=False,
    )
    sub.add_parser(
        "profile", help="record per-layer expert activation counts for KT_EXPERT_PLACEMENT=frequency", add_help=False
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:
        from vllm_kt_plugin.routing_profiler import main as profile_main

        return profile_main(argv[1:])
    if argv[:1] == ["bench"]:  # its own parser, shared with `python -m vllm_kt_plugin.benchmark`
        from vllm_kt_plugin.benchmark import main as bench_main

        return bench_main(argv[1:])
    doctor = sub.add_parser("doctor", help="check this machine and the KT_* settings (OK / WARN / ERROR per check)")
    doctor.add_argument("--model", help="model directory; its config.json sizes the CPU experts for the RAM check")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from vllm_kt_plugin.doctor import doctor as run_doctor

        return run_doctor(args.model)
    if args.command == "demo":
        return run_demo(args.workdir, args.question, args.gpu_experts, args.arch)
    from vllm_kt_plugin.tiny_models import write_tiny_model

    print(write_tiny_model(args.arch, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
