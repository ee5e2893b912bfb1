"""Copies of a tiny checkpoint with one thing broken, as a user's KT_WEIGHT_PATH might be."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

# kind -> what the plugin's error must say about it
BREAKAGES = {
    "wrong shape": "layer 1 expert 5: down_proj in model.safetensors is BF16 [128, 48], expected BF16 [128, 64]",
    "missing expert": "layer 2 expert 7: no up_proj tensor (model.layers.2.mlp.experts.7.up_proj.weight)",
    "truncated file": "model.safetensors cannot be read",
}


def broken_copy(model: Path, out: Path, kind: str) -> Path:
    """``model``'s files in ``out`` with ``kind`` (a key of BREAKAGES) done to them."""
    shutil.copytree(model, out)
    (weights,) = out.glob("*.safetensors")
    if kind == "truncated file":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 4096])
        return out
    tensors = load_file(weights)
    if kind == "wrong shape":  # 16 columns too few, as in the report that started this
        name = "model.layers.1.mlp.experts.5.down_proj.weight"
        tensors[name] = tensors[name][:, :-16].contiguous()
    elif kind == "missing expert":
        del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    else:
        raise ValueError(kind)
    save_file(tensors, weights, metadata={"format": "pt"})
    return out
