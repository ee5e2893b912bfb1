"""How to make a tiny model of each MoE architecture: its config class and what to shrink.

A recipe names the ``model_type`` whose config class (transformers' or vLLM's) the tiny
config is built from; ``shrink`` makes every size that config class has tiny (the keys it
lacks are left alone), then the recipe's own overrides apply (layer patterns, routing
options, sizes a kernel needs). Weights come from transformers' model class of that
config (``hf_class``), random, unless the recipe says otherwise (``checkpoint``).

Sizes: hidden 128 and heads of 32 satisfy vLLM's CPU attention and kt-kernel's BF16
kernels; MLA keeps kv_lora_rank 512 + qk_rope_head_dim 64 (vLLM's CPU MLA kernel takes
only a 576-wide head). 8 experts, top-2, so that half the experts are 4.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kt_tools.support.tiny_models import PLAIN_ROPE_AS_YARN

NUM_EXPERTS = 8
TOP_K = 2
HIDDEN = 128

# key -> tiny value, applied to a config (or its text config) wherever the key exists and
# is set (None stays None: e.g. q_lora_rank None means "no q compression").
_SHRINK: Mapping[str, Any] = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "intermediate_size": 256,
    "ffn_hidden_size": 256,
    "intermediate_size_mlp": 256,
    "dense_intermediate_size": 256,
    "moe_intermediate_size": 64,
    "expert_ffn_hidden_size": 64,
    "shared_expert_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "num_attention_heads": 4,
    "n_heads": 4,
    "head_dim": 32,
    "num_experts": NUM_EXPERTS,
    "n_routed_experts": NUM_EXPERTS,
    "num_local_experts": NUM_EXPERTS,
    "moe_num_experts": NUM_EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_experts_per_token": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "moe_top_k": TOP_K,
    "top_k_experts": TOP_K,
    "kv_lora_rank": 512,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 512,
    "sliding_window": 64,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}
# Per-layer lists that shrink with the layer count (their first N entries, unless the
# recipe gives its own pattern).
_PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types", "no_rope_layers", "num_attention_heads_per_layer")
_LAYER_COUNTS = ("num_hidden_layers", "n_layers", "num_layers")


@dataclass(frozen=True)
class Recipe:
    """A tiny model of one registry architecture."""

    model_type: str  # the config class's model_type (AutoConfig.for_model, or vLLM's config registry)
    config: Mapping[str, Any] = field(default_factory=dict)  # overrides of the (text) config
    layers: int = 2
    outer: Mapping[str, Any] = field(default_factory=dict)  # overrides of a multimodal config's outer level
    hf_class: str | None = None  # transformers' model class, where not the architecture's own name
    # keys added to the written config.json (None: removed): what vLLM reads of the
    # architecture's released config where transformers' class keeps it under other names
    config_json: Mapping[str, Any] = field(default_factory=dict)
    # tensor-name parts renamed after saving (transformers' part: the released checkpoint's),
    # where transformers' save_pretrained writes a name vLLM's loader does not read (None: the
    # tensors holding that part are dropped, where the released checkpoint has none)
    renames: Mapping[str, str | None] = field(default_factory=dict)
    float32: bool = True  # plain vLLM runs this model in float32 (False: the measured reason is in notes)
    notes: str = ""
    # Training steps where checkpoint.TRAIN_STEPS leave a greedy step near a tie (the reason by
    # the recipe). Not in the repr: the cache key names the steps used (checkpoint_dir).
    train_steps: int | None = field(default=None, repr=False)
    # vllm.general_plugins the plain-vLLM reference loads (REFERENCE_PLUGINS: why), where vLLM's
    # CPU build cannot run the architecture alone. Not in the repr: the weights do not depend on it.
    reference_plugins: tuple[str, ...] = field(default=(), repr=False)
    # The next four shape the checkpoint but stay out of the repr: checkpoint.checkpoint_dir adds
    # them to the cache key only where set, so the other recipes' cached models keep their keys.
    # transformers' image processor class, or processor class (its parts' defaults: an audio
    # feature extractor too), whose config the checkpoint carries (vLLM's multimodal models load
    # it at start even for text prompts: checkpoint.write_processor)
    image_processor: str | None = field(default=None, repr=False)
    # special tokens added to the tiny tokenizer, where vLLM's renderer of the architecture
    # looks them up at start
    special_tokens: tuple[str, ...] = field(default=(), repr=False)
    # tokenizer attributes (transformers' extra special tokens, added too) -> token, where vLLM's
    # processor of the architecture reads one (Aria's: tokenizer.image_token)
    named_tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    # config keys (outer level) -> the added token whose id they hold (e.g. the image token's index)
    token_ids: Mapping[str, str] = field(default_factory=dict, repr=False)
    # tensor-name parts whose tensors' last two dimensions are swapped after saving, where the
    # released checkpoint stores fused experts (in, out) and transformers' save writes (out, in)
    transposed: tuple[str, ...] = field(default=(), repr=False)
    # The saved tensor names are the released checkpoint's own (no renames needed): a KeyError
    # of plain vLLM's loader on them is vLLM's, not the recipe's (run.plain_failure_reason).
    # Not in the repr: the weights do not depend on it.
    released_names: bool = field(default=False, repr=False)


def shrink(values: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The config ``values`` with every size in ``_SHRINK`` tiny and ``layers`` layers."""
    out = dict(values)
    for key, tiny in _SHRINK.items():
        if out.get(key) is not None:
            out[key] = tiny
    heads = out.get("num_attention_heads") or out.get("n_heads")
    kv = values.get("num_key_value_heads")
    if kv is not None and heads:
        # MHA stays MHA; GQA gets 2 KV heads
        out["num_key_value_heads"] = heads if kv == values.get("num_attention_heads") else min(2, heads)
    for key in _LAYER_COUNTS:
        if out.get(key) is not None:
            out[key] = layers
    for key in _PER_LAYER:
        if isinstance(out.get(key), list) and len(out[key]) > layers:
            out[key] = out[key][:layers]
    if out.get("n_group") and out["n_group"] > 1:
        out["n_group"], out["topk_group"] = 2, 1
    if out.get("first_k_dense_replace"):
        out["first_k_dense_replace"] = 1
        # a per-layer list the class derived from the released first_k_dense_replace (GLM-5's
        # 3): its first entries are all dense, so it follows the new 1 (else no MoE layer at all)
        if out.get("mlp_layer_types") and set(out["mlp_layer_types"]) <= {"dense", "sparse"}:
            out["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    if out.get("kv_lora_rank") and out.get("qk_rope_head_dim") is not None:  # MLA: derived widths follow
        if "qk_head_dim" in out:
            out["qk_head_dim"] = out.get("qk_nope_head_dim", 0) + out["qk_rope_head_dim"]
        if "head_dim" in out:
            out["head_dim"] = out["qk_rope_head_dim"]
    return out


# Measured on vLLM 0.32's CPU build (../shared/FACTS.md): its gated-delta-net attention kernel
# refuses float32 ("CPU GDN attention requires BF16").
# Qwen3-Next and Qwen3.5's hybrid layout: linear attention (Gated DeltaNet) beside full attention.
_GATED_DELTANET = {
    "layer_types": ["linear_attention", "full_attention"],
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_GDN_BF16 = "vLLM's CPU build: \"CPU GDN attention requires BF16\" (Qwen3-Next's linear attention)"
# Qwen4-Exp: Qwen3.5's hybrid layout with hyper-connections (hc_*) and a token indexer (QSA) on
# its full-attention layers (one key head; the budget a multiple of the block), no per-layer n-gram
# embeddings (ple_layer_ids empty)
_QWEN4_EXP = {
    **_GATED_DELTANET,
    "layer_types": ["linear_attention", "indexed_attention"],
    "hc_lowrank": 32,
    "ple_embed_dim": None,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
    # vLLM's linear attention reads the released config's key, which transformers' default leaves
    # unset ("unsupported output_gate_type=None", 2026-12-07-33.json); silu: transformers' default
    "output_gate_type": "silu",
}

_DEEPSEEK_V3 = {
    "topk_method": "noaux_tc",
    "n_group": 2,
    "topk_group": 1,
    "rope_parameters": dict(PLAIN_ROPE_AS_YARN),  # MLA on vLLM's CPU build (tiny_models.py)
}

_NEMOTRON_H = {
    "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
    "mamba_num_heads": 4,
    "mamba_head_dim": 32,
    "ssm_state_size": 16,
    "n_groups": 1,
    "chunk_size": 64,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
}

_JAMBA = {
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "mamba_dt_rank": 8,
    "mamba_d_state": 16,
    "use_mamba_kernels": False,
}
_INKLING_TOKENS = tuple(
    f"<|{name}|>"
    for name in (
        "message_user",
        "message_model",
        "message_system",
        "message_tool",
        "content_text",
        "content_image",
        "content_model_end_sampling",
        "content_thinking",
        "content_audio_input",
        "content_xml",
        "content_invoke_tool_json",
        "end_message",
        "audio_end",
    )
)
# Aria's vision tower (idefics3's) at its smallest: the check feeds text only
_ARIA_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2}
# what vLLM's Aria processor loads at start, text prompts too: the image processor's config and
# the tokenizer's image token (2026-12-07-20.json, 2026-12-07-21.json: "Can't load image processor",
# "TokenizersBackend has no attribute image_token"), whose id the config's image_token_index holds
_ARIA_INPUTS: dict[str, Any] = {
    "image_processor": "AriaImageProcessor",
    "named_tokens": {"image_token": "<|img|>"},
    "token_ids": {"image_token_index": "<|img|>"},
}
_MIMO_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Qwen3-VL's vision tower (Qwen3-VL-MoE's, Qwen3.5's) at its smallest: the check feeds text only;
# its output feeds the text model (out_hidden_size = HIDDEN)
_QWEN3_VISION = {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "out_hidden_size": HIDDEN}
# vLLM's Qwen3-VL processor loads the image processor's config at start, text prompts too
_QWEN3_VL_INPUTS: dict[str, Any] = {"image_processor": "Qwen2VLImageProcessor"}

# Our plugins a plain-vLLM reference may load (Recipe.reference_plugins) -> why; each fixes
# vLLM's CPU build alone, registering nothing of kt-hybrid (pyproject.toml's entry points).
CPU_ROUTER = "kt_cpu_router"
REFERENCE_PLUGINS: Mapping[str, str] = {
    CPU_ROUTER: "vLLM's CPU router lacks sigmoid top-k without groups",
}

# Architecture (registry name) -> its recipe. Overrides say why where not obvious.
RECIPES: dict[str, Recipe] = {
    "Qwen3MoeForCausalLM": Recipe("qwen3_moe", {"norm_topk_prob": True}),
    "MixtralForCausalLM": Recipe("mixtral"),
    "Qwen2MoeForCausalLM": Recipe("qwen2_moe", {"layer_types": ["full_attention"] * 2}),
    "OlmoeForCausalLM": Recipe("olmoe"),
    # vLLM reads these of MiniMax-M2's released config.json; transformers' class lacks them
    "MiniMaxM2ForCausalLM": Recipe(
        "minimax_m2",
        {"rotary_dim": 16, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True},
        reference_plugins=(CPU_ROUTER,),
    ),
    "Glm4MoeForCausalLM": Recipe("glm4_moe", {"n_group": 1, "topk_group": 1, "head_dim": 32}, layers=3),
    "DeepseekV2ForCausalLM": Recipe(
        "deepseek_v2",
        {
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "topk_method": "group_limited_greedy",
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": 64,
        },
        layers=3,
    ),
    "DeepseekV3ForCausalLM": Recipe("deepseek_v3", _DEEPSEEK_V3, layers=3),
    # vLLM converts Mistral Large 3's params.json to this very config (deepseek_v3, architectures
    # MistralLarge3ForCausalLM: transformers_utils/configs/mistral.py); the weights keep transformers'
    # names, which the class's Mistral-name mapper passes unchanged (its patterns are anchored)
    "MistralLarge3ForCausalLM": Recipe("deepseek_v3", _DEEPSEEK_V3, layers=3, hf_class="DeepseekV3ForCausalLM"),
    "Qwen3NextForCausalLM": Recipe(
        "qwen3_next",
        _GATED_DELTANET,
        float32=False,
        notes=_GDN_BF16,
    ),
    "Qwen3_5MoeForCausalLM": Recipe(
        "qwen3_5_moe_text",
        _GATED_DELTANET,
        float32=False,
        notes=_GDN_BF16,
    ),
    # the text part of Qwen3-VL-MoE (Qwen3-MoE's decoder with interleaved M-RoPE) under its vision tower
    "Qwen3VLMoeForConditionalGeneration": Recipe(
        "qwen3_vl_moe",
        # vLLM reads it of the released text config; transformers' class always normalises the top-k
        {"norm_topk_prob": True},
        outer={"vision_config": {**_QWEN3_VISION, "deepstack_visual_indexes": [0]}},
        # the released checkpoints' fused experts, which vLLM loads transposed (qwen3_vl_moe.py:
        # is_fused_checkpoint_transposed): "size of tensor a (64) must match ... (128)", 2026-12-07-33.json
        transposed=(".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"),
        **_QWEN3_VL_INPUTS,
    ),
    "Qwen3_5MoeForConditionalGeneration": Recipe(
        "qwen3_5_moe",
        _GATED_DELTANET,
        outer={"vision_config": _QWEN3_VISION},
        float32=False,
        notes=_GDN_BF16,
        **_QWEN3_VL_INPUTS,
    ),
    # the dense Qwen3.5 (qwen3_5_text: Qwen3_5DecoderLayer builds a dense MLP), a row because its
    # module builds Qwen3.5-MoE too: its config declares no routed experts
    "Qwen3_5ForCausalLM": Recipe("qwen3_5_text", _GATED_DELTANET, float32=False, notes=_GDN_BF16),
    "Qwen3_5ForConditionalGeneration": Recipe(
        "qwen3_5",
        _GATED_DELTANET,
        outer={"vision_config": _QWEN3_VISION},
        float32=False,
        notes=_GDN_BF16,
        **_QWEN3_VL_INPUTS,
    ),
    # its first layer dense, the others MoE with the sparse (indexed) attention of the released config
    "MiniMaxM3SparseForConditionalGeneration": Recipe(
        "minimax_m3_vl",
        {
            "rotary_dim": 16,
            "shared_intermediate_size": 256,  # vLLM sizes the shared expert as intermediate_size x n_shared_experts
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            "index_n_heads": 2,
            "index_block_size": 16,
            "index_topk_blocks": 2,
        },
        layers=3,
        outer={
            "vision_config": _ARIA_VISION,
            "projector_hidden_size": HIDDEN,
            "merged_hidden_size": 4 * _ARIA_VISION["hidden_size"],  # a 2x2 spatial merge of its patches
        },
        # vLLM's processor loads it at start, text prompts too ("Can't load image processor", 2026-12-07-33.json)
        image_processor="MiniMaxM3VLImageProcessor",
        # vLLM's config class of it (transformers_utils/configs/minimax_m3.py) reads the released
        # text config's names, whose defaults are the released 60 layers'; transformers' class
        # computes the SwiGLU-OAI gate inline and writes hidden_act "silu"
        config_json={
            # vLLM's vision tower reads its patch merge here (2026-12-07-35.json); transformers' has spatial_merge_size
            "vision_config": {"img_token_compression_config": {"spatial_merge_size": 2}},
            "text_config": {
                "hidden_act": "swigluoai",
                "partial_rotary_factor": 0.5,
                "moe_layer_freq": [0, 1, 1],
                "sparse_attention_config": {
                    "use_sparse_attention": True,
                    "sparse_index_dim": 128,
                    "sparse_num_index_heads": 2,
                    "sparse_topk_blocks": 2,
                    "sparse_block_size": 16,
                    "sparse_disable_index_value": [0, 1, 1],
                    "sparse_score_type": "max",
                    "sparse_init_block": 0,
                    "sparse_local_block": 1,
                    "sparse_attention_freq": [0, 1, 1],
                },
            },
        },
    ),
    # Gemma 4's dense decoder (gemma4's Gemma4MLP only) under an embedding head: a pooling model in vLLM.
    "EmbeddingGemma2Model": Recipe(
        "embedding_gemma2",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
            "embedding_dim": HIDDEN,
        },
        # vLLM's EmbeddingGemma2Processor loads at start an image, a video and an audio processor
        # ("Can't load feature extractor", 2026-12-07-34.json): the processor's config holds all three
        image_processor="EmbeddingGemma2Processor",
        # transformers' processor reads these tokenizer attributes (Gemma 4's spellings); it adds
        # the video token itself
        named_tokens={
            "image_token": "<|image|>",
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "audio_token": "<|audio|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
        },
        special_tokens=("<|video|>",),
        token_ids={
            "image_token_id": "<|image|>",
            "boi_token_id": "<|image>",
            "eoi_token_id": "<image|>",
            "audio_token_id": "<|audio|>",
            "boa_token_id": "<|audio>",
            "eoa_token_index": "<audio|>",
            "video_token_id": "<|video|>",
        },
    ),
    # NVIDIA's Nemotron-H attention and MLP layers (dense: no MoE layer) under a SigLIP2 vision tower
    "Cosmos3EdgeForConditionalGeneration": Recipe(
        "cosmos3_edge",
        # vLLM's multimodal rope splits the rotary half of the head (16) into mRoPE's t, h, w sections
        {"rope_parameters": {"rope_type": "default", "rope_theta": 100000000.0, "mrope_section": [6, 5, 5]}},
        outer={"vision_config": _ARIA_VISION, "projector_hidden_size": 256},
        # vLLM reads the projector's sizes of the released config's projector_config, which
        # transformers' class keeps as vision_config.hidden_size and projector_hidden_size
        config_json={
            "projector_config": {
                "input_hidden_size": _ARIA_VISION["hidden_size"],
                "spatial_merge_size": 2,
                "merger_intermediate_size": 256,
                "out_hidden_size": HIDDEN,
                "use_postshuffle_norm": False,
            },
        },
        # transformers' save writes the released text names (layers.N.mlp.up_proj, self_attn.to_q),
        # and renames the vision tower's MLP so too, which vLLM's SigLIP2 tower reads as fc1/fc2
        renames={
            "model.visual.encoder.layers.0.mlp.up_proj.": "model.visual.encoder.layers.0.mlp.fc1.",
            "model.visual.encoder.layers.0.mlp.down_proj.": "model.visual.encoder.layers.0.mlp.fc2.",
        },
        # vLLM's processor loads the image and the video processor at start, text prompts too
        image_processor="Cosmos3EdgeProcessor",
        special_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
        token_ids={
            "image_token_id": "<|image_pad|>",
            "video_token_id": "<|video_pad|>",
            "vision_start_token_id": "<|vision_start|>",
            "vision_end_token_id": "<|vision_end|>",
        },
    ),
    "Qwen4ExpForCausalLM": Recipe("qwen4_exp_text", _QWEN4_EXP),
    "Qwen4ExpForConditionalGeneration": Recipe(
        "qwen4_exp",
        _QWEN4_EXP,
        # vLLM's Qwen3-VL tower reads deepstack_visual_indexes, which Qwen4-Exp's vision config lacks
        # (2026-12-07-33.json): none, as transformers' tower has none
        outer={"vision_config": {**_QWEN3_VISION, "deepstack_visual_indexes": []}},
        **_QWEN3_VL_INPUTS,
    ),
    "HYV3ForCausalLM": Recipe(
        "hy_v3",
        {
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "first_k_dense_replace": 1,
            "expert_hidden_dim": 64,
            "route_norm": True,
            # vLLM builds q/k norms only with it (the released config's key); transformers' class always has them
            "qk_norm": True,
        },
        layers=3,
    ),
    "HunYuanMoEV1ForCausalLM": Recipe("hunyuan_v1_moe", {"head_dim": 32, "intermediate_size": 64}),
    "AfmoeForCausalLM": Recipe(
        "afmoe",
        {
            "num_dense_layers": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "score_func": "sigmoid",
            "route_norm": True,
            "n_group": 1,
            "topk_group": 1,
        },
        layers=3,
    ),
    "Cohere2MoeForCausalLM": Recipe(
        "cohere2_moe",
        {"layer_types": ["sliding_attention", "full_attention"], "mlp_layer_types": ["sparse"] * 2, "logit_scale": 1.0},
    ),
    # transformers saves DBRX's experts as the released checkpoints do (``transformer.blocks.N.ffn
    # .experts.mlp.w1``/``v1``/``w2``, the names vLLM's dbrx.py load_weights maps): its KeyError on
    # them (2026-12-07-12.json) is vLLM's loader, which looks the fused name up without the
    # ``routed_experts.`` that FusedMoEFactory's runner puts before its parameters
    "DbrxForCausalLM": Recipe(
        "dbrx",
        {
            # transformers' and vLLM's attention read attn_config.rope_theta, which its defaults lack
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
            "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": NUM_EXPERTS, "moe_top_k": TOP_K},
        },
        released_names=True,
    ),
    "Ernie4_5_MoeForCausalLM": Recipe(
        "ernie4_5_moe",
        {"moe_layer_start_index": 1, "moe_layer_end_index": 2, "moe_num_shared_experts": 1, "head_dim": 32},
        layers=3,
    ),
    "ExaoneMoeForCausalLM": Recipe(
        "exaone_moe",
        {
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "head_dim": 32,
        },
        layers=3,
    ),
    "FlexOlmoForCausalLM": Recipe("flex_olmo"),
    "Gemma4ForCausalLM": Recipe(
        "gemma4_text",
        {
            "enable_moe_block": True,
            "num_experts": NUM_EXPERTS,
            "top_k_experts": TOP_K,
            "moe_intermediate_size": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "per_layer_config": {},
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 512,
        },
    ),
    "GptOssForCausalLM": Recipe("gpt_oss", {"layer_types": ["sliding_attention", "full_attention"]}),
    # 200 steps (loss 0.09) left the chat prompt's 12th greedy step a tie of one bf16 ulp of the
    # logits (0.0625 nats, 2026-12-07-1.json) that kt-hybrid's bf16 rounding closed with either
    # CPU backend (torch: the same flip, drift 0.032; 2026-12-07, 2 cores): trained longer.
    "GraniteMoeForCausalLM": Recipe("granitemoe", train_steps=400),
    "GraniteMoeSharedForCausalLM": Recipe("granitemoeshared", {"shared_intermediate_size": 64}),
    "GraniteMoeSWAForCausalLM": Recipe(
        "granitemoe_swa",
        {"layer_types": ["full_attention", "sliding_attention"], "layer_rope_theta": [10000.0, 10000.0]},
    ),
    "GraniteMoeHybridForCausalLM": Recipe(
        "granitemoehybrid",
        {
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 8,  # x mamba_d_head = mamba_expand (2) x hidden: transformers' check
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 64,
            "shared_intermediate_size": 64,
        },
    ),
    "JambaForCausalLM": Recipe("jamba", _JAMBA),
    # Jamba's decoder under a classification head: vLLM serves it as a pooling model, so the
    # check's greedy generation is refused (2026-12-07-15.json); Jamba's own row says why neither runs
    "JambaForSequenceClassification": Recipe("jamba", _JAMBA, hf_class="JambaForSequenceClassification"),
    "LagunaForCausalLM": Recipe(
        "laguna",
        {
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "num_attention_heads_per_layer": [4, 4, 4],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
        },
        layers=3,
        reference_plugins=(CPU_ROUTER,),
    ),
    "Lfm2MoeForCausalLM": Recipe(
        "lfm2_moe", {"num_dense_layers": 1, "layer_types": ["conv", "full_attention", "conv"]}, layers=3
    ),
    "Llama4ForCausalLM": Recipe(
        "llama4_text",
        {
            "intermediate_size": 64,
            "num_experts_per_tok": 1,
            "moe_layers": [0, 1],
            "no_rope_layers": [1, 0],
            "layer_types": ["chunked_attention", "full_attention"],
            "attention_chunk_size": 128,  # vLLM's chunked local attention: a multiple of its block size
        },
    ),
    "MellumForCausalLM": Recipe(
        "mellum", {"layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["sparse"] * 2}
    ),
    "MiMoV2FlashForCausalLM": Recipe(
        "mimo_v2_flash",
        {
            "head_dim": 64,
            "v_head_dim": 64,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "n_group": 1,
            "topk_group": 1,
            # a whole, even rotary width (the default 0.334 of 64 is 21), one theta for both kinds
            "rope_parameters": {kind: dict(_MIMO_ROPE) for kind in ("full_attention", "sliding_attention")},
            # vLLM reads the released config.json's names of transformers' layer_types,
            # mlp_layer_types and its sliding layers' attention (twice the KV heads, with sinks)
            "hybrid_layer_pattern": [0, 1, 1],
            "moe_layer_freq": [0, 1, 1],
            "layernorm_epsilon": 1e-5,
            "sliding_window_size": 64,
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 4,
            "swa_head_dim": 64,
            "swa_v_head_dim": 64,
            "add_swa_attention_sink_bias": True,
            "rope_theta": _MIMO_ROPE["rope_theta"],
            "swa_rope_theta": _MIMO_ROPE["rope_theta"],
            "partial_rotary_factor": _MIMO_ROPE["partial_rotary_factor"],
        },
        layers=3,
        renames={".self_attn.sinks": ".self_attn.attention_sink_bias"},
    ),
    "NemotronHForCausalLM": Recipe("nemotron_h", _NEMOTRON_H, layers=4),
    # vLLM registers it to NemotronHForCausalLM's class (registry.py): the same model under its own name
    "NemotronHPuzzleForCausalLM": Recipe("nemotron_h", _NEMOTRON_H, layers=4, hf_class="NemotronHForCausalLM"),
    # vLLM's PhiMoE builds the attention projections' and lm_head's biases unconditionally (as the
    # released config: both true); transformers' defaults (false) leave them uninitialised: NaN logits
    "PhiMoEForCausalLM": Recipe("phimoe", {"attention_bias": True, "lm_head_bias": True}, hf_class="PhimoeForCausalLM"),
    "DeepseekV4ForCausalLM": Recipe(
        "deepseek_v4",
        {
            "head_dim": 512,
            "num_key_value_heads": 1,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 64,
            "o_groups": 2,
            "o_lora_rank": 64,
            # DeepGEMM's indexer kernels on SM90 take 32 or 64 heads; FlashMLA's sparse decode
            # takes a top-k that is a multiple of 64 (deepseek_v4/nvidia/flashmla.py)
            "index_n_heads": 64,
            # vLLM's compressor (deepseek_v4/compressor.py) takes only 128 and 512 wide heads
            "index_head_dim": 128,
            "index_topk": 512,
            "compress_ratios": [0, 4, 128],
            "num_hash_layers": 1,
            "layer_types": None,
            "mlp_layer_types": None,
        },
        layers=3,
        # as the released config.json: vLLM's config class (on transformers' base, whose
        # validator takes only sparse/dense MLP layer types) reads these, not transformers' lists
        config_json={
            "compress_ratios": [0, 4, 128],
            "num_hash_layers": 1,
            "expert_dtype": "bf16",
            "topk_method": "noaux_tc",  # vLLM builds the routers' correction biases only with it
            "mlp_layer_types": None,
            "layer_types": None,
        },
        # transformers' HC head (``model.hc_head.hc_fn``) and KV norm (``attn.norm``) are
        # ``hc_head_fn`` and ``attn.kv_norm`` in the released checkpoint, which vLLM's loader reads
        renames={"model.hc_head.hc_": "model.hc_head_", ".attn.norm.": ".attn.kv_norm."},
    ),
    "Glm5NextForConditionalGeneration": Recipe(
        "glm5_next",
        {
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "layer_types": ["linear_attention", "indexed_attention", "linear_attention"],
            "indexer_types": ["full", "full", "full"],
            "linear_head_dim": 32,
            "linear_num_heads": 4,
            "index_head_dim": 128,
            "index_n_heads": 2,
            "index_topk": 32,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "qk_rope_head_dim": 0,
            "qk_head_dim": 64,
        },
        layers=3,
        # the vision tower's defaults weigh 0.9 GB; the check needs only its text part
        outer={
            "vision_config": {
                "depth": 1,
                "hidden_size": 64,
                "num_heads": 2,
                "intermediate_size": 128,
                "out_hidden_size": 128,
                "projection_intermediate_size": 128,
            }
        },
    ),
    # GLM-5 (DeepSeek-V3.2's sparse attention with GLM's MoE)
    "GlmMoeDsaForCausalLM": Recipe(
        "glm_moe_dsa",
        # DeepGEMM's indexer kernels on SM90 take 32 or 64 indexer heads; 512 is the smallest
        # top-k of vLLM's cooperative/persistent top-k kernels (sparse_attn_indexer.py, indexer_topk.py)
        {
            "index_head_dim": 128,
            "index_n_heads": 32,
            "index_topk": 512,
            "n_group": 1,
            "topk_group": 1,
            # vLLM's gate holds e_score_correction_bias only with it (deepseek_v2.py), and
            # transformers' saves one: KeyError on vLLM's CUDA build (cuda-host run 4)
            "topk_method": "noaux_tc",
        },
        layers=3,
        # the per-layer lists left to the config class, which derives them from first_k_dense_replace:
        # transformers 5.17 (the GPU host's) rejects the 5.19 value "indexed_attention"
        config_json={"layer_types": None, "mlp_layer_types": None, "indexer_types": None},
    ),
    "Glm4MoeLiteForCausalLM": Recipe(
        "glm4_moe_lite",
        {"mlp_layer_types": ["dense", "sparse", "sparse"], "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1},
        layers=3,
    ),
    "DeepseekV32ForCausalLM": Recipe(
        "deepseek_v32",
        {
            "index_head_dim": 128,
            "index_n_heads": 2,
            "index_topk": 16,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "topk_method": "noaux_tc",
        },
        layers=3,
    ),
    "KimiLinearForCausalLM": Recipe(
        "kimi_linear",
        {
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_head_dim": 64,
            "linear_num_heads": 2,
            "num_expert_group": 1,
            # vLLM's Kimi MLA asserts it (kimi_k3/nvidia/model.py: "Kimi-K3 MLA ... is NoPE-only",
            # cuda-host run 7); transformers' config class does not write it
            "mla_use_nope": True,
        },
        layers=3,
    ),
    "LongcatFlashForCausalLM": Recipe(
        "longcat_flash",
        {
            "zero_expert_num": 4,
            "ffn_hidden_size": 256,
            "expert_ffn_hidden_size": 64,
            "rope_parameters": dict(PLAIN_ROPE_AS_YARN),  # MLA on vLLM's CPU build (tiny_models.py)
            # vLLM reads these of LongCat's released config.json; transformers' class lacks them
            # (its zero experts pass the input through; it scales no MLA LoRA norm)
            "zero_expert_type": "identity",
            "mla_scale_q_lora": False,
            "mla_scale_kv_lora": False,
        },
        # transformers' save writes gate/up projections of the zero experts (ids 8-11, identity
        # in vLLM and in the released checkpoint, which has no tensors for them)
        renames={f".mlp.experts.{i}.": None for i in range(NUM_EXPERTS, NUM_EXPERTS + 4)},
    ),
    # Every layer sparse: vLLM builds post_mlp_layernorm on dense layers too, which neither
    # transformers nor (per transformers' AXK1 docstring) the released checkpoints write for them
    # ("weights were not initialized: model.layers.0.post_mlp_layernorm.weight", 2026-12-07-15.json)
    "AXK1ForCausalLM": Recipe(
        "axk1",
        {
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "rope_parameters": dict(PLAIN_ROPE_AS_YARN),  # MLA on vLLM's CPU build (tiny_models.py)
        },
        layers=3,
    ),
    # gpt-oss's decoder under a token-classification head: a pooling model in vLLM (as Jamba's classifier)
    "OpenAIPrivacyFilterForTokenClassification": Recipe("openai_privacy_filter"),
    "AriaForConditionalGeneration": Recipe(
        "aria", {"moe_num_shared_experts": 1}, outer={"vision_config": _ARIA_VISION}, **_ARIA_INPUTS
    ),
    # vLLM's Transformers backend under its own registry names: the tiny config names the
    # backend class (vLLM resolves it as it would a model run with --model-impl transformers);
    # transformers' class of the wrapped model writes the weights
    # transformers' classifier head is ``score`` (Qwen3-MoE's and most decoders' released
    # classifiers), which vLLM's backend holds as ``classifier`` and does not map (2026-12-07-23.json)
    "TransformersMoEForSequenceClassification": Recipe(
        "qwen3_moe", {"norm_topk_prob": True}, hf_class="Qwen3MoeForSequenceClassification", released_names=True
    ),
    "TransformersMoEEmbeddingModel": Recipe("qwen3_moe", {"norm_topk_prob": True}, hf_class="Qwen3MoeModel"),
    "TransformersMultiModalMoEForCausalLM": Recipe(
        "aria",
        {"moe_num_shared_experts": 1},
        outer={"vision_config": _ARIA_VISION},
        hf_class="AriaForConditionalGeneration",
        **_ARIA_INPUTS,
    ),
    "InklingForCausalLM": Recipe(
        "inkling_text",
        {
            "layer_types": ["hybrid_sliding", "hybrid"],
            "mlp_layer_types": ["sparse", "sparse"],
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2,
            "swa_head_dim": 32,
            "sliding_window_size": 64,
            "n_shared_experts": 1,
            "rel_extent": 64,
        },
        # vLLM's Inkling renderer (renderers/inkling_encoding.py SPECIAL_TOKEN_SPELLINGS) refuses a
        # tokenizer without them ("Inkling tokenizer is missing special tokens", 2026-12-07-20.json)
        special_tokens=_INKLING_TOKENS,
        # vLLM's config class of it (vllm/models/inkling/configs.py, which reads transformers' keys
        # too): with transformers' InklingTextConfig vLLM's model finds no padded_vocab_size
        # transformers' class always builds the embedding norm, the K/V short convolutions, the
        # routers' global scale and correction bias, and routes by sigmoid: vLLM builds them on these
        config_json={
            "model_type": "inkling_model",
            "use_embed_norm": True,
            "use_sconv": True,
            "use_global_scale": True,
            "use_gate_bias": True,
            "gate_activation": "sigmoid",
        },
    ),
    "HYV4ForCausalLM": Recipe(
        "hy_v4",
        {
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "layer_types": ["indexed_attention"] * 3,
            "indexer_types": ["full", "full", "shared"],
            "index_head_dim": 128,
            "index_n_heads": 2,
            "index_topk": 16,
            "n_group": 1,
            "topk_group": 1,
        },
        layers=3,
    ),
}


# Drafts and multimodal wrappers that take a served architecture's row: their module imports
# the base's module and builds its decoder layers (so its MoE layer class) on the base's
# config (tests/unit/test_supported_models.py checks the import; the row is taken only while
# the base is served).
_MTP = "an MTP draft built of the base's decoder layers"
_EAGLE = "an EAGLE draft built of the base's decoder layers"
_TEXT = "a multimodal wrapper whose text model is the base's"
_DFLASH = "a DFlash draft built of the base's decoder layers"
TAKES_ROW_OF: dict[str, tuple[str, str]] = {
    "DeepSeekMTPModel": ("DeepseekV3ForCausalLM", _MTP),
    "EagleDeepSeekMTPModel": ("DeepseekV3ForCausalLM", _EAGLE),
    "Eagle3DeepseekV2ForCausalLM": ("DeepseekV2ForCausalLM", _EAGLE),
    "Eagle3DeepseekV3ForCausalLM": ("DeepseekV3ForCausalLM", _EAGLE),
    "Glm4MoeMTPModel": ("Glm4MoeForCausalLM", _MTP),
    "ExaoneMoeMTP": ("ExaoneMoeForCausalLM", _MTP),
    "HYV3MTPModel": ("HYV3ForCausalLM", _MTP),
    "Gemma4MTPModel": ("Gemma4ForCausalLM", _MTP),
    "Qwen3NextMTP": ("Qwen3NextForCausalLM", _MTP),
    "NemotronHMTPModel": ("NemotronHForCausalLM", _MTP),  # served on the CUDA build (cuda-host/)
    "EagleLlama4ForCausalLM": ("Llama4ForCausalLM", _EAGLE),
    # Mistral Large 3 is DeepSeek-V3 (vLLM converts its config to deepseek_v3): its draft builds deepseek_v2's layers
    "EagleMistralLarge3ForCausalLM": ("DeepseekV3ForCausalLM", _EAGLE),
    "DFlashLagunaForCausalLM": ("LagunaForCausalLM", _DFLASH),
    "Llama4ForConditionalGeneration": ("Llama4ForCausalLM", _TEXT),
    "Gemma4ForConditionalGeneration": ("Gemma4ForCausalLM", _TEXT),
    # the wrappers' language models are the base's class (gemma4_unified names it; nano_nemotron_vl
    # builds the text config's architecture and casts it to NemotronHForCausalLM; the thinker's
    # Qwen3MoeLLMModel subclasses Qwen3MoeModel, adding only the vision tower's deepstack inputs)
    "Gemma4UnifiedForConditionalGeneration": ("Gemma4ForCausalLM", _TEXT),
    "MiMoV2OmniForCausalLM": ("MiMoV2FlashForCausalLM", _TEXT),
    "Qwen3OmniMoeForConditionalGeneration": ("Qwen3MoeForCausalLM", _TEXT),
    **{
        arch: ("NemotronHForCausalLM", _TEXT)  # served on the CUDA build (cuda-host/)
        for arch in (
            "NemotronH_Nano_VL_V2",
            "NemotronH_Nano_Omni_Reasoning_V3",
            "NemotronH_Omni_Reasoning_V3",
            "NemotronH_Super_Omni_Reasoning_V3",
        )
    },
    # its MTP layers are qwen3_5's Qwen3_5DecoderLayer on the base's (qwen3_5_moe_text) config
    "Qwen3_5MoeMTP": ("Qwen3_5MoeForCausalLM", _MTP),
}
_SUBCLASS = "a subclass of the base's class in its module (its own packed-modules mapping only)"
TAKES_ROW_OF["MiMoV2ForCausalLM"] = ("MiMoV2FlashForCausalLM", _SUBCLASS)

# Drafts and wrappers that run only beside or around their base (an MTP/DFlash draft is a
# speculative head of its target; a multimodal wrapper builds the base's text model): where
# the base cannot be checked here, neither can they, for the base's measured reason; where the
# base is not checked yet, they follow it once it is (supported_models.rows). A served base's
# row is taken only through TAKES_ROW_OF (its MoE layer class reused).
_DRAFT = "an MTP draft"
_WRAPPER = "a multimodal wrapper"
DRAFT_OF: dict[str, tuple[str, str]] = {
    "BailingMoeV25MTPModel": ("BailingMoeV2_5ForCausalLM", _DRAFT),
    "BailingMoeV3MTPModel": ("BailingMoeV3ForCausalLM", _DRAFT),
    "DSparkDraftModel": ("DeepseekV4ForCausalLM", "a DSpark draft"),
    "DeepSeekV4MTPModel": ("DeepseekV4ForCausalLM", _DRAFT),
    "DeepseekV4ForConditionalGeneration": ("DeepseekV4ForCausalLM", _WRAPPER),
    "DeepseekV32MTPModel": ("DeepseekV32ForCausalLM", _DRAFT),
    "HYV4MTPModel": ("HYV4ForCausalLM", _DRAFT),
    "InklingMTPModel": ("InklingForCausalLM", _DRAFT),
    "InklingForConditionalGeneration": ("InklingForCausalLM", _WRAPPER),
    "KimiK3MTPModel": ("KimiK3ForConditionalGeneration", _DRAFT),
    "LongCatFlashMTPModel": ("LongcatFlashForCausalLM", _DRAFT),
    # its MTP layers build MiMoV2MLP (dense), not mimo_v2's MoE layer: no row of the served base;
    # nor can its weights be written (transformers' MiMoV2Flash class drops ``model.mtp.``: 2026-12-07-25.json)
    "MiMoV2MTPModel": ("MiMoV2FlashForCausalLM", _DRAFT),
    "MiMoV2OmniMTPModel": ("MiMoV2FlashForCausalLM", _DRAFT),
    # vLLM's speculative config turns pangu_ultra_moe configs into this draft (config/speculative.py)
    "OpenPanguMTPModel": ("PanguUltraMoEForCausalLM", _DRAFT),
    "Step3p5MTP": ("Step3p5ForCausalLM", _DRAFT),
    "BailingMoeV3VLForConditionalGeneration": ("BailingMoeV3ForCausalLM", _WRAPPER),
    "Glm5NextMTPModel": ("Glm5NextForConditionalGeneration", _DRAFT),
    "InternS2MobiusMTP": ("InternS2MobiusForConditionalGeneration", _DRAFT),
    "MiniMaxM3MTP": ("MiniMaxM3SparseForConditionalGeneration", _DRAFT),
    "Qwen4ExpMTP": ("Qwen4ExpForCausalLM", _DRAFT),
    # the dense Qwen3.5's draft (qwen3_5_text: Qwen3_5DecoderLayer builds a dense MLP)
    "Qwen3_5MTP": ("Qwen3_5ForCausalLM", _DRAFT),
}

# The model_type the released checkpoints' config.json names, for architectures with no
# recipe, where vLLM's own code names it (config/speculative.py, its config registry) or
# public copies of the released config.json do (bailing_moe, deepseek): run.unbuildable looks
# its config class up in transformers and in vLLM's config registry, and says which it found.
CONFIG_MODEL_TYPES: dict[str, str] = {
    "BailingMoeForCausalLM": "bailing_moe",
    "BailingMoeV2ForCausalLM": "bailing_moe",
    "BailingMoeV2_5ForCausalLM": "bailing_hybrid",
    "BailingMoeV3ForCausalLM": "bailing_hybrid",
    "DeepseekForCausalLM": "deepseek",
    "KimiK3ForConditionalGeneration": "kimi_k3",
    "PanguUltraMoEForCausalLM": "pangu_ultra_moe",
    "Step3TextForCausalLM": "step3_text",
    "Step3p5ForCausalLM": "step3p5",
}
