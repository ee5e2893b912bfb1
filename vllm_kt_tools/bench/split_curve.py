"""``vllm-kt bench --layer-only --split-curve``: per-layer time of the split's paths from
128 to 16,384 tokens, on CUDA (docs/split.md).

A few consecutive kt-hybrid layers of the model's shape share the staging buffers as in an
engine, and each forward runs through all of them in turn, so the next layer's prefetch
overlaps this one's work as it does in a model. Per token count, one layer's time on

- ``cpu_path_ms``: the CPU path (kt-kernel computes every CPU expert);
- ``whole_layer_ms``: the whole-layer path (every CPU expert streamed to the GPU);
- ``split_ms``: the split with the cost model (its probe logged and stored);
- ``split_fp8_ms``: the split with the FP8 host copy (KT_STAGING_FP8_COPY=1, a second
  child: the copy is built at load), and ``whole_layer_fp8_ms``;

with the plan's mean staged / picked CPU experts per layer and the model's prediction, to
check the cost model against the measurement. Routing is drawn near-uniformly (as dummy
weights route): the split's worst case, where no expert is much hotter than another."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench.layer_timing import random_routing, timing_in_child
from vllm_kt_tools.bench.shapes import model_sizes
from vllm_kt_tools.support.moe_layers import build_moe, vllm_world

SPLIT_CURVE_TOKENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SPLIT_CURVE_LAYERS = 4  # consecutive layers: enough for the prefetch to run as in a model


def split_curve_benchmark(
    model_dir: str, env: dict[str, str], tokens: Sequence[int], layers: int, repeats: int
) -> dict[str, Any]:
    """Runs in the child process: ``layers`` layers, every path at every token count (on
    CUDA; on vLLM's CPU build too, for its test, with host timers)."""
    import time

    import torch
    from vllm.config import ModelConfig, VllmConfig

    from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
    from vllm_kt_plugin.hybrid.staging.build import staging_path
    from vllm_kt_plugin.hybrid.staging.costs import path_thresholds
    from vllm_kt_plugin.hybrid.staging.split import NEVER, SplitPath
    from vllm_kt_plugin.settings.loader import load_settings
    from vllm_kt_tools.support.vllm_internals import forward_context, init_workspace, routed_experts

    sizes = model_sizes(json.loads((Path(model_dir) / "config.json").read_text()))
    vllm_config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True))
    vllm_config.load_config.load_format = "dummy"
    fp8 = env.get("KT_STAGING_FP8_COPY") == "1"
    results: dict[str, Any] = {"tokens": {}, "layers": layers, "fp8_copy": fp8}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    with vllm_world(vllm_config, backend="nccl" if cuda else "gloo"):
        init_workspace(device)
        quant = KTHybridConfig(settings=load_settings({**os.environ, **env}))
        stack = []
        for i in range(layers):
            with device:
                runner = build_moe(quant, sizes.num_experts, sizes.top_k, sizes.hidden, sizes.expert_inter, layer_idx=i)
            layer = routed_experts(runner)
            for param in layer.parameters():
                param.data.uniform_(-1e-3, 1e-3)
            layer.quant_method.process_weights_after_loading(layer)
            stack.append((layer, layer.quant_method))
        methods = [m for _, m in stack]
        # KT_STAGING_MIN_TOKENS=1 (a number): each layer has the whole-layer path; its
        # sibling the split (cost model, no share) shares its LayerStaging (host copy and
        # buffers), and takes its place in the layer's paths while the split is timed.
        wholes = [staging_path(m.paths) for m in methods]
        assert all(m.cpu is not None and w is not None for m, w in zip(methods, wholes, strict=True)), (
            "needs CPU experts and staging"
        )
        cpu_paths = [m.paths[-1] for m in methods]
        splits = []
        for method, whole in zip(methods, wholes, strict=True):
            split = SplitPath(whole.staging, method.cpu)
            split.min_tokens = 1
            method.parts.context.process.add_split_path(method.layer_idx, split)  # the next layer's prefetch
            splits.append(split)
        gen = torch.Generator(device=device).manual_seed(0)

        def per_layer_ms(path: str, n: int) -> float:
            x = (torch.randn(n, sizes.hidden, device=device, generator=gen) * 0.1).to(torch.bfloat16)
            routes = [random_routing(n, sizes.num_experts, sizes.top_k, gen, x.device) for _ in stack]
            for method, whole, split, cpu_path in zip(methods, wholes, splits, cpu_paths, strict=True):
                chosen = {"cpu": [], "whole_layer": [whole], "split": [split]}[path]
                method.paths = [*chosen, cpu_path]

            def forward() -> None:
                for (layer, method), (ids, weights) in zip(stack, routes, strict=True):
                    method.forward_hybrid(x, weights, ids, layer)

            forward()  # warm-up (and, the first time, the split's probe and its path choice)
            for split in splits:  # the split's own plan at every size: not the choice the engine would make
                split.plan_min_tokens, split.whole_min_tokens = 1, NEVER
            forward()
            if not cuda:
                started = time.perf_counter()
                for _ in range(repeats):
                    forward()
                return (time.perf_counter() - started) * 1e3 / (repeats * layers)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                forward()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / (repeats * layers)

        with forward_context(vllm_config):
            for n in tokens:
                before = [(s.forwards, s.staged_experts, s.picked_experts) for s in splits]
                row = {f"{p}_ms": round(per_layer_ms(p, n), 3) for p in ("cpu", "whole_layer", "split")}
                forwards = sum(s.forwards - b[0] for s, b in zip(splits, before, strict=True))
                staged = sum(s.staged_experts - b[1] for s, b in zip(splits, before, strict=True))
                picked = sum(s.picked_experts - b[2] for s, b in zip(splits, before, strict=True))
                row["split_staged_per_layer"] = round(staged / max(forwards, 1), 1)
                row["split_picked_per_layer"] = round(picked / max(forwards, 1), 1)
                row["split_min_tokens"] = splits[0].plan_min_tokens
                results["tokens"][str(n)] = row
                print(f"[split-curve] {n} tokens: {row}", flush=True)
        costs = splits[0].costs
        results["cost_model"] = None if costs is None else {k: v for k, v in vars(costs).items()}
        if costs is not None:  # what the engine's forwards take by these costs (costs.path_thresholds)
            spec = methods[0].cpu.spec
            split_from, whole_from = path_thresholds(
                costs, splits[0].host.num_experts, spec.num_experts, spec.top_k, spec.chunked_prefill_size
            )
            results["auto_paths"] = {"split_from_tokens": split_from, "whole_layer_from_tokens": whole_from}
        results["staged_gib_per_layer"] = round(wholes[0].host.staged_nbytes / 2**30, 3)
        results["cpu_experts_per_layer"] = methods[0].placement.num_cpu_experts
    return results


