"""KT_VLLM_CORES=free in a process of its own (it moves the threads of the process it runs in):
real kt-kernel workers, a thread of vLLM's kind started before and one after."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


def affinities() -> dict[str, list[int]]:
    found = {}
    for task in Path("/proc/self/task").iterdir():
        name = (task / "comm").read_text().strip()
        found[f"{name}/{task.name}"] = sorted(os.sched_getaffinity(int(task.name)))
    return found


def pin_beside_kt_kernel(workdir: str, threads: int) -> dict[str, Any]:
    import torch

    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
    from vllm_kt_plugin.cpu_backends.kt_kernel.cores import keep_vllm_off_kt_cores
    from vllm_kt_tools.support.quantized_checkpoints import write_dummy_experts

    kt_kernel = prepare_kt_kernel()
    e, h, i = 8, 256, 256
    path = write_dummy_experts(Path(workdir), "BF16", [0], e, h, i)
    wrapper = kt_kernel.KTMoEWrapper(
        layer_idx=0,
        num_experts=e,
        num_experts_per_tok=2,
        hidden_size=h,
        moe_intermediate_size=i,
        gpu_experts_mask=torch.zeros(e, dtype=torch.bool),
        cpuinfer_threads=threads,
        threadpool_count=1,
        weight_path=str(path),
        chunked_prefill_size=16,
        method="BF16",
    )
    wrapper.load_weights(torch.arange(e))
    stop = threading.Event()
    before = threading.Thread(target=stop.wait, name="before")
    before.start()
    free = keep_vllm_off_kt_cores(threads)
    after = threading.Thread(target=stop.wait, name="after")
    after.start()
    x = torch.randn(1, h).to(torch.bfloat16)
    wrapper.submit_forward(x, torch.tensor([[1, 5]]), torch.tensor([[0.5, 0.5]]), 0)
    out = wrapper.sync_forward(x, 0)
    seen = affinities()
    started = {name: sorted(os.sched_getaffinity(t.native_id)) for name, t in (("before", before), ("after", after))}
    stop.set()
    return {
        "free": list(free) if free else None,
        "threads": seen,
        "started": started,
        "finite": bool(torch.isfinite(out).all()),
    }
