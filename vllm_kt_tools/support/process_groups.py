"""Every system the benchmark starts (``vllm serve``, sglang-kt's server, an engine child),
each in a process group of its own, and the whole group stopped when the system ends, fails,
or the benchmark itself is stopped.

Why: a sitting on 2026-12-06 stopped its bench with SIGTERM; the engine child's
``VLLM::EngineCore`` lived on with 72.7 GB of GPU memory and the next system started beside
it. Killing the child alone is not enough (its engine core, sglang-kt's scheduler are its
children), so a system gets a session of its own (``start_new_session``: its pid is its group
and session id) and is stopped by group: SIGTERM, a grace period, then SIGKILL to whatever
is left — processes that moved to another group of the same session included (found by
session id in /proc). ``install_handlers`` makes SIGTERM, SIGINT and interpreter exit do the
same for every group still running. A whole sitting is stopped by its tag
(``stop_sitting``), which every process it starts inherits.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

GRACE_S = 10.0  # between SIGTERM and SIGKILL
_live: dict[int, subprocess.Popen[Any]] = {}
_lock = threading.Lock()
_installed = False


def start(command: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **popen)`` as the leader of a new session (and process
    group), remembered until ``stop``."""
    proc: subprocess.Popen[Any] = subprocess.Popen(list(command), start_new_session=True, **popen)
    with _lock:
        _live[proc.pid] = proc
    return proc


def members(session: int) -> list[int]:
    """Live pids of a session, or of the process group of that id (zombies are not alive)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
        fields = text[text.rindex(")") + 2 :].split()
        state, group, sid = fields[0], int(fields[2]), int(fields[3])
        if state not in ("Z", "X") and session in (group, sid):
            found.append(int(stat.parent.name))
    return found


def _signal_all(session: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(session, sig)
    for pid in members(session):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop(proc: subprocess.Popen[Any], grace_s: float = GRACE_S, first: int = signal.SIGTERM) -> None:
    """Stop ``proc``'s whole session: ``first`` (SIGTERM), up to ``grace_s`` for every member
    to exit, then SIGKILL to those left; returns once none is left (the leader reaped)."""
    session = proc.pid
    if proc.poll() is None or members(session):
        _signal_all(session, first)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a member of its group for killpg
            if not members(session):
                break
            time.sleep(0.1)
        else:
            _signal_all(session, signal.SIGKILL)
    settle_s = max(grace_s, 5.0)  # SIGKILL is not instant either
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=settle_s)
    deadline = time.monotonic() + settle_s
    while members(session) and time.monotonic() < deadline:
        time.sleep(0.05)
    with _lock:
        _live.pop(proc.pid, None)


def stop_all(grace_s: float = GRACE_S) -> None:
    """``stop`` every group this process started and has not stopped yet."""
    with _lock:
        procs = list(_live.values())
    for proc in procs:
        stop(proc, grace_s)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    with _lock:
        count = len(_live)
    print(f"[bench] {name}: stopping {count} system(s) and their process groups", file=sys.stderr, flush=True)
    stop_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    """SIGTERM, SIGINT and interpreter exit stop every group still running (the bench's
    main thread only: signal handlers cannot be set elsewhere)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    atexit.register(stop_all)
    _installed = True


# A sitting exports a tag that every process it starts inherits, new sessions included: stopping
# by the tag's sessions finds an engine child early in its start, which the sitting's own session
# or a name pattern misses (benchmarks/sittings/stop.sh, 2026-12-06).
SITTING_VARIABLE = "VLLM_KT_SITTING"


def tagged(tag: str) -> list[int]:
    """Live pids whose environment carries ``VLLM_KT_SITTING=tag`` (this process excluded)."""
    marker = f"{SITTING_VARIABLE}={tag}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            if pid != os.getpid() and marker in environ.read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return [pid for pid in found if _session_of(pid) is not None]


def _session_of(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[3])


def stop_sitting(tag: str, settle_s: float = 30.0) -> list[int]:
    """Stop every process of the sitting ``tag``, and the rest of each session one of them is
    in: all of them stopped first (SIGSTOP: none can start another meanwhile), then killed,
    again until none is left. Returns the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        sessions = {sid for pid in tagged(tag) if (sid := _session_of(pid)) is not None}
        sessions.discard(os.getsid(0))  # never the caller's own session
        found = sorted({*tagged(tag), *(pid for sid in sessions for pid in members(sid))} - {os.getpid()})
        if not found:
            return killed
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in found:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        killed += found
        time.sleep(0.2)
    raise RuntimeError(f"processes of sitting {tag} still alive after {settle_s:.0f} s: {tagged(tag)}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Stop a whole sitting by its tag (benchmarks/sittings/stop.sh).")
    parser.add_argument("tag", help=f"the sitting's {SITTING_VARIABLE}")
    tag = parser.parse_args().tag
    killed = stop_sitting(tag)
    print(
        f"stop: sitting {tag}: {len(killed)} process(es) killed"
        + (f" ({' '.join(map(str, killed))})" if killed else "")
    )


if __name__ == "__main__":
    main()
