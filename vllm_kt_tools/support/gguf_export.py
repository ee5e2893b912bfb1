"""Hugging Face MoE checkpoints written as llama.cpp GGUF files, for the tests and the bench.

What ``convert_hf_to_gguf.py`` + ``llama-quantize`` would write, as far as kt-kernel's
``LLAMAFILE`` method and the plugin's checks read it: llama.cpp's architecture name and
metadata keys, its tensor names (``blk.N.ffn_{gate,up,down}_exps.weight``, the experts
stacked outermost; the other tensors under gguf-py's own name map), the GGML types gguf-py
quantizes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16, F32) and the K-quants
(``gguf_quants``), and ``llama-gguf-split``'s file names and ``split.*`` keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vllm_kt_tools.support.gguf_quants import K_QUANTS

# Hugging Face model_type -> llama.cpp's architecture name (gguf.MODEL_ARCH_NAMES).
ARCH_NAMES = {"qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2", "mixtral": "llama", "qwen2_moe": "qwen2moe"}
PROJECTIONS = ("gate", "up", "down")
# A type for every projection, or one per projection: Q4_K_M's experts are Q4_K with
# Q6_K down projections in some layers.
Types = str | Mapping[str, str]


def quantize(values: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """``values`` (rows along the last axis) in GGML type ``type_name``: the array to write
    and the raw type to declare (None where gguf-py infers it from a float dtype)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if type_name in K_QUANTS:
        return K_QUANTS[type_name](values), GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    qtype = GGMLQuantizationType[type_name]
    return gguf_quantize(values.astype(np.float32), qtype), qtype


def _moe_config(config: Mapping[str, Any]) -> dict[str, int]:
    experts = config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
    return {
        "experts": int(experts),
        "top_k": int(config["num_experts_per_tok"]),
        "hidden": int(config["hidden_size"]),
        "inter": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        "layers": int(config["num_hidden_layers"]),
        "first_dense": int(config.get("first_k_dense_replace") or 0),
    }


def _add_metadata(writer: Any, config: Mapping[str, Any], arch: str, moe: dict[str, int]) -> None:
    writer.add_block_count(moe["layers"])
    writer.add_context_length(int(config.get("max_position_embeddings", 0)))
    writer.add_embedding_length(moe["hidden"])
    writer.add_feed_forward_length(int(config.get("intermediate_size") or moe["inter"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_expert_count(moe["experts"])
    writer.add_expert_used_count(moe["top_k"])
    writer.add_expert_feed_forward_length(moe["inter"])
    if arch == "deepseek2":
        writer.add_leading_dense_block_count(moe["first_dense"])


def _expert_tensors(
    tensors: Mapping[str, Any], layer: int, experts: int, order: list[int], types: Types
) -> list[tuple[str, np.ndarray, Any]]:
    """One layer's routed experts stacked as llama.cpp stacks them, expert ``order[i]`` at
    position i (the identity, or a permutation for a negative control)."""
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    out = []
    for projection in PROJECTIONS:
        stacked = np.stack(
            [tensors[f"model.layers.{layer}.mlp.experts.{e}.{names[projection]}.weight"].float().numpy() for e in order]
        )
        type_name = types if isinstance(types, str) else types[projection]
        data, raw = quantize(stacked, type_name)
        out.append((f"blk.{layer}.ffn_{projection}_exps.weight", data, raw))
    assert len(order) == experts
    return out


def _other_tensors(tensors: Mapping[str, Any], arch: Any, layers: int) -> list[tuple[str, np.ndarray, Any]]:
    """The non-expert tensors under llama.cpp's names (F32 vectors, F16 matrices), as a
    full GGUF holds them; names gguf-py does not map are left out."""
    from gguf import get_tensor_name_map

    name_map = get_tensor_name_map(arch, layers)
    out = []
    for name, tensor in tensors.items():
        if ".mlp.experts." in name:
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            continue
        values = tensor.float().numpy()
        out.append((gguf_name, values.astype(np.float32 if values.ndim == 1 else np.float16), None))
    return out


def export_gguf(
    model_dir: str | Path,
    out: str | Path,
    types: Types,
    *,
    permute_experts: bool = False,
    splits: int = 1,
    experts_only: bool = False,
) -> list[Path]:
    """Write ``model_dir``'s checkpoint as a GGUF file at ``out`` (``splits`` > 1: about that
    many llama.cpp split files ``<stem>-0000i-of-0000N.gguf`` beside it); returns the files. ``types``: the
    routed experts' GGML type(s); ``permute_experts``: store every layer's experts reversed
    (a file whose experts are in the wrong order); ``experts_only``: no other tensors."""
    import gguf
    from safetensors.torch import load_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    arch_name = ARCH_NAMES[config["model_type"]]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    moe = _moe_config(config)
    tensors: dict[str, Any] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    order = list(range(moe["experts"]))[::-1] if permute_experts else list(range(moe["experts"]))
    written: list[tuple[str, np.ndarray, Any]] = [] if experts_only else _other_tensors(tensors, arch, moe["layers"])
    for layer in range(moe["first_dense"], moe["layers"]):
        written += _expert_tensors(tensors, layer, moe["experts"], order, types)
    # gguf-py's own splitting, the one convert_hf_to_gguf.py's --split-max-tensors uses:
    # llama-gguf-split's file names and split.* keys.
    per_file = -(-len(written) // splits) if splits > 1 else 0
    writer = gguf.GGUFWriter(str(out), arch_name, split_max_tensors=per_file)
    _add_metadata(writer, config, arch_name, moe)
    for name, data, raw in written:
        writer.add_tensor(name, data, raw_dtype=raw)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    files = writer.format_shard_names(out)
    return files


def write_random_experts(
    out: str | Path,
    layers: list[int],
    experts: int,
    hidden: int,
    inter: int,
    types: Types,
    *,
    seed: int = 0,
    scale: float = 0.05,
    arch_name: str = "qwen3moe",
) -> Path:
    """A GGUF holding only routed experts of random normal weights (times ``scale``), under
    llama.cpp's names: what the bench's layer timing and the kernel tests read."""
    import gguf

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_expert_count(experts)
    writer.add_embedding_length(hidden)
    writer.add_expert_feed_forward_length(inter)
    shapes = {"gate": (experts, inter, hidden), "up": (experts, inter, hidden), "down": (experts, hidden, inter)}
    for layer in layers:
        for projection in PROJECTIONS:
            values = rng.standard_normal(shapes[projection], dtype=np.float32) * scale
            data, raw = quantize(values, types if isinstance(types, str) else types[projection])
            writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.weight", data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
