"""``vllm serve`` in the background, for the demo and the end-to-end tests."""

from __future__ import annotations

import contextlib
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

from vllm_kt_tools.support import process_groups

SERVER_START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command() -> list[str]:
    """The ``vllm`` command of this environment: its console script, or vLLM's CLI module
    where no script was installed (e.g. ``pip install --target``)."""
    script = Path(sys.executable).with_name("vllm")
    found = str(script) if script.exists() else shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def activated_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) as in a shell where this Python's virtual
    environment is active (``source .venv/bin/activate``): its bin first on PATH."""
    env = dict(os.environ if env is None else env)
    venv_bin = Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(venv_bin), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv_bin.parent)
    return env


class VLLMServer:
    """``vllm serve MODEL ARGS`` in the background, ready when ``/health`` answers."""

    @classmethod
    def from_command_line(
        cls, line: str, port: int, env: dict[str, str], log_path: str | Path | None = None
    ) -> VLLMServer:
        """A command line exactly as a user would paste it (it listens on ``port``), run
        by bash in ``env`` alone: nothing is added, so the line must carry what it needs
        (e.g. VLLM_CPU_KVCACHE_SPACE on vLLM's CPU build)."""
        server = cls("", port=port, log_path=log_path)
        server.command = ["bash", "-c", line]
        server.env = dict(env)
        return server

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

    def launch(self) -> VLLMServer:
        """Start the server in a process group of its own (``process_groups``) and return at once."""
        log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the server's lifetime
        self.proc = process_groups.start(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def start(self, progress: Callable[[float], None] | None = None) -> VLLMServer:
        """Launch, then wait until ``/health`` answers."""
        self.launch()
        assert self.proc is not None
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return self
            elapsed = time.monotonic() - start
            if elapsed > SERVER_START_TIMEOUT_S:
                self.stop()
                raise TimeoutError(f"vllm serve not ready after {elapsed:.0f} s:\n{self.log_tail()}")
            if progress:
                progress(elapsed)
            time.sleep(1)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not started"
        return self.proc.pid

    def healthy(self) -> bool:
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
        """Ask the server to shut down (SIGINT, as Ctrl-C would), then stop its whole process
        group (SIGTERM, then SIGKILL): its engine core or scheduler must not outlive it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        process_groups.stop(self.proc)

    def kill(self) -> None:
        """SIGKILL to the server and every process it started (engine core included)."""
        if self.proc is None:
            return
        process_groups.stop(self.proc, grace_s=0.0, first=signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def process_tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (vLLM's API server, engine core
    and their helpers), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        child = int(status.parent.name)
        children.setdefault(int(fields["PPid"]), []).append(child)
        rss[child] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += rss.get(current, 0)
        todo.extend(children.get(current, []))
    return total
