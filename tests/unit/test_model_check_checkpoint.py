"""The model check's checkpoint writer: tensor names renamed to the released layout; the
tokenizer and configs vLLM reads besides the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_kt_tools.model_check.checkpoint import (
    add_special_tokens,
    build_config,
    name_architecture,
    rename_tensors,
    renamed,
    transpose_tensors,
    weights_folder,
    with_config_json,
    write_processor,
)
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


def test_special_tokens_a_renderer_needs_are_in_the_tokenizer_and_the_vocab(tmp_path: Path) -> None:
    """vLLM's Inkling renderer looks its special tokens up in the tokenizer at start; the tiny
    config's vocabulary covers them."""
    from transformers import AutoTokenizer

    recipe = RECIPES["InklingForCausalLM"]
    size = add_special_tokens(tmp_path, recipe.special_tokens)
    vocab = AutoTokenizer.from_pretrained(tmp_path).get_vocab()
    assert all(0 <= vocab[token] < size for token in recipe.special_tokens)
    assert build_config("InklingForCausalLM", recipe, size).vocab_size == size


def test_a_nested_text_config_keeps_its_model_type() -> None:
    """Aria's config builds its text config of a dict only where the dict names its model_type."""
    config = build_config("AriaForConditionalGeneration", RECIPES["AriaForConditionalGeneration"], 512)
    assert type(config.text_config).__name__ == "AriaTextConfig" and config.text_config.hidden_size == 128
    assert config.vision_config.num_hidden_layers == 1


def test_a_token_a_processor_reads_is_a_tokenizer_attribute_and_its_id_in_the_config(tmp_path: Path) -> None:
    """vLLM's Aria processor reads ``tokenizer.image_token``; the config's image_token_index is its id."""
    from transformers import AutoTokenizer

    recipe = RECIPES["AriaForConditionalGeneration"]
    size = add_special_tokens(tmp_path, recipe.special_tokens, recipe.named_tokens)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.image_token == recipe.named_tokens["image_token"] and tokenizer.image_token_id == size - 1
    assert recipe.token_ids == {"image_token_index": tokenizer.image_token}


def test_the_config_names_the_architecture_not_the_class_that_wrote_the_weights(tmp_path: Path) -> None:
    """transformers' save_pretrained writes its class's name; vLLM would resolve that class, not
    the registry architecture a recipe's ``hf_class`` stands in for."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["AriaForConditionalGeneration"], "x": 1}))
    name_architecture(tmp_path, "TransformersMultiModalMoEForCausalLM")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == {"architectures": ["TransformersMultiModalMoEForCausalLM"], "x": 1}


def test_the_tiny_phimoe_has_the_biases_vllm_builds() -> None:
    """vLLM's PhiMoE (phimoe.py) builds q/k/v/o_proj's and lm_head's biases whatever the config
    says; a checkpoint without them leaves them uninitialised and plain vLLM's logits NaN."""
    from transformers import PhimoeForCausalLM

    config = build_config("PhiMoEForCausalLM", RECIPES["PhiMoEForCausalLM"], 512)
    names = set(PhimoeForCausalLM(config).state_dict())
    wanted = {"lm_head.bias"} | {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert wanted <= names, sorted(wanted - names)


def test_a_per_layer_mlp_list_follows_the_shrunk_first_k_dense_replace() -> None:
    # GLM-5's class derives mlp_layer_types from its released first_k_dense_replace (3): the
    # first three entries of that list are dense, which left the tiny model no MoE layer
    config = build_config("GlmMoeDsaForCausalLM", RECIPES["GlmMoeDsaForCausalLM"], 64)
    assert config.first_k_dense_replace == 1
    assert config.mlp_layer_types == ["dense", "sparse", "sparse"]


def test_fused_experts_are_written_in_the_released_layout(tmp_path: Path) -> None:
    """Qwen3-VL-MoE's released experts are (in, out), which vLLM loads transposed; transformers saves (out, in)."""
    parts = RECIPES["Qwen3VLMoeForConditionalGeneration"].transposed
    down = torch.arange(24.0).reshape(2, 4, 3)  # (experts, hidden, intermediate)
    save_file(
        {"model.language_model.layers.0.mlp.experts.down_proj": down, "lm_head.weight": torch.ones(4, 3)},
        tmp_path / "m.safetensors",
    )
    transpose_tensors(tmp_path, parts)
    tensors = load_file(tmp_path / "m.safetensors")
    assert torch.equal(tensors["model.language_model.layers.0.mlp.experts.down_proj"], down.transpose(1, 2))
    assert tensors["lm_head.weight"].shape == (4, 3)  # the others untouched


def test_a_text_config_key_of_config_json_is_merged_into_the_written_text_config() -> None:
    """MiniMax-M3's: vLLM's config class reads the released text config's names beside transformers' keys."""
    extra = RECIPES["MiniMaxM3SparseForConditionalGeneration"].config_json
    written = {"text_config": {"hidden_act": "silu", "hidden_size": 128}, "vision_config": {"hidden_size": 64}, "x": 1}
    merged = with_config_json(written, {**extra, "x": None})
    assert merged["text_config"]["hidden_act"] == "swigluoai" and merged["text_config"]["hidden_size"] == 128
    assert merged["vision_config"]["hidden_size"] == 64 and "img_token_compression_config" in merged["vision_config"]
    assert "x" not in merged


def test_a_processor_s_parts_that_share_a_file_name_are_all_written(tmp_path: Path) -> None:
    # Gemma 3n's image processor and audio feature extractor both save preprocessor_config.json
    # alone: the processor's config holds both (as vLLM's EmbeddingGemma2Processor needs its three)
    named = RECIPES["EmbeddingGemma2Model"].named_tokens  # the tokenizer attributes Gemma 3n's processor reads too
    add_special_tokens(tmp_path, (), named)
    write_processor(tmp_path, "Gemma3nProcessor", "gemma3n")
    config = json.loads((tmp_path / "processor_config.json").read_text())
    assert config["processor_class"] == "Gemma3nProcessor"
    assert config["feature_extractor"]["feature_extractor_type"] == "Gemma3nAudioFeatureExtractor"
    assert config["image_processor"]["image_processor_type"].startswith("SiglipImageProcessor")


def test_an_image_processor_alone_writes_its_own_config(tmp_path: Path) -> None:
    write_processor(tmp_path, "AriaImageProcessor", "aria")
    config = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert config["image_processor_type"] == "AriaImageProcessor"
    assert not (tmp_path / "processor_config.json").exists()


def test_weights_go_to_the_folder_vllm_s_class_reads_them_from(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kt_tools.support import vllm_internals

    class Diffusers:  # Cosmos3-Edge's: the released checkpoint's transformer/ and vision_encoder/
        allow_patterns_overrides = ["[tv]*er/*.safetensors"]

    monkeypatch.setattr(
        vllm_internals, "model_class", lambda architecture: Diffusers if architecture == "D" else object
    )
    assert weights_folder("D") == "transformer"
    assert weights_folder("Other") is None
