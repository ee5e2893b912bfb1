"""The model shapes ``vllm-kt bench`` plans with: the built-in shapes (config.json values,
benchmarked with dummy weights), their sizes (from the plugin's own memory model, as
``KT_NUM_GPU_EXPERTS=auto`` sees them) and the checkpoint formats a sitting can write."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kt_plugin.planning.gpu_budget import fit_gpu_experts
from vllm_kt_plugin.settings.model_memory import ModelMemory, estimate_model_memory
from vllm_kt_tools.support.tiny_models import write_numbered_tokenizer

# Built-in model shapes (Hugging Face config.json values), benchmarked with dummy weights.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


@dataclass(frozen=True)
class ModelSizes:
    """The shape the benchmark plans with; byte counts and fitting come from model_memory
    and gpu_budget, as for KT_NUM_GPU_EXPERTS=auto."""

    memory: ModelMemory
    top_k: int
    hidden: int
    expert_inter: int

    @property
    def layers(self) -> int:
        return self.memory.num_moe_layers

    @property
    def num_experts(self) -> int:
        return self.memory.num_experts

    @property
    def expert_bytes(self) -> int:
        return int(self.memory.expert_bytes)

    @property
    def non_expert_bytes(self) -> int:
        return int(self.memory.non_expert_bytes)

    @property
    def experts_bytes(self) -> int:
        return self.layers * self.num_experts * self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return int(self.memory.gpu_bytes(self.num_experts))

    def gpu_experts_for(self, gpu_weight_bytes: float) -> int:
        """Experts per layer that fit beside the non-expert weights in ``gpu_weight_bytes``."""
        budget = fit_gpu_experts(
            device_total_bytes=int(gpu_weight_bytes),
            gpu_memory_utilization=1.0,
            memory=self.memory,
            kv_cache_reserve_gb=0.0,
        )
        return budget.num_gpu_experts

    def gpu_weight_bytes(self, gpu_experts: int) -> int:
        return int(self.memory.gpu_bytes(gpu_experts))


def model_sizes(hf_config: dict[str, Any]) -> ModelSizes:
    return ModelSizes(
        memory=estimate_model_memory(hf_config),
        top_k=hf_config["num_experts_per_tok"],
        hidden=hf_config["hidden_size"],
        expert_inter=hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"],
    )


# --checkpoint: the format every system's checkpoint has; the name plain vLLM's runs
# carry, and the kt-kernel method that reads its experts from files written on the host
# (None: online AMX weights quantized from vLLM's dummy ones). bf16-experts gives kt-hybrid
# BF16 CPU experts, which can move to the GPU (KT_DYNAMIC_GPU_EXPERTS).
CHECKPOINTS = {"bf16": ("bf16", None), "bf16-experts": ("bf16", "BF16"), "fp8-block": ("fp8", "FP8")}


def shape_config(shape: str, checkpoint: str = "bf16", layers: int = 0) -> dict[str, Any]:
    """A built-in shape's config.json, with ``layers`` decoder layers (0: all) and, for a
    quantized ``checkpoint``, its ``quantization_config``."""
    from vllm_kt_plugin.settings.model_memory import moe_layer_indices
    from vllm_kt_tools.support.quantized_checkpoints import fp8_block_config

    config = dict(SHAPES[shape])
    if layers:
        config["num_hidden_layers"] = layers
    if checkpoint == "fp8-block":
        config["quantization_config"] = fp8_block_config(moe_layer_indices(config))
    return config


def prepare_model(args: argparse.Namespace, workdir: Path) -> tuple[str, str, dict[str, Any]]:
    """(model dir, load_format, config): a built-in shape is written as a config-only dir."""
    if args.model:
        hf_config = json.loads((Path(args.model) / "config.json").read_text())
        has_weights = any(Path(args.model).glob("*.safetensors"))
        return args.model, "auto" if has_weights else "dummy", hf_config
    hf_config = shape_config(args.shape, args.checkpoint, args.layers)
    suffix = ("" if args.checkpoint == "bf16" else f"-{args.checkpoint}") + (f"-{args.layers}l" if args.layers else "")
    model_dir = workdir / f"model-{args.shape}{suffix}"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    if not (model_dir / "tokenizer.json").exists():  # `vllm serve` and `vllm bench serve` need one
        write_numbered_tokenizer(model_dir, hf_config["vocab_size"])
    return str(model_dir), "dummy", hf_config
