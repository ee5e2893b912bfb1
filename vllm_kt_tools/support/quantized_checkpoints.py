"""Tiny checkpoints in the quantized formats large MoE models ship in, written offline from
a tiny BF16 checkpoint (``support.tiny_models``, its quantizable shapes).

- ``fp8-block``: block-FP8 as DeepSeek-V3 and Qwen3-*-FP8 store it: every decoder linear
  layer as ``float8_e4m3fn`` ``weight`` plus a float32 ``weight_scale_inv`` per 128x128
  block (the dequantization scale, despite its name); routers, embeddings and the head
  stay BF16 (``modules_to_not_convert`` names the routers vLLM would otherwise quantize).
- ``ct-int4``: compressed-tensors ``pack-quantized`` INT4 as Kimi-K2-Thinking: the routed
  experts only, symmetric, groups of 32 along the input: ``weight_packed`` (int32, eight
  values each), ``weight_scale`` (BF16) and ``weight_shape``; everything else is listed in
  ``ignore``.
- ``gptq-int4``: symmetric GPTQ INT4 without act-order, groups of 128: ``qweight``
  (int32, eight rows each), ``scales`` (FP16), ``qzeros`` (the implicit zero 8, stored
  the GPTQ v1 way as 7) and ``g_idx``; attention and routed experts are quantized
  (``modules_in_block_to_quantize``), routers are not.

The quantization itself is vLLM's (``per_block_cast_to_fp8``, ``quantize_weights``,
``gptq_pack``) and compressed-tensors' (``pack_to_int32``): the layouts their loaders read.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from vllm_kt_plugin.cpu_backends.base import DUMMY_HIGH, DUMMY_LOW
from vllm_kt_plugin.settings.model_memory import moe_layer_indices
from vllm_kt_tools.support.tiny_models import GENERATOR_VERSION, tiny_model_dir

FORMATS = ("fp8-block", "ct-int4", "gptq-int4")
FP8_BLOCK_SHAPE = (128, 128)
CT_GROUP = 32
GPTQ_GROUP = 128
WRITER_VERSION = 2  # in the directory name with the tiny models' version: a change rewrites them

# Decoder linear weights: attention (DeepSeek's kv_a_proj_with_mqa too), dense MLP, shared
# and routed experts (not routers).
_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(?:\w+_proj(?:_with_mqa)?|w[123])\.weight$")
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")


def quantized_model_dir(arch: str, fmt: str, root: str | Path) -> Path:
    """``root/<arch>-<fmt>-v<GENERATOR_VERSION>w<WRITER_VERSION>``: the quantizable tiny
    ``arch`` model in format ``fmt``, written on first use."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    out = Path(root) / f"{arch}-{fmt}-v{GENERATOR_VERSION}w{WRITER_VERSION}"
    if not (out / "QUANTIZED.json").exists():
        write_quantized_checkpoint(tiny_model_dir(arch, root, quantizable=True), out, fmt)
    return out


def write_quantized_checkpoint(source: Path, out: Path, fmt: str) -> Path:
    """Quantize the BF16 checkpoint in ``source`` to ``fmt`` in ``out`` (tokenizer and
    generation config copied)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy2(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    (weights,) = source.glob("*.safetensors")
    tensors = load_file(weights)
    writer = {"fp8-block": _fp8_block, "ct-int4": _ct_int4, "gptq-int4": _gptq_int4}[fmt]
    tensors, config["quantization_config"] = writer(tensors, moe_layer_indices(config))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "QUANTIZED.json").write_text(json.dumps({"format": fmt, "source": source.name}))
    return out


def _linear_names(tensors: dict[str, torch.Tensor], *, routed_only: bool = False) -> list[str]:
    return [name for name in tensors if _LINEAR.match(name) and (not routed_only or _ROUTED_EXPERT.search(name))]


def _fp8_block(tensors: dict[str, torch.Tensor], moe_layers: tuple[int, ...]) -> tuple[dict, dict[str, Any]]:
    from vllm_kt_tools.support.vllm_internals import per_block_cast_to_fp8

    out = dict(tensors)
    for name in _linear_names(tensors):
        weight, scale = per_block_cast_to_fp8(tensors[name].float(), list(FP8_BLOCK_SHAPE))
        out[name] = weight
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale.float().contiguous()
    return out, fp8_block_config(moe_layers)


def fp8_block_config(moe_layers: list[int] | tuple[int, ...]) -> dict[str, Any]:
    """``quantization_config`` of a block-FP8 checkpoint: routers (which vLLM's Qwen-MoE
    would quantize with the rest) and the head stay unquantized."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(FP8_BLOCK_SHAPE),
        "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in moe_layers)],
    }


