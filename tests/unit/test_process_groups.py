"""No orphans (issue 37): every system the benchmark starts runs in a process group of its own,
and stopping the benchmark stops the whole group. Real processes here: a benchmark-like
driver starts a child the way the benchmark starts an engine (``run_child``), the child starts
a grandchild that moves to a process group of its own (as a server's worker might), and the
driver is stopped with SIGTERM, as the 2026-12-06 sitting stopped its bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vllm_kt_tools.support import process_groups
from vllm_kt_tools.support.server import VLLMServer

ROOT = Path(__file__).resolve().parents[2]

# writes its own pid, then starts a process that leaves its group (same session) and sleeps
SPAWN = """
import os, subprocess, sys, time
out = sys.argv[1]
leaver = "import os, sys, time; os.setpgid(0, 0); print(flush=True); time.sleep(600)"
grandchild = subprocess.Popen([sys.executable, "-c", leaver], stdout=subprocess.PIPE)
grandchild.stdout.readline()  # it has left the group
open(out, "w").write(f"{os.getpid()} {grandchild.pid}")
time.sleep(600)
"""

# the benchmark's way: handlers installed, one engine-like child through run_child
DRIVER = """
import sys
from vllm_kt_tools.support import process_groups
from vllm_kt_tools.support.child import run_child
process_groups.install_handlers()
command = {"args": [sys.executable, "-c", sys.argv[1], sys.argv[2]]}
run_child("subprocess:call", command, env=dict(__import__("os").environ), timeout_s=600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie left for an init that does not reap is not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_for(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.1)
    raise AssertionError(f"{path} was not written in {timeout_s} s")


def test_sigterm_to_the_bench_stops_its_systems_children(tmp_path: Path) -> None:
    """SIGTERM to the driver stops the engine child, the process it started and that one's
    child, though it left for a process group of its own; the driver exits 128 + 15."""
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, SPAWN, str(pids)], env=env, start_new_session=True, stderr=subprocess.PIPE
    )
    family: list[int] = []
    try:
        spawner, grandchild = map(int, wait_for(pids).split())
        engine_child = int(Path(f"/proc/{spawner}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        family = [engine_child, spawner, grandchild]
        assert all(alive(pid) for pid in family)
        assert os.getpgid(grandchild) == grandchild != os.getpgid(spawner)  # left the group, not the session
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
        assert driver.returncode == 128 + signal.SIGTERM, err
        assert b"SIGTERM: stopping 1 system(s)" in err
        assert [pid for pid in family if alive(pid)] == []
    finally:  # a failed run leaves nothing behind either
        for pid in [driver.pid, *family]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_stopped_server_takes_its_process_group_with_it(tmp_path: Path) -> None:
    """VLLMServer.stop (the benchmark's way out of every server) leaves no member of the
    server's group behind, though the server's leader exits at the first signal."""
    pids = tmp_path / "pids"
    line = f"{sys.executable} -c '{SPAWN}' {pids}"
    server = VLLMServer.from_command_line(line, port=1, env=dict(os.environ), log_path=tmp_path / "log")
    server.launch()
    spawner, grandchild = map(int, wait_for(pids).split())
    assert alive(spawner) and alive(grandchild)
    started = time.monotonic()
    server.stop()
    assert not alive(spawner) and not alive(grandchild)
    assert process_groups.members(server.pid) == []
    assert time.monotonic() - started < process_groups.GRACE_S + 70  # SIGINT's wait, then the group's


def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    """A member that ignores SIGTERM is SIGKILLed after the grace period."""
    ready = tmp_path / "ready"
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    code = f"{ignore}; open({str(ready)!r}, 'w').write('1'); time.sleep(600)"
    proc = process_groups.start([sys.executable, "-c", code])
    wait_for(ready)
    process_groups.stop(proc, grace_s=1.0)
    assert proc.returncode == -signal.SIGKILL and not alive(proc.pid)
