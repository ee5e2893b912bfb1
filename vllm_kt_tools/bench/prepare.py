"""``vllm-kt bench --prepare-only``: what a sitting's kt-hybrid runs would otherwise make at
their first start, made ahead and without the GPU: the random AMXINT4/AMXINT8 CPU experts
quantized into KT_CACHE_DIR (28 s for AMXINT4's 48 layers on the H200 host) and, for a
``--checkpoint`` read from files, its routed expert files. A sitting can prepare while its GPU runs tests;
the engines then load the cached layers. The cache publishes each layer atomically, so an
engine that starts before preparation ends only quantizes the layers still missing."""

from __future__ import annotations

import os
import time
from typing import Any

from vllm_kt_plugin.cpu_backends.base import LayerSpec
from vllm_kt_plugin.cpu_backends.kt_kernel.backend import KTKernelExperts
from vllm_kt_plugin.cpu_backends.kt_kernel.methods import QUANTIZES_ONLINE
from vllm_kt_plugin.planning.placement import ExpertPlacement
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_tools.bench.engine_runs import RunSpec
from vllm_kt_tools.bench.shapes import ModelSizes, model_sizes


def fill_online_cache(spec: RunSpec, hf_config: dict[str, Any]) -> int:
    """Quantize the random CPU experts of ``spec``'s kt-hybrid run into its KT_CACHE_DIR,
    layer by layer, as its engine would; returns the layers quantized (0: all cached, or
    nothing to quantize: another method, or real weights, which only the engine loads)."""
    settings = load_settings({**os.environ, **spec.env})
    if spec.system != "kt-hybrid" or settings.method not in QUANTIZES_ONLINE or spec.load_format != "dummy":
        return 0
    sizes = model_sizes(hf_config)
    chunk = settings.chunked_prefill_size or 1024  # kt-kernel's buffers: no bearing on the weights
    quantized = 0
    for layer_idx in sizes.memory.moe_layers:
        started = time.perf_counter()
        # every expert is quantized anyway: no GPU experts
        layer = layer_spec(
            spec.model, spec.load_format, sizes, layer_idx, ExpertPlacement.first_n(sizes.num_experts, 0), chunk
        )
        if KTKernelExperts(layer, settings).fill_cache():
            quantized += 1
            print(
                f"[bench] prepare {spec.name}: layer {layer_idx} quantized in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
    return quantized


def layer_spec(
    model: str, load_format: str, sizes: ModelSizes, layer_idx: int, placement: ExpertPlacement, chunk: int
) -> LayerSpec:
    """Decoder layer ``layer_idx`` of the shape, as an engine start would hand it to the
    CPU backend (the same cache folder follows from it)."""
    return LayerSpec(
        layer_name=f"model.layers.{layer_idx}.mlp.experts",
        layer_idx=layer_idx,
        num_experts=sizes.num_experts,
        top_k=sizes.top_k,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.expert_inter,
        placement=placement,
        chunked_prefill_size=chunk,
        model=model,
        load_format=load_format,
    )
