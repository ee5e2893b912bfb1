"""Has the GPU's memory come back? Asked before the benchmark starts each system, so that no
figure is measured beside the leftovers of the system before (2026-12-06: an orphaned
``VLLM::EngineCore`` held 72.7 GB while the next system started).

The benchmark process itself never opens a CUDA context (its GPU facts come from
``nvidia-smi`` too), so a free GPU has little memory in use (an idle H100 or H200 reads
0-600 MiB). Where more stays in use after a wait, the benchmark stops with one line naming the
process that holds the most; it kills nothing it did not start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass

QUERY_GPUS = ("--query-gpu=index,name,memory.used,memory.total", "--format=csv,noheader,nounits")
QUERY_APPS = ("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")
# Above this, the GPU is not back: an idle H100 or H200 reads 0-600 MiB, a leftover engine
# tens of GB (72.7 GB on 2026-12-06), a stray CUDA context ~500 MiB.
IDLE_MIB = 2048
WAIT_S = 60.0  # a process that just ended frees its memory within seconds


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    used_mib: int
    total_mib: int


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_mib: int | None  # nvidia-smi says [N/A] where it may not tell (containers)


def _mib(text: str) -> int | None:
    text = text.strip()
    return int(float(text)) if text and text[0].isdigit() else None


def parse_gpus(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.strip().splitlines():
        if not line.strip():
            continue
        index, rest = line.split(",", 1)
        name, used, total = rest.rsplit(",", 2)
        gpus.append(Gpu(int(index), name.strip(), _mib(used) or 0, _mib(total) or 0))
    return gpus


def parse_processes(text: str) -> list[GpuProcess]:
    """``nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits``
    (a process name may hold commas: the pid is the first field, the memory the last)."""
    processes = []
    for line in text.strip().splitlines():
        if not line.strip() or "No running" in line:
            continue
        pid, rest = line.split(",", 1)
        name, used = rest.rsplit(",", 1)
        processes.append(GpuProcess(int(pid), name.strip(), _mib(used)))
    return processes


def not_free(gpus: list[Gpu], processes: list[GpuProcess], own_pid: int, idle_mib: int = IDLE_MIB) -> str | None:
    """Why the GPUs have not come back, in one line naming the process that holds the most
    memory; None where every GPU is at most ``idle_mib`` in use. Memory decides, not the
    process list: a container may see no pid, or pids of another namespace, and a stray CUDA
    context (~500 MiB) is no leftover system."""
    if all(gpu.used_mib <= idle_mib for gpu in gpus):
        return None
    used = ", ".join(f"GPU {gpu.index} {gpu.used_mib:,} of {gpu.total_mib:,} MiB in use" for gpu in gpus)
    if not processes:
        return f"{used} (idle is at most {idle_mib:,} MiB), by no process nvidia-smi lists"
    top = max(processes, key=lambda p: p.used_mib or 0)
    memory = f"{top.used_mib:,} MiB" if top.used_mib is not None else "memory nvidia-smi does not report"
    whose = " (this benchmark's own process: a CUDA context here)" if top.pid == own_pid else ""
    others = f" and {len(processes) - 1} more process(es)" if len(processes) > 1 else ""
    return f"{used}: pid {top.pid} {top.name} holds {memory}{whose}{others}"


def query() -> tuple[list[Gpu], list[GpuProcess]] | None:
    """The GPUs and their compute processes, from ``nvidia-smi``; None without one (a CPU host)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    gpus = subprocess.run([smi, *QUERY_GPUS], capture_output=True, text=True, timeout=30, check=True).stdout
    apps = subprocess.run([smi, *QUERY_APPS], capture_output=True, text=True, timeout=30, check=True).stdout
    return parse_gpus(gpus), parse_processes(apps)


def gpu_facts() -> dict[str, object]:
    """The first GPU's name and memory for the host record, without a CUDA context."""
    found = query()
    if not found or not found[0]:
        return {}
    gpu = found[0][0]
    return {"gpu": gpu.name, "gpu_memory_gb": round(gpu.total_mib / 1024, 1), "gpus": len(found[0])}


def wait_until_free(before: str, wait_s: float = WAIT_S, idle_mib: int = IDLE_MIB) -> None:
    """Return once the GPUs are free (at once on a host without nvidia-smi); after ``wait_s``
    stop the benchmark with one line saying what holds them."""
    deadline = time.monotonic() + wait_s
    while True:
        found = query()
        if found is None:
            return
        why = not_free(*found, own_pid=os.getpid(), idle_mib=idle_mib)
        if why is None:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"[bench] GPU memory not back before {before} after {wait_s:.0f} s: {why}")
        time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_kt_tools.support.gpu_memory [--wait S]``: a sitting's check between
    stages; prints "free" or the one line, exit 0 or 1."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the memory to come back")
    args = parser.parse_args(argv)
    try:
        wait_until_free("the next stage", wait_s=args.wait)
    except SystemExit as stop:
        print(stop.code, flush=True)
        return 1
    print("free", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
