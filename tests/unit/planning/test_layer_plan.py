"""The per-layer plan (``planning/layer_plan.py``) as the layers vLLM builds read it: the
placement KT_EXPERT_PLACEMENT names, the count KT_NUM_GPU_EXPERTS=auto fits, and the model's
staging plan."""

from __future__ import annotations

from kt_testing.hybrid_layers import E, expert_numel, kt_config

from vllm_kt_tools.support.moe_layers import (
    HIDDEN,
    INTER,
    build_moe,
    fresh_layer_index,
)


def test_layers_follow_kt_expert_placement(vllm_layer_context) -> None:
    """KT_EXPERT_PLACEMENT reaches the layers vLLM builds: a seeded random subset here."""
    from vllm_kt_plugin.planning.placement import random_gpu_experts

    config = kt_config(kt_num_gpu_experts="3", kt_expert_placement="random", kt_expert_placement_seed="7")
    idx = fresh_layer_index()
    layer = build_moe(config, layer_idx=idx).routed_experts
    method = layer.quant_method
    expected = random_gpu_experts(E, 3, seed=7, layer_idx=idx)
    assert method.placement.gpu_mask.nonzero().flatten().tolist() == expected != [0, 1, 2]
    assert expert_numel(layer) == 3 * (3 * INTER * HIDDEN)


def test_auto_fits_the_gpu_experts_to_the_granted_memory(vllm_layer_context) -> None:
    """KT_NUM_GPU_EXPERTS=auto with a faked device size (KT_GPU_MEMORY_GB): the count is
    what fits beside the non-expert weights, for layers of the configured model."""
    from vllm_kt_plugin.settings.model_memory import estimate_model_memory

    memory = estimate_model_memory(vllm_layer_context.model_config.hf_config.to_dict())
    utilization = vllm_layer_context.cache_config.gpu_memory_utilization
    # Room for exactly 5 experts per layer (plus half an expert) after the non-expert weights.
    room = memory.non_expert_bytes + 5.5 * memory.num_moe_layers * memory.expert_bytes
    gib = room / utilization / 2**30
    config = kt_config(kt_num_gpu_experts="auto", kt_gpu_memory_gb=f"{gib:.9f}", kt_kv_cache_reserve_gb="0")
    method = build_moe(config, layer_idx=memory.moe_layers[0]).routed_experts.quant_method
    assert method.placement.num_gpu_experts == 5


def test_the_model_staging_plan_is_planned_once_for_the_layers(vllm_layer_context) -> None:
    """The plan keeps the model's staging plan, made when the first layer is planned (the
    device and host known), and the layers read it: on vLLM's CPU build auto stays off
    (no CUDA device, said nowhere), a number stages the whole layer."""
    from vllm_kt_plugin.hybrid.staging.plan import NO_CUDA_DEVICE, OFF, WHOLE_LAYER_PATH

    auto = kt_config(kt_backend="torch", kt_num_gpu_experts="2")
    assert auto.layer_plan.staging.why_off == "not planned yet"
    build_moe(auto, layer_idx=fresh_layer_index())
    assert (auto.layer_plan.staging.path, auto.layer_plan.staging.why_off) == (OFF, NO_CUDA_DEVICE)
    fixed = kt_config(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="12")
    build_moe(fixed, layer_idx=fresh_layer_index())
    assert (fixed.layer_plan.staging.path, fixed.layer_plan.staging.min_tokens) == (WHOLE_LAYER_PATH, 12)
