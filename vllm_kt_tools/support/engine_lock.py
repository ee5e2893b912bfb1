"""One engine start or stop at a time among the processes sharing a GPU.

vLLM 0.32 sizes its KV cache from how the GPU's free memory changes while it profiles, so
another process allocating meanwhile fails it ("No available memory for the cache
blocks"), and one freeing memory meanwhile too ("Error in memory profiling. Initial free
memory ..., current free memory ..."; both seen on the H200). Test processes and benchmark
runs that share a GPU on purpose name one lock file in ``VLLM_KT_ENGINE_LOCK``; each holds
it while its engine starts and while it stops, and runs beside the others in between.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOCK_VARIABLE = "VLLM_KT_ENGINE_LOCK"


@contextmanager
def engine_lock() -> Iterator[None]:
    """Hold the host-wide engine lock, if ``VLLM_KT_ENGINE_LOCK`` names one."""
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


def stop_engine(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine down (its GPU memory freed) while holding the lock."""
    from vllm_kt_tools.support.vllm_internals import shutdown_engine

    with engine_lock():
        shutdown_engine(llm)
