"""A config-only tiny Qwen3-MoE: a model directory with ``config.json`` and no weights,
for tests that build layers or run vLLM's dummy loader (no tokenizer, no training)."""

from __future__ import annotations

from pathlib import Path


def write_config_only_qwen3_moe(model_dir: Path, layers: int) -> Path:
    """8 experts of 64 (top 2), hidden 128: the shape vLLM's CPU kernels and
    kt-kernel's AMXINT8/BF16 kernels both take."""
    import transformers

    transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        dtype="bfloat16",
    ).save_pretrained(model_dir)
    return model_dir
