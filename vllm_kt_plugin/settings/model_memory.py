"""How many bytes a MoE model's weights take, estimated from its Hugging Face config.

Used to size the GPU expert budget (``KT_NUM_GPU_EXPERTS=auto``, the preset tables) and
the RAM the CPU experts need (``vllm-kt doctor``) before any weight is read. Estimates
count the large matrices only (projections, experts, embeddings, routers); norms and
biases are a rounding error next to them.

Conventions: 1 GB here is 2**30 bytes (``settings.catalogue.GIB``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, KT_GPU_LAYOUT_WRITERS, UNQUANTIZED

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}

# Bytes per weight of the CPU experts in each kt-kernel method's format, scales included
# (approximate: group/block scales add a few percent at most).
KT_METHOD_BYTES_PER_WEIGHT: dict[str, float] = {
    "BF16": 2.0,
    "FP8": 1.0 + 4 / (128 * 128),
    "FP8_PERCHANNEL": 1.0,
    "MXFP8": 1.0 + 1 / 32,
    "AMXINT8": 1.0,
    "MOE_INT8": 1.0,
    "AMXINT4": 0.5 + 4 / 128,
    "MOE_INT4": 0.5 + 4 / 128,
    "RAWINT4": 0.5 + 2 / 32,
    "GPTQ_INT4": 0.5 + 4 / 128,  # kt-kernel keeps the scales as float32
    "SYCL_GPTQ_INT4": 0.5 + 4 / 128,
    "MXFP4": 0.5 + 1 / 32,
    "NVFP4": 0.5 + 1 / 16,
}


class ModelConfigError(ValueError):
    """A model config lacks a field the estimate needs; the message names it."""


@dataclass(frozen=True)
class ModelMemory:
    """Weight sizes of one model as vLLM places it on one GPU (tensor parallel size 1)."""

    num_experts: int  # routed experts per MoE layer
    moe_layers: tuple[int, ...]  # decoder layer indices that have routed experts
    expert_params: int  # weights of one routed expert (gate, up, down)
    expert_bytes: int  # one routed expert on the GPU, in the checkpoint's format
    non_expert_bytes: int  # everything else vLLM puts on the GPU
    quantized: bool = False  # the checkpoint declares a quantization_config
    block_fp8: bool = False  # ... fp8 with block scales (DeepSeek-V3, Qwen3-*-FP8)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def gpu_bytes(self, gpu_experts_per_layer: int) -> int:
        """GPU weight bytes with ``gpu_experts_per_layer`` experts kept in each MoE layer."""
        return self.non_expert_bytes + gpu_experts_per_layer * self.num_moe_layers * self.expert_bytes

    def stage(self, layers: range, num_layers: int) -> ModelMemory:
        """What one pipeline stage, holding decoder ``layers`` of ``num_layers``, puts on its
        GPU: its own MoE layers, and the other weights in proportion (embedding and head,
        which sit on the first and last stage, spread evenly)."""
        return replace(
            self,
            moe_layers=tuple(i for i in self.moe_layers if i in layers),
            non_expert_bytes=self.non_expert_bytes * len(layers) // max(1, num_layers),
        )

    @property
    def checkpoint_format(self) -> str:
        return BLOCK_FP8 if self.block_fp8 else UNQUANTIZED if not self.quantized else "quantized"

    def written_back(self, kt_method: str) -> bool:
        """Whether kt-kernel writes this checkpoint's experts back in the GPU layout with
        ``kt_method`` (``KT_GPU_LAYOUT_WRITERS``): staging then keeps no host copy."""
        return KT_GPU_LAYOUT_WRITERS.get(kt_method.upper()) == self.checkpoint_format

    def cpu_expert_bytes(self, kt_method: str) -> int | None:
        """RAM kt-kernel needs for the experts: it loads every expert of each layer (the
        GPU ones too). None when the method's size is unknown (LLAMAFILE: per GGUF type)."""
        per_weight = KT_METHOD_BYTES_PER_WEIGHT.get(kt_method.upper())
        if per_weight is None:
            return None
        return int(per_weight * self.expert_params * self.num_experts * self.num_moe_layers)


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of a model as kt-kernel sees them (full, unsplit widths)."""

    moe_layers: tuple[int, ...]
    num_experts: int
    hidden_size: int
    intermediate_size: int


def expert_shape(config: Mapping[str, Any]) -> ExpertShape:
    text_config = _text_config(config)
    return ExpertShape(
        moe_layers=moe_layer_indices(text_config),
        num_experts=num_routed_experts(text_config),
        hidden_size=_required(text_config, "hidden_size"),
        intermediate_size=_required(text_config, "moe_intermediate_size", "intermediate_size"),
    )


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal configs nest the language model under ``text_config``."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        return {**text, "quantization_config": config.get("quantization_config") or text.get("quantization_config")}
    return config


def _required(config: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = config.get(name)
        if value is not None:
            return int(value)
    raise ModelConfigError(f"model config has none of {', '.join(names)}; cannot estimate its weight sizes")


def num_routed_experts(config: Mapping[str, Any]) -> int:
    return _required(_text_config(config), "n_routed_experts", "num_experts", "num_local_experts")


def moe_layer_indices(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Decoder layers with routed experts, by the rules of DeepSeek/GLM
    (``first_k_dense_replace``, ``moe_layer_freq``), MiMo-V2 (``moe_layer_freq`` a flag per
    layer), Qwen-MoE (``decoder_sparse_step``, ``mlp_only_layers``) and Mixtral (every layer)."""
    text_config = _text_config(config)
    layers = _required(text_config, "num_hidden_layers")
    flags = text_config.get("moe_layer_freq")
    if isinstance(flags, (list, tuple)):  # MiMo-V2: vLLM's mimo_v2.is_moe_layer reads it per layer
        return tuple(i for i in range(min(layers, len(flags))) if flags[i])
    first_dense = int(text_config.get("first_k_dense_replace") or 0)
    every = int(flags or text_config.get("decoder_sparse_step") or 1)
    dense_only = set(text_config.get("mlp_only_layers") or ())
    if "decoder_sparse_step" in text_config:  # Qwen: layer i is sparse when (i + 1) % step == 0
        return tuple(i for i in range(layers) if i not in dense_only and (i + 1) % every == 0)
    return tuple(i for i in range(first_dense, layers) if i not in dense_only and (i - first_dense) % every == 0)