def split_curve_in_child(model_dir: str, env: dict[str, str], log_dir: Path, timeout_s: int) -> dict[str, Any]:
    """The curve with the BF16 host copy (or kt-kernel's writer), then with the FP8 copy
    where the method keeps a copy of unquantized experts; merged by token count."""
    base = {**env, "KT_STAGING_MIN_TOKENS": "1", "KT_CHUNKED_PREFILL_SIZE": str(max(SPLIT_CURVE_TOKENS))}
    args = {"model_dir": model_dir, "tokens": SPLIT_CURVE_TOKENS, "layers": SPLIT_CURVE_LAYERS, "repeats": 5}
    method = env.get("KT_METHOD", "").lower()
    target = f"{__name__}:split_curve_benchmark"
    curve = timing_in_child(
        "split curve", target, {**args, "env": base}, base, log_dir / f"split-{method}.log", timeout_s
    )
    fp8_env = {**base, "KT_STAGING_FP8_COPY": "1"}
    fp8_log = log_dir / f"split-{method}-fp8.log"
    fp8 = timing_in_child("split curve, FP8 copy", target, {**args, "env": fp8_env}, fp8_env, fp8_log, timeout_s)
    if "error" in curve:
        return curve
    curve["fp8_copy_error"] = fp8.get("error")
    for n, row in fp8.get("tokens", {}).items():
        curve["tokens"][n].update(
            split_fp8_ms=row["split_ms"],
            whole_layer_fp8_ms=row["whole_layer_ms"],
            split_fp8_staged_per_layer=row["split_staged_per_layer"],
        )
    curve["fp8_cost_model"] = fp8.get("cost_model")
    for row in curve["tokens"].values():
        best_pure = min(row["cpu_ms"], row["whole_layer_ms"])
        row["split_speedup_over_best_pure"] = round(best_pure / row["split_ms"], 3)
        if "split_fp8_ms" in row:
            # against the pure paths with the same copy: the FP8 stream is one of them
            best_fp8 = min(row["cpu_ms"], row["whole_layer_fp8_ms"])
            row["split_fp8_speedup_over_best_pure"] = round(best_fp8 / row["split_fp8_ms"], 3)
    return curve
