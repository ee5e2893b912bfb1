"""The model check's checkpoint writer: tensor names renamed to the released layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm_kt_tools.model_check.checkpoint import rename_tensors, renamed
from vllm_kt_tools.model_check.recipes import RECIPES


def test_deepseek_v4_hc_head_gets_the_released_name() -> None:
    renames = RECIPES["DeepseekV4ForCausalLM"].renames
    assert renamed("model.hc_head.hc_base", renames) == "model.hc_head_base"
    assert renamed("model.layers.1.attn.norm.weight", renames) == "model.layers.1.attn.kv_norm.weight"
    assert renamed("model.layers.1.attn.compressor.norm.weight", renames).endswith(".compressor.norm.weight")
    assert renamed("model.layers.0.hc_attn_base", renames) == "model.layers.0.hc_attn_base"


def test_rename_rewrites_the_files_and_their_index(tmp_path: Path) -> None:
    save_file({"model.hc_head.hc_fn": torch.ones(2), "lm_head.weight": torch.zeros(1)}, tmp_path / "m.safetensors")
    index = {"weight_map": {"model.hc_head.hc_fn": "m.safetensors", "lm_head.weight": "m.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    rename_tensors(tmp_path, {"model.hc_head.hc_": "model.hc_head_"})
    tensors = load_file(tmp_path / "m.safetensors")
    assert sorted(tensors) == ["lm_head.weight", "model.hc_head_fn"]
    assert torch.equal(tensors["model.hc_head_fn"], torch.ones(2))
    written = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(written) == ["lm_head.weight", "model.hc_head_fn"]


def test_a_part_renamed_to_none_drops_its_tensors(tmp_path: Path) -> None:
    """LongCat's zero experts: transformers writes tensors the released checkpoint lacks."""
    renames = RECIPES["LongcatFlashForCausalLM"].renames
    assert renamed("model.layers.0.mlp.experts.8.gate_proj.weight", renames) is None
    kept = "model.layers.0.mlp.experts.7.gate_proj.weight"
    assert renamed(kept, renames) == kept
    save_file({"a.experts.8.w": torch.ones(1), "a.experts.1.w": torch.zeros(1)}, tmp_path / "m.safetensors")
    rename_tensors(tmp_path, {".experts.8.": None})
    assert sorted(load_file(tmp_path / "m.safetensors")) == ["a.experts.1.w"]