def dtype_bytes(config: Mapping[str, Any]) -> int:
    name = str(_text_config(config).get("torch_dtype") or config.get("dtype") or "bfloat16")
    name = name.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ModelConfigError(f"model config dtype {name!r} is not one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def linear_bytes_per_weight(config: Mapping[str, Any], *, experts: bool = True) -> float:
    """Bytes per weight of the checkpoint's routed experts (``experts``) or of its other
    linear layers, from ``quantization_config``: fp8 with its block scales; GPTQ/AWQ n-bit
    with group scales and zeros; compressed-tensors with its group's scales, and the model
    dtype for layers its ``ignore`` list leaves unquantized (Kimi-K2-Thinking quantizes
    only the routed experts); else the model dtype."""
    quant = _text_config(config).get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        block = quant.get("weight_block_size")
        return 1.0 + (4 / (block[0] * block[1]) if block else 0.0)
    if method == "compressed-tensors":
        weights = next(iter((quant.get("config_groups") or {}).values()), {}).get("weights") or {}
        if not weights or (not experts and _ignores_attention(quant.get("ignore") or ())):
            return float(dtype_bytes(config))
        bits, group = int(weights.get("num_bits", 16)), int(weights.get("group_size") or 0)
        return bits / 8 + (2 / group if group > 0 else 0.0)  # BF16 scale per group
    bits = quant.get("bits") or quant.get("w_bit")
    if bits:
        group_size = int(quant.get("group_size") or quant.get("q_group_size") or 128)
        return int(bits) / 8 + (2 + int(bits) / 8) / max(group_size, 1)  # FP16 scale and packed zero per group
    return float(dtype_bytes(config))


def _ignores_attention(ignore: Any) -> bool:
    """Whether a compressed-tensors ``ignore`` list names attention projections (by name
    or ``re:`` pattern)."""
    return any("attn" in str(entry) for entry in ignore)


def _attention_params(text_config: Mapping[str, Any], hidden: int) -> int:
    """Projection weights of one attention layer: MLA (DeepSeek, Kimi) or GQA/MHA."""
    heads = _required(text_config, "num_attention_heads")
    if text_config.get("kv_lora_rank"):
        nope, rope = _required(text_config, "qk_nope_head_dim"), _required(text_config, "qk_rope_head_dim")
        v_dim, kv_rank = _required(text_config, "v_head_dim"), _required(text_config, "kv_lora_rank")
        q_rank = text_config.get("q_lora_rank")
        q = q_rank * (hidden + heads * (nope + rope)) if q_rank else hidden * heads * (nope + rope)
        return q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * hidden
    head_dim = int(text_config.get("head_dim") or hidden // heads)
    kv_heads = int(text_config.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def estimate_model_memory(config: Mapping[str, Any]) -> ModelMemory:
    """Weight sizes from a config.json dict.

    expert = 3 * hidden * moe_intermediate weights (gate, up, down); non-expert = attention
    of every layer + dense MLPs of the dense layers + shared experts + routers + embeddings
    (+ an untied lm_head). Linear weights use the checkpoint's quantized size, embeddings
    and routers the model dtype.
    """
    text_config = _text_config(config)
    hidden = _required(text_config, "hidden_size")
    num_layers = _required(text_config, "num_hidden_layers")
    experts = num_routed_experts(text_config)
    moe_layers = moe_layer_indices(text_config)
    expert_inter = _required(text_config, "moe_intermediate_size", "intermediate_size")
    dense_inter = int(text_config.get("intermediate_size") or expert_inter)
    shared_inter = int(text_config.get("n_shared_experts") or 0) * expert_inter + int(
        text_config.get("shared_expert_intermediate_size") or 0
    )
    vocab = _required(text_config, "vocab_size")

    expert_params = 3 * hidden * expert_inter
    linear_params = (
        num_layers * _attention_params(text_config, hidden)
        + (num_layers - len(moe_layers)) * 3 * hidden * dense_inter
        + len(moe_layers) * 3 * hidden * shared_inter
    )
    plain_params = len(moe_layers) * experts * hidden + vocab * hidden * (
        1 if text_config.get("tie_word_embeddings") else 2
    )
    per_expert, per_linear = linear_bytes_per_weight(config), linear_bytes_per_weight(config, experts=False)
    quant = text_config.get("quantization_config") or {}
    per_plain = dtype_bytes(config)
    return ModelMemory(
        num_experts=experts,
        moe_layers=moe_layers,
        expert_params=expert_params,
        expert_bytes=int(expert_params * per_expert),
        non_expert_bytes=int(linear_params * per_linear + plain_params * per_plain),
        quantized=bool(quant),
        block_fp8=experts_format(quant) == BLOCK_FP8,
    )


def experts_format(quant_config: Mapping[str, Any] | None) -> str:
    """The routed experts' format as staging names it, from the checkpoint's
    ``quantization_config``: UNQUANTIZED, BLOCK_FP8 (fp8 with block scales), or "quantized"."""
    if not quant_config:
        return UNQUANTIZED
    block_fp8 = str(quant_config.get("quant_method", "")).lower() == "fp8" and quant_config.get("weight_block_size")
    return BLOCK_FP8 if block_fp8 else "quantized"
