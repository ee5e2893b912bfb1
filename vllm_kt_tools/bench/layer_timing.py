"""The layer side of ``vllm-kt bench``: one kt-hybrid MoE layer of the model's shape on
CUDA, timed against bare kt-kernel (same wrapper, same tokens) and the GPU experts alone:
``plugin_overhead`` = hybrid / bare kt-kernel - 1, ``overlap_efficiency`` = hybrid /
max(bare kt-kernel, GPU experts).

For staging (KT_STAGING_MIN_TOKENS) it times, at prefill sizes, the layer's CPU path
against its whole-layer path: the copy of its CPU experts into the staging buffer and
their compute there. With the next layer's copy overlapping this layer's compute, a layer
costs about max(copy, compute); ``gpu_prefill_break_even_tokens`` (the results' key since
the first sitting) is the smallest size timed where that beats the CPU path."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench.shapes import ModelSizes, model_sizes
from vllm_kt_tools.support.child import run_child
from vllm_kt_tools.support.moe_layers import build_moe, vllm_world


def layer_benchmark(
    model_dir: str, env: dict[str, str], tokens: Sequence[int], iters: int, prefill_tokens: Sequence[int] = ()
) -> dict[str, Any]:
    """Times one kt-hybrid layer of the model's shape on CUDA (runs in the child process)."""
    # Deferred: `vllm-kt bench` imports this module in its parent process, which needs
    # neither torch nor vLLM; only the child process runs this function.
    import torch
    from vllm.config import ModelConfig, VllmConfig

    from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
    from vllm_kt_plugin.hybrid.staging.build import staging_path
    from vllm_kt_plugin.settings.loader import load_settings
    from vllm_kt_tools.support.vllm_internals import forward_context, init_workspace, routed_experts

    sizes = model_sizes(json.loads((Path(model_dir) / "config.json").read_text()))
    vllm_config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True))
    vllm_config.load_config.load_format = "dummy"
    results: dict[str, Any] = {"tokens": {}}
    with vllm_world(vllm_config, backend="nccl"):
        init_workspace(torch.device("cuda"))  # the modular MoE kernels' scratch buffers
        quant = KTHybridConfig(settings=load_settings({**os.environ, **env}))
        with torch.device("cuda"):
            runner = build_moe(quant, sizes.num_experts, sizes.top_k, sizes.hidden, sizes.expert_inter, layer_idx=0)
        layer = routed_experts(runner)
        method = layer.quant_method
        for param in layer.parameters():
            param.data.uniform_(-1e-3, 1e-3)
        method.process_weights_after_loading(layer)  # dummy CPU experts, quantized online
        cpu = method.cpu
        assert cpu is not None, "the layer benchmark needs CPU experts (KT_NUM_GPU_EXPERTS < experts)"

        def time_ms(fn: Any, repeats: int = iters) -> float:
            for _ in range(min(10, repeats)):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / repeats

        gen = torch.Generator(device="cuda").manual_seed(0)
        whole = staging_path(method.paths)  # the whole-layer path, None where staging is off
        prefill_from = whole.min_tokens if whole is not None else 0
        if whole is not None:
            whole.min_tokens = 2**31  # the decode timings take the CPU path
        with forward_context(vllm_config):
            results["tokens"] = {str(n): _time_layer(method, layer, cpu, n, sizes, gen, time_ms) for n in tokens}
            if whole is not None:
                whole.min_tokens = prefill_from
            if prefill_tokens and whole is not None and whole.host is not None:
                prefill = {str(n): _time_prefill(method, whole, layer, n, sizes, gen, time_ms) for n in prefill_tokens}
                results["gpu_prefill_staged_gib_per_layer"] = round(whole.host.staged_nbytes / 2**30, 3)
                results["gpu_prefill_written_by_cpu_backend"] = not whole.host.copies  # copy_ms includes it
                results["gpu_prefill"] = prefill
                results["gpu_prefill_break_even_tokens"] = next(
                    (int(n) for n, t in prefill.items() if t["pipelined_ms"] < t["cpu_path_ms"]), None
                )
        if method.dynamic is not None:
            _time_swap(method.dynamic, layer, 1)  # warm-up: the first refresh builds vLLM's shadow layer code
            results["dynamic_swap_ms"] = {str(k): _time_swap(method.dynamic, layer, k) for k in (1, 8)}
    results["gpu_experts_per_layer"] = method.placement.num_gpu_experts
    return results


def _time_swap(dynamic: Any, layer: Any, k: int) -> float:
    """Milliseconds for one refresh of this layer that moves ``k`` experts each way."""
    import time

    import torch

    cpu_experts = torch.nonzero(~dynamic.placement.gpu_mask).flatten()[:k]
    dynamic.counts.zero_()
    dynamic.counts[cpu_experts.to(dynamic.counts.device)] = 1.0  # these outrank every GPU expert
    before = dynamic.swapped
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(dynamic.every):  # one of these calls refreshes
        dynamic.maybe_refresh(layer)
    torch.cuda.synchronize()
    elapsed_ms = (time.perf_counter() - started) * 1e3
    if dynamic.swapped - before != k:
        raise RuntimeError(f"a refresh meant to move {k} experts moved {dynamic.swapped - before}")
    return round(elapsed_ms, 2)


