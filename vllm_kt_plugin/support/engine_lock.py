"""One engine start at a time among the processes sharing a GPU.

vLLM 0.32 sizes its KV cache from the GPU memory that grows while it profiles, counting
what other processes allocate meanwhile as its own ("No available memory for the cache
blocks" when two engines start together on one GPU). Test processes and benchmark runs
that share a GPU on purpose name one lock file in ``VLLM_KT_ENGINE_START_LOCK``; each
holds it while its engine starts, and runs beside the others once started.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

LOCK_VARIABLE = "VLLM_KT_ENGINE_START_LOCK"


@contextmanager
def engine_start_lock() -> Iterator[None]:
    """Hold the host-wide engine-start lock, if ``VLLM_KT_ENGINE_START_LOCK`` names one."""
    path = os.environ.get(LOCK_VARIABLE)
    if not path:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
