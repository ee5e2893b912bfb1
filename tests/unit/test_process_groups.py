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


# A sitting as head-to-head.sh runs one: a driver shell (its own session, tagged), a bench-like
# process starting a system in a session of its own whose child leaves its group, and an engine
# child still early in its start (it starts its engine core only after a while, in its own group).
SITTING = """
set -u
echo "$VLLM_KT_SITTING" > "$BENCH_OUT/sitting.tag"
python3 -c "$SYSTEM" "$BENCH_OUT/system" &
setsid python3 -c "$LATE" "$BENCH_OUT/late" &
sleep 600
"""
LATE_START = """
import os, subprocess, sys, time
open(sys.argv[1] + ".pid", "w").write(str(os.getpid()))
while not os.path.exists(sys.argv[1] + ".go"):  # still starting until the test says go
    time.sleep(0.1)
core = subprocess.Popen([sys.executable, "-c", "import os, time; os.setpgid(0, 0); time.sleep(600)"])
open(sys.argv[1] + ".core", "w").write(str(core.pid))
time.sleep(600)
"""


def test_stop_sh_stops_a_whole_sitting_and_nothing_else(tmp_path: Path) -> None:
    """benchmarks/sittings/stop.sh kills every process of the sitting (by the tag they inherit:
    the driver's session, a system's own session with a child that left its group, an engine
    child early in its start, which then starts nothing), and spares a shell whose command line
    names the sitting's script but that the sitting did not start."""
    script = tmp_path / "head-to-head.sh"
    script.write_text(SITTING)
    tag = f"test-{os.getpid()}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "BENCH_OUT": str(tmp_path),
        process_groups.SITTING_VARIABLE: tag,
        "SYSTEM": f"import sys; from vllm_kt_tools.support import process_groups\n"
        f"p = process_groups.start([sys.executable, '-c', {SPAWN!r}, sys.argv[1]]); p.wait()",
        "LATE": LATE_START,
    }
    bystander = subprocess.Popen(["bash", "-c", "sleep 600", str(script)], start_new_session=True)
    sitting = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)
    family: list[int] = []
    try:
        system_child, grandchild = map(int, wait_for(tmp_path / "system").split())
        late = int(wait_for(tmp_path / "late.pid"))
        family = [sitting.pid, system_child, grandchild, late]
        assert all(alive(pid) for pid in family)
        assert len({os.getsid(pid) for pid in family}) == 3  # the driver's, the system's, the engine child's
        assert process_groups.tagged(tag)
        stop = subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "sittings" / "stop.sh")],
            env={**os.environ, "BENCH_OUT": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0, stop.stderr
        assert f"stop: sitting {tag}:" in stop.stdout
        sitting.wait(timeout=10)
        # An engine child that escaped the stop would go on now and start its core: a go signal,
        # not a timer, so that a slow machine cannot let it start before the stop.
        (tmp_path / "late.go").touch()
        time.sleep(2)
        assert [pid for pid in family if alive(pid)] == [] and process_groups.tagged(tag) == []
        assert not (tmp_path / "late.core").exists()
        assert alive(bystander.pid)
    finally:
        process_groups.stop_sitting(tag)
        bystander.kill()
        bystander.wait()


def test_stop_sh_without_a_sitting_says_so(tmp_path: Path) -> None:
    stop = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "sittings" / "stop.sh")],
        env={**os.environ, "BENCH_OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.returncode == 1 and "no sitting started there" in stop.stderr
