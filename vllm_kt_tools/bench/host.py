"""What a sitting ran on (``host`` in every result JSON): CPU model, usable cores,
kt-kernel's loaded variant, the project's commit and versions, so that figures of
different hosts are never read as one."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from vllm_kt_plugin.source_checkout import checkout_root
from vllm_kt_tools.support.gpu_memory import gpu_facts


def _recorded(name: str) -> bool:
    """Whether a VLLM_* variable goes into the committed JSON: not ours (VLLM_KT_*), not
    set per run (VLLM_PLUGINS), no secret (VLLM_API_KEY and the like)."""
    secret = any(word in name for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))
    return not name.startswith("VLLM_KT_") and name != "VLLM_PLUGINS" and not secret


COMMIT_VARIABLE = "VLLM_KT_COMMIT"  # the sitting's commit, where the tree travels without .git


def project_commit() -> str | None:
    """The project's commit: VLLM_KT_COMMIT (the lead sets it: the GPU host gets a copy of the
    working tree, maybe without .git), else git's, with "-dirty" for uncommitted changes."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    import subprocess

    root = checkout_root()
    if root is None:  # an installed wheel: no git tree to ask
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def host_info(kt_threads: int | None = None) -> dict[str, Any]:
    """What a sitting ran on, so that figures of different hosts are never read as one:
    CPU model, usable cores, kt-kernel's loaded variant, the project's commit, versions, the
    GPU (from nvidia-smi: the benchmark process opens no CUDA context, ``support.gpu_memory``)
    and, given kt-kernel's thread count, the memory read bandwidth with that many threads."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "commit": project_commit(),
    }
    # vLLM settings given by environment to every system (e.g. VLLM_DEEP_GEMM_WARMUP)
    vllm_env = {name: value for name, value in os.environ.items() if name.startswith("VLLM_") and _recorded(name)}
    if vllm_env:
        info["vllm_env"] = dict(sorted(vllm_env.items()))
    try:
        import torch

        info["torch"] = torch.__version__
        info.update(gpu_facts())
        import vllm

        info["vllm"] = vllm.__version__
        from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel  # imports torch: inside the try
        from vllm_kt_tools.support.vllm_internals import cpu_has_amx_tiles

        kt_kernel = prepare_kt_kernel()
        info["kt_kernel"] = getattr(kt_kernel, "__version__", "unknown")
        info["kt_cpu_variant"] = kt_kernel.__cpu_variant__
        info["cpu_has_amx"] = cpu_has_amx_tiles()
    except Exception as exc:  # the benchmark still runs; the JSON says what is unknown
        info["probe_error"] = repr(exc)
    if kt_threads:
        from vllm_kt_tools.bench.memory_bandwidth import read_bandwidth

        info["memory_bandwidth"] = read_bandwidth(kt_threads)
    return info
