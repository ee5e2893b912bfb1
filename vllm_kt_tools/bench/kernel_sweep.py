"""``vllm-kt bench --kernel-sweep``: bare kt-kernel decode through every MoE layer of the
shape, as the engine meets it — each layer its own CPU experts, fresh routing at every
step — against one layer called again and again with the same routing, as the layer
benchmark times it. The first is the kernel's speed for the whole model (weights streamed
from DRAM); the second what caches give it. An engine's CPU-expert time per layer
(``layer_metrics``) is to be read against the first: the gap between them is the plugin's
and vLLM's, the gap between the two sweeps is memory's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench.layer_timing import random_routing, timing_in_child
from vllm_kt_tools.bench.report import KERNEL_ALONE_KEY
from vllm_kt_tools.bench.shapes import model_sizes

SWEEP_TOKENS = (1, 16)  # decode at batch 1 and 16, as the engine runs measure it
SWEEP_STEPS = 20


def kernel_sweep(
    model_dir: str, load_format: str, env: dict[str, str], tokens: list[int], steps: int
) -> dict[str, Any]:
    """Times bare kt-kernel over all MoE layers (runs in the child process; CUDA tensors and
    stream where there is a GPU, kt-kernel's synchronous path where not)."""
    import torch

    from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts
    from vllm_kt_plugin.planning.placement import ExpertPlacement
    from vllm_kt_plugin.settings.loader import load_settings
    from vllm_kt_tools.bench.prepare import layer_spec

    settings = load_settings({**os.environ, **env})
    if settings.gpu_experts_auto:  # resolved from an engine's GPU memory, which the sweep has none of
        raise ValueError("--kernel-sweep needs a number of GPU experts (KT_NUM_GPU_EXPERTS), not auto")
    sizes = model_sizes(json.loads((Path(model_dir) / "config.json").read_text()))
    placement = ExpertPlacement.first_n(sizes.num_experts, settings.num_gpu_experts)
    started = time.perf_counter()
    layers = []
    for layer_idx in sizes.memory.moe_layers:
        spec = layer_spec(model_dir, load_format, sizes, layer_idx, placement, settings.chunked_prefill_size or 1024)
        experts = KTKernelExperts(spec, settings)
        experts.finalize_weights(0)
        layers.append(experts)
    print(f"[sweep] {len(layers)} layers loaded in {time.perf_counter() - started:.1f} s", flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    results: dict[str, Any] = {
        "layers": len(layers),
        "cpu_experts_per_layer": placement.num_cpu_experts,
        "threads": settings.cpuinfer_threads,
        "tokens": {},
    }
    for n in tokens:
        x = (torch.randn(n, sizes.hidden, device=device, generator=gen) * 0.1).to(torch.bfloat16)
        routes = [random_routing(n, sizes.num_experts, sizes.top_k, gen, device) for _ in range(steps * len(layers))]
        sweep = [list(zip(layers, routes[s * len(layers) : (s + 1) * len(layers)], strict=True)) for s in range(steps)]
        same = [[(layers[0], routes[0])] * len(layers)] * steps
        per_layer_ms = _timed_ms(x, sweep, device) / len(layers)
        results["tokens"][str(n)] = {
            "per_layer_ms": round(per_layer_ms, 4),
            "same_layer_same_routing_ms": round(_timed_ms(x, same, device) / len(layers), 4),
            # bare kt-kernel's own rate through all layers: no bound (engines have beaten it,
            # 52.9 > 44.8 tok/s on 2026-12-06); bench/memory_bandwidth.py gives the limit
            KERNEL_ALONE_KEY: round(n / (per_layer_ms * len(layers) / 1e3), 1),
        }
    return results


def _timed_ms(x: Any, steps: list[list[tuple[Any, tuple[Any, Any]]]], device: Any) -> float:
    """Milliseconds per step (a submit and sync per layer, in order), after one untimed step
    (page faults, first-call buffers)."""
    import torch

    def run(step: list[tuple[Any, tuple[Any, Any]]]) -> None:
        for experts, (ids, weights) in step:
            experts.submit(x, ids, weights)
            experts.sync(x)

    run(steps[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step in steps:
        run(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / len(steps)


def sweep_in_child(
    model_dir: str, load_format: str, env: dict[str, str], log_dir: Path, timeout_s: int
) -> dict[str, Any]:
    """``kernel_sweep`` in a fresh process: its kt-kernel threads and memory go with it, and
    the engines after it start on a quiet host."""
    log_path = log_dir / f"sweep-{env.get('KT_METHOD', '').lower()}.log"
    print(f"[bench] kernel sweep ({env.get('KT_METHOD')}): starting (log: {log_path})", flush=True)
    args = {"model_dir": model_dir, "load_format": load_format, "env": env, "tokens": list(SWEEP_TOKENS)}
    args["steps"] = SWEEP_STEPS
    return timing_in_child("kernel sweep", f"{__name__}:kernel_sweep", args, env, log_path, timeout_s)
