"""KT_VLLM_CORES: where vLLM's own threads in kt-kernel's process run.

kt-kernel 0.7.2 pins its worker threads (named ``numa_<node>_t_<i>``, and ``numa_<node>_m_<i>``)
to the first KT_CPUINFER cores of the process, and they spin while they wait. vLLM's threads in
that process (the engine's Python, the CUDA host-callback thread that runs kt-kernel's submit
and sync) may be scheduled onto those cores too. ``free`` moves every other thread of the
process to the cores kt-kernel leaves free; threads started later inherit their creator's.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.variables import KTSettings, process_cores

logger = logging.getLogger(LOGGER_NAME)

KT_THREAD_PREFIX = "numa_"  # kt-kernel's worker threads' names


def resolved_vllm_cores(settings: KTSettings) -> str:
    """``shared`` or ``free`` for ``auto``: shared until a sitting measures free against it."""
    return "shared" if settings.vllm_cores == "auto" else settings.vllm_cores


def _threads() -> list[tuple[int, str]]:
    """(thread id, name) of this process's threads."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        try:
            found.append((int(task.name), (task / "comm").read_text().strip()))
        except OSError:  # ended meanwhile
            continue
    return found


def kt_cores(threads: int) -> list[int]:
    """The cores kt-kernel's ``threads`` workers hold: the first of the process's cores, as
    kt-kernel pins them (its single-core workers are checked to lie within)."""
    held = set(process_cores()[:threads])
    pinned = set()
    for tid, name in _threads():
        if name.startswith(KT_THREAD_PREFIX):
            mask = os.sched_getaffinity(tid)
            if len(mask) == 1:
                pinned |= mask
    if not pinned <= held:  # another placement than kt-kernel 0.7.2's: keep off every core it took
        held |= pinned
    return sorted(held)


@functools.cache
def keep_vllm_off_kt_cores(threads: int) -> tuple[int, ...] | None:
    """Move every thread of this process but kt-kernel's to the cores its ``threads`` workers
    leave free, once per process (kt-kernel starts its workers once); returns those cores, or
    None where none is left (said in the log)."""
    taken = set(kt_cores(threads))
    free = tuple(core for core in process_cores() if core not in taken)
    if not free:
        logger.warning(
            "kt-hybrid: KT_VLLM_CORES=free: kt-kernel's %d threads hold every core of this process; vLLM's threads "
            "stay where they are",
            threads,
        )
        return None
    for tid, name in _threads():
        if not name.startswith(KT_THREAD_PREFIX):
            try:
                os.sched_setaffinity(tid, free)
            except OSError:  # ended meanwhile
                continue
    logger.info("kt-hybrid: KT_VLLM_CORES=free: vLLM's threads in this process run on cores %s", list(free))
    return free