def write_dummy_experts(
    out: Path, method: str, moe_layers: list[int] | tuple[int, ...], num_experts: int, hidden: int, width: int
) -> Path:
    """Random routed experts, one safetensors file per MoE layer, named as in a DeepSeek/Qwen
    checkpoint: what kt-kernel's ``method`` reader (``FP8``: block-FP8 with
    ``weight_scale_inv``; ``BF16``) takes as KT_WEIGHT_PATH for a benchmark whose GPU side runs
    vLLM's dummy weights. One random expert per layer, copied to every expert (drawing each
    took 26 s per FP8 layer of Qwen3-30B-A3B beside busy cores; kernel speed does not depend on
    the values). Written once (``COMPLETE`` marks it), with a line per layer."""
    import time

    from safetensors.torch import save_file

    if method not in ("FP8", "BF16"):
        raise ValueError(f"no dummy expert writer for {method}")
    if (out / "COMPLETE").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    for done, layer in enumerate(moe_layers, 1):
        drawn = {name: _random_weight(method, shape, generator) for name, shape in shapes.items()}
        tensors: dict[str, torch.Tensor] = {}
        for expert in range(num_experts):
            base = f"model.layers.{layer}.mlp.experts.{expert}"
            for name, shape in shapes.items():
                tensors[f"{base}.{name}.weight"] = drawn[name].clone()  # safetensors stores no shared memory
                if method == "FP8":
                    blocks = tuple(-(-n // b) for n, b in zip(shape, FP8_BLOCK_SHAPE, strict=True))
                    tensors[f"{base}.{name}.weight_scale_inv"] = torch.full(blocks, 1e-3, dtype=torch.float32)
        save_file(tensors, out / f"experts-layer-{layer:03d}.safetensors", metadata={"format": "pt"})
        print(
            f"[{method} experts] layer {layer}: {done}/{len(moe_layers)} written to {out} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    (out / "COMPLETE").write_text("")
    return out


def _random_weight(method: str, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    if method == "FP8":
        return _random_fp8(shape, generator)
    return (torch.rand(shape, generator=generator) * (DUMMY_HIGH - DUMMY_LOW) + DUMMY_LOW).to(torch.bfloat16)


def _random_fp8(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 values: every byte but the two NaN patterns (S.1111.111)."""
    values = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
    values[(values & 0x7F) == 0x7F] -= 1
    return values.view(torch.float8_e4m3fn)


def _ct_int4(tensors: dict[str, torch.Tensor], moe_layers: tuple[int, ...]) -> tuple[dict, dict[str, Any]]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from vllm_kt_tools.support.vllm_internals import quantize_int4

    out = dict(tensors)
    for name in _linear_names(tensors, routed_only=True):
        weight = out.pop(name)  # [N, K]
        n, k = weight.shape
        _, q, scale, _ = quantize_int4(weight.float().t(), CT_GROUP)  # [K, N] groups along K
        base = name.removesuffix("weight")
        out[base + "weight_packed"] = pack_to_int32(q.t().contiguous().to(torch.int8), 4)
        out[base + "weight_scale"] = scale.t().contiguous().to(torch.bfloat16)
        out[base + "weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
    ignored = [name.removesuffix(".weight") for name in _linear_names(tensors) if not _ROUTED_EXPERT.search(name)]
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": CT_GROUP,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", *ignored],
        "kv_cache_scheme": None,
    }
    return out, config


def _gptq_int4(tensors: dict[str, torch.Tensor], moe_layers: tuple[int, ...]) -> tuple[dict, dict[str, Any]]:
    from vllm_kt_tools.support.vllm_internals import gptq_int4, gptq_pack, pack_cols

    out = dict(tensors)
    modules = set()
    for name in _linear_names(tensors):
        weight = out.pop(name).float().t().contiguous()  # GPTQ stores [K, N]
        k, n = weight.shape
        _, q, scale = gptq_int4(weight, GPTQ_GROUP)
        base = name.removesuffix("weight")
        out[base + "qweight"] = gptq_pack(q, 4, k, n)
        out[base + "scales"] = scale.to(torch.float16)
        out[base + "qzeros"] = pack_cols(torch.full((k // GPTQ_GROUP, n), 7, dtype=torch.int32), 4, k // GPTQ_GROUP, n)
        out[base + "g_idx"] = torch.arange(k, dtype=torch.int32) // GPTQ_GROUP
        modules.add(name.split(".", 3)[3].removesuffix(".weight"))  # e.g. self_attn.q_proj
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GPTQ_GROUP,
        "desc_act": False,
        "sym": True,
        "damp_percent": 0.01,
        "true_sequential": True,
        "checkpoint_format": "gptq",
        "modules_in_block_to_quantize": [sorted(_block_modules(modules))],
    }
    return out, config


def _block_modules(modules: set[str]) -> set[str]:
    """Module names within a decoder block, experts collapsed to "mlp.experts" (GPTQ's
    list is matched as substrings of vLLM's module prefixes)."""
    return {"mlp.experts" if _ROUTED_EXPERT.search(f".{m}") else m for m in modules}