def _routing(n: int, sizes: ModelSizes, gen: Any) -> tuple[Any, Any, Any]:
    import torch

    x = (torch.randn(n, sizes.hidden, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    ids, weights = random_routing(n, sizes.num_experts, sizes.top_k, gen, torch.device("cuda"))
    return x, weights, ids


def random_routing(n: int, num_experts: int, top_k: int, gen: Any, device: Any) -> tuple[Any, Any]:
    """Top-k expert ids (int32, as vLLM's router gives them) and weights of ``n`` tokens,
    drawn near-uniformly as dummy weights route."""
    import torch

    logits = torch.randn(n, num_experts, device=device, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return ids.to(torch.int32), weights


def _time_prefill(method: Any, path: Any, layer: Any, n: int, sizes: ModelSizes, gen: Any, time_ms: Any) -> dict:
    """CPU path vs whole-layer ``path`` (copy, compute) of one layer for ``n`` tokens."""
    x, weights, ids = _routing(n, sizes, gen)
    staging, host = path.buffers, path.host
    threshold = path.min_tokens
    repeats = 5

    def forward() -> Any:  # its path set by the threshold; on the GPU, the weights already staged
        return method.forward_hybrid(x, weights, ids, layer)

    def copy() -> None:  # on the copy stream; acquire makes the timed stream wait for it
        staging.forget(staging.last)  # else the buffer holds the layer already and nothing is copied
        staging.copy_in(staging.last, host)
        index, _ = staging.acquire(host)
        staging.release(index)

    path.min_tokens = n + 1
    cpu_ms = time_ms(forward, repeats)
    path.min_tokens = n
    gpu_ms = time_ms(forward, repeats)
    copy_ms = time_ms(copy, repeats)
    path.min_tokens = threshold
    return {
        "cpu_path_ms": round(cpu_ms, 3),
        "gpu_compute_ms": round(gpu_ms, 3),
        "copy_ms": round(copy_ms, 3),
        "copy_gb_s": round(host.staged_nbytes / copy_ms / 1e6, 1),
        "pipelined_ms": round(max(copy_ms, gpu_ms), 3),
        "serial_ms": round(copy_ms + gpu_ms, 3),
    }


def _time_layer(method: Any, layer: Any, cpu: Any, n: int, sizes: ModelSizes, gen: Any, time_ms: Any) -> dict:
    """hybrid / bare kt-kernel / GPU-experts-only times of one layer for ``n`` tokens."""
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    x, weights, ids = _routing(n, sizes, gen)

    def hybrid() -> Any:
        return method.forward_hybrid(x, weights, ids, layer)

    def bare_kt_kernel() -> Any:  # the same kt-kernel wrapper, called directly
        cpu.wrapper.submit_forward(x, ids, weights, stream)
        return cpu.wrapper.sync_forward(x, stream)

    def gpu_experts() -> Any:
        return method.gpu.apply(layer, x, weights, ids)

    t = {
        "hybrid_ms": time_ms(hybrid),
        "bare_kt_kernel_ms": time_ms(bare_kt_kernel),
        "gpu_experts_ms": time_ms(gpu_experts),
    }
    result: dict[str, Any] = {k: round(v, 4) for k, v in t.items()}
    result["cpu_expert_picks"] = int((~method.placement.gpu_mask.to("cuda")[ids.long()]).sum())
    result["plugin_overhead"] = round(t["hybrid_ms"] / t["bare_kt_kernel_ms"] - 1, 4)
    result["overlap_efficiency"] = round(t["hybrid_ms"] / max(t["bare_kt_kernel_ms"], t["gpu_experts_ms"]), 4)
    return result


PREFILL_TOKENS = [256, 512, 1024, 2048, 4096, 8192]


def layer_in_child(model_dir: str, env: dict[str, str], log_dir: Path, timeout_s: int) -> dict[str, Any]:
    log_path = log_dir / f"layer-{env.get('KT_METHOD', '').lower()}.log"
    print(f"[bench] layer benchmark ({env.get('KT_METHOD')}): starting (log: {log_path})", flush=True)
    # Staging on from one token, so the layer builds its host copy; each timing below
    # picks its path by setting the threshold itself.
    # With dynamic experts (which exclude staging, and swap at every forward here) it
    # times the layer's swaps alone.
    dynamic = env.get("KT_DYNAMIC_GPU_EXPERTS", "0") not in ("", "0")
    prefill_from = "0" if dynamic else "1"
    env = {**env, "KT_STAGING_MIN_TOKENS": prefill_from, "KT_CHUNKED_PREFILL_SIZE": str(max(PREFILL_TOKENS))}
    tokens = [] if dynamic else [1, 16]
    args = {"model_dir": model_dir, "env": env, "tokens": tokens, "iters": 200, "prefill_tokens": PREFILL_TOKENS}
    return timing_in_child("layer benchmark", f"{__name__}:layer_benchmark", args, env, log_path, timeout_s)


def timing_in_child(
    label: str, target: str, args: dict[str, Any], env: dict[str, str], log_path: Path, timeout_s: int
) -> dict[str, Any]:
    """``target`` in a fresh process (its kt-kernel threads, memory and CUDA context go with
    it): its result, or ``{"error": <the log's tail>}``, said on stdout either way."""
    run = run_child(target, args, env={**os.environ, **env}, timeout_s=timeout_s, log_path=log_path)
    if run.result is not None:
        print(f"[bench] {label}: {json.dumps(run.result['tokens'])}", flush=True)
        return dict(run.result)
    tail = " | ".join(run.tail(5).splitlines())
    print(f"[bench] {label} FAILED: {tail[-600:]}", flush=True)
    return {"error": tail[-1500:]}
