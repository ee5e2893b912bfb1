"""CPU-expert folders in kt-kernel's own layouts, written from a tiny BF16 checkpoint, for the
tests of what KT_WEIGHT_PATH may hold (``support.weight_matrix``).

- Layer folders, ``_layer_L/_numa_M/<INT4|INT8>_<proj>_<E>_<bytes>Byte_<quant|scale>_.kt``:
  what kt-kernel's AMX kernels write when they quantize (``load_weights_from_tensors``), in the
  plugin's KT_CACHE_DIR (``<model>-<hash>/<METHOD>-pools<N>``) and from ``kt quant --no-merge``.
  ``quantize_layers`` has kt-kernel write them (the plugin's own ``quantize_into_cache``), where
  this CPU's kt-kernel build carries the method's kernel; ``fake_layers`` writes the same names
  and sizes (``weight_paths.part_bytes``) with random bytes, which is all the config-time
  checks read, where it does not.
- Converted, as ``kt quant`` (KTransformers' ``kt-kernel/scripts/convert_cpu_weights.py``,
  ``OnlineQuantConverter``) writes ``<model>-AMXINT4-NUMA<n>``: one
  ``model-0000K-of-0000N.safetensors`` per MoE layer with
  ``blk.L.ffn_{gate,up,down}_exps.E.numa.M.weight`` (int8, a ``_quant_.kt`` file's bytes, flat)
  and ``.scale`` (float32, a ``_scale_.kt`` file's, flat), then a shard of the checkpoint's
  other tensors (``model.layers.`` -> ``blk.``, ``model.`` dropped),
  ``model.safetensors.index.json``, and the config and tokenizer files copied.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from vllm_kt_plugin.cpu_backends.kt_kernel.weight_paths import KT_FILE_NAME, part_bytes
from vllm_kt_plugin.settings.model_memory import expert_shape

# kt-kernel's kernels' type names in their file names (operators/amx/la: T::name()).
FILE_TYPE = {"AMXINT4": "INT4", "AMXINT8": "INT8", "MOE_INT4": "MOE_INT4", "MOE_INT8": "MOE_INT8"}
PROJECTIONS = ("gate", "up", "down")
COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # the converter's


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def quantize_layers(model_dir: Path, root: Path, method: str, pools: int = 1) -> Path:
    """The folder an online start with KT_METHOD=``method`` and KT_CACHE_DIR=``root`` leaves
    (``<model>-<hash>/<METHOD>-pools<N>``), quantized by kt-kernel from ``model_dir``'s BF16
    experts; needs the kernel."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel
    from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import ExpertTensors, cache_folder, quantize_into_cache

    kt_kernel = prepare_kt_kernel()
    shape = expert_shape(_config(model_dir))
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    folder = cache_folder(
        str(root), model=str(model_dir), model_dir=str(model_dir), method=method, pools=pools, shape=(e, h, i)
    )
    tensors = _checkpoint(model_dir)
    for layer in shape.moe_layers:
        experts = ExpertTensors(e, h, i)
        for expert in range(e):
            for shard, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                experts.put(expert, shard, tensors[f"model.layers.{layer}.mlp.experts.{expert}.{name}.weight"])
        quantize_into_cache(
            kt_kernel,
            folder,
            layer,
            experts,
            num_experts=e,
            num_experts_per_tok=2,
            hidden_size=h,
            moe_intermediate_size=i,
            gpu_experts_mask=torch.zeros(e, dtype=torch.bool),
            cpuinfer_threads=max(pools, 1),
            threadpool_count=pools,
            chunked_prefill_size=64,
            method=method,
        )
    return folder


def fake_layers(model_dir: Path, out: Path, method: str, pools: int = 1) -> Path:
    """``out``/_layer_L/_numa_M/*.kt with the names and sizes kt-kernel writes for
    ``model_dir``'s experts (random bytes), and the plugin's marker file."""
    shape = expert_shape(_config(model_dir))
    sizes = part_bytes(method, shape.hidden_size, shape.intermediate_size, pools)
    for layer in shape.moe_layers:
        for numa in range(pools):
            folder = out / f"_layer_{layer}" / f"_numa_{numa}"
            folder.mkdir(parents=True, exist_ok=True)
            for expert in range(shape.num_experts):
                for proj in PROJECTIONS:
                    for part, kind in (("weight", "quant"), ("scale", "scale")):
                        size = sizes[(proj, part)]
                        name = f"{FILE_TYPE[method]}_{proj}_{expert}_{size}Byte_{kind}_.kt"
                        (folder / name).write_bytes(os.urandom(size))
        marker = {"method": method, "num_experts": shape.num_experts, "hidden_size": shape.hidden_size}
        (out / f"_layer_{layer}" / "vllm-kt.json").write_text(json.dumps(marker))
    return out


def convert_layers(
    layers: Path, model_dir: Path, out_root: Path, method: str, pools: int = 1, *, stop_at: int | None = None
) -> Path:
    """What ``kt quant`` writes from the same quantized bytes: ``out_root``/<model>-<METHOD>-NUMA<pools>.
    ``stop_at``: a conversion that died before that layer (its shards keep their provisional
    ``-of-PLACEHOLDER`` names; nothing else was written yet)."""
    from safetensors.torch import save_file

    out = out_root / f"{model_dir.name}-{method}-NUMA{pools}"
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = []
    for layer_dir in sorted(layers.glob("_layer_*"), key=lambda p: int(p.name[7:])):
        layer = int(layer_dir.name[7:])
        if stop_at is not None and layer >= stop_at:
            break
        tensors: dict[str, torch.Tensor] = {}
        for numa_dir in sorted(layer_dir.glob("_numa_*")):
            numa = int(numa_dir.name[6:])
            for path in numa_dir.iterdir():
                match = KT_FILE_NAME.match(path.name)
                if match is None:
                    continue
                part = "weight" if match["part"] == "quant" else "scale"
                data = bytearray(path.read_bytes())
                values = torch.frombuffer(data, dtype=torch.int8 if part == "weight" else torch.float32).clone()
                tensors[f"blk.{layer}.ffn_{match['proj']}_exps.{match['expert']}.numa.{numa}.{part}"] = values
        shards.append(tensors)
    if stop_at is not None:
        for k, tensors in enumerate(shards, start=1):
            save_file(tensors, str(out / f"model-{k:05d}-of-PLACEHOLDER.safetensors"))
        return out
    # the checkpoint's other tensors, renamed as the converter renames them
    shards.append(
        {
            name.replace("model.layers.", "blk.").replace("model.", "") if name.startswith("model.") else name: t
            for name, t in _checkpoint(model_dir).items()
            if ".mlp.experts." not in name
        }
    )
    weight_map = {}
    for k, tensors in enumerate(shards, start=1):
        shard = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for name in COPIED:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out / name)
    return out
