"""The host's memory read bandwidth, measured with kt-kernel's thread count, and the decode
limit it implies: a decode step cannot be faster than reading the CPU experts it computes.

Why: the kernel sweep's per-layer time was read as a bound ("decode_bound_tok_s") until the
2026-12-06 sitting's engine medians exceeded it (52.9 > 44.8 tok/s): bare kt-kernel in a
loop is a figure of its own (``kernel_alone_tok_s``), not a limit. A limit needs a cost no
schedule can avoid: the bytes of the distinct CPU experts one step reads, over the host's
bandwidth. It is loose where kt-kernel is bound by something else (batch 1's threads wait on
each other more than on memory), but no engine may exceed it.

Bytes per step: every MoE layer reads each distinct CPU expert the step's tokens picked once,
in the method's format (``expert_bytes``). With uniform routing (dummy weights, sampled
decoding: ``bench/routing.py``) a batch of n independent tokens picks
``E_cpu * (1 - (1 - k/E)^n)`` distinct CPU experts per layer: k·E_cpu/E at batch 1 (5.9 of
the 8 picks with 95 of 128 experts on the CPU), about 61.2 at batch 16.

The measurement: multi-threaded sums (torch, ``threads`` intra-op threads) over a buffer far
larger than the last-level cache (the H100 host's L3 is 300 MiB), the best of a few passes.
"""

from __future__ import annotations

import math
import time
from typing import Any

from vllm_kt_plugin.cpu_backends.kt_kernel.weight_paths import part_bytes
from vllm_kt_tools.bench.routing import expected_distinct

BUFFER_BYTES = 2 << 30  # about seven times the largest L3 seen on a lent host (300 MiB)
REPEATS = 5
DECODE_BATCHES = (1, 16)  # as the engine runs measure decode
FP8_BLOCK = 128  # the block-FP8 checkpoint's 128 x 128 weight blocks, one fp32 scale each


def read_bandwidth(threads: int, buffer_bytes: int = BUFFER_BYTES, repeats: int = REPEATS) -> dict[str, Any]:
    """GB/s (10^9 bytes) of ``threads`` threads summing a ``buffer_bytes`` float32 buffer,
    the best of ``repeats`` passes after one warm-up (the buffer is written first, so every
    page is backed before the timing)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        buffer.sum()
        passes = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            passes.append(time.perf_counter() - start)
        del buffer
    finally:
        torch.set_num_threads(previous)
    return {
        "read_gb_s": round(buffer_bytes / min(passes) / 1e9, 1),
        "passes_gb_s": [round(buffer_bytes / s / 1e9, 1) for s in passes],
        "threads": threads,
        "buffer_gib": round(buffer_bytes / 2**30, 2),
        "seconds": round(time.perf_counter() - started, 2),
        "how": "torch float32 sum, best pass",
    }


def expert_bytes(method: str, hidden: int, inter: int) -> int | None:
    """Bytes of one expert (gate, up: inter x hidden; down: hidden x inter) in kt-kernel's
    format for ``method``; None for a format this does not know. AMXINT4/AMXINT8 keep one
    fp32 scale per output row (kt-kernel's ``*_scale_.kt`` files: 512 bytes for 128 rows of
    a 128 x 128 matrix whose INT4 ``*_quant_.kt`` holds 8,192), FP8 one per 128 x 128 block."""
    params = 3 * hidden * inter
    if method in ("AMXINT4", "AMXINT8"):
        return sum(part_bytes(method, hidden, inter, pools=1).values())
    if method == "BF16":
        return 2 * params
    if method == "FP8":
        return params + 4 * 3 * math.ceil(hidden / FP8_BLOCK) * math.ceil(inter / FP8_BLOCK)
    return None


def decode_limit(
    read_gb_s: float, method: str, hidden: int, inter: int, layers: int, experts: int, top_k: int, gpu_experts: int
) -> dict[str, Any] | None:
    """Tokens per second no decode at batch 1 and 16 can exceed on this host: the batch over
    the time to read one step's distinct CPU experts at ``read_gb_s``; None for a format this
    does not know or a placement with every expert on the GPU."""
    per_expert = expert_bytes(method, hidden, inter)
    cpu_experts = experts - gpu_experts
    if per_expert is None or read_gb_s <= 0 or cpu_experts <= 0:  # no CPU expert: nothing read from host memory
        return None
    limit: dict[str, Any] = {
        "method": method,
        "read_gb_s": read_gb_s,
        "expert_bytes": per_expert,
        "cpu_experts_per_layer": cpu_experts,
        "layers": layers,
    }
    for batch in DECODE_BATCHES:
        distinct = expected_distinct(experts, top_k, batch) * cpu_experts / experts
        step_bytes = layers * distinct * per_expert
        limit[f"bs{batch}"] = {
            "distinct_cpu_experts_per_layer": round(distinct, 2),
            "bytes_per_step": int(step_bytes),
            "tok_s": round(batch * read_gb_s * 1e9 / step_bytes, 1),
        }
    return limit
