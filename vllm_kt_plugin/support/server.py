"""``vllm serve`` in the background, for the demo and the end-to-end tests."""

from __future__ import annotations

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
