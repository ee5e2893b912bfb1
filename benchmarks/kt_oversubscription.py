"""How kt-kernel's CPU experts react to one more busy thread than the cores hold.

One tiny kt-kernel layer, timed per ``submit_forward`` + ``sync_forward`` (the plugin's per-layer
call pair) alone and beside ``--busy`` processes that spin: a stand-in for vLLM's own threads
(engine loop, CUDA syncs and callbacks) on the cores kt-kernel's workers share. Every decode
step waits for one such pair per MoE layer, so the tail, not the median, sets its pace.

    python benchmarks/kt_oversubscription.py --threads 1 --busy 1   # on a 2-core machine
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import ExpertTensors

EXPERTS, HIDDEN, WIDTH, TOKENS = 8, 256, 128, 4


def layer(method: str, threads: int, workdir: str):  # noqa: ANN201 - kt-kernel's wrapper
    kt_kernel = prepare_kt_kernel()
    tensors = ExpertTensors(EXPERTS, HIDDEN, WIDTH)
    tensors.fill_dummy(0)
    wrapper = kt_kernel.KTMoEWrapper(
        layer_idx=0,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        hidden_size=HIDDEN,
        moe_intermediate_size=WIDTH,
        gpu_experts_mask=torch.zeros(EXPERTS, dtype=torch.bool),
        cpuinfer_threads=threads,
        threadpool_count=1,
        weight_path=workdir,
        chunked_prefill_size=64,
        method=method,
    )
    wrapper.load_weights_from_tensors(tensors.gate, tensors.up, tensors.down, torch.arange(EXPERTS))
    return wrapper


def timings(wrapper, calls: int) -> dict[str, float]:  # noqa: ANN001 - kt-kernel's wrapper
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    ids = torch.tensor([[2 * t % EXPERTS, (2 * t + 1) % EXPERTS] for t in range(TOKENS)])
    weights = torch.full((TOKENS, 2), 0.5)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        wrapper.submit_forward(x, ids, weights, 0)
        wrapper.sync_forward(x, 0)
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    return {
        "median_us": round(seconds[len(seconds) // 2] * 1e6, 1),
        "p95_us": round(seconds[int(len(seconds) * 0.95)] * 1e6, 1),
        "over_1ms": round(sum(s > 1e-3 for s in seconds) / len(seconds), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="kt-kernel's cpuinfer_threads")
    parser.add_argument("--busy", type=int, default=1, help="spinning processes beside it")
    parser.add_argument("--method", default="AMXINT8", help="a kt-kernel method that quantizes BF16 online")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--workdir", default="/tmp/kt-oversubscription")
    args = parser.parse_args()
    wrapper = layer(args.method, args.threads, f"{args.workdir}-{args.method}-{args.threads}")
    result = {"threads": args.threads, "alone": timings(wrapper, args.calls)}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        time.sleep(0.5)
        result[f"beside {args.busy} busy"] = timings(wrapper, args.calls)
    finally:
        for spinner in spinners:
            spinner.kill()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
