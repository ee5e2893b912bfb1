"""KT_NUM_GPU_EXPERTS=auto / KT_GPU_EXPERTS_RATIO: the weight-size estimate matches real
models' parameters, and the budget is the largest count that fits the granted memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from vllm_kt_plugin.planning.gpu_budget import fit_gpu_experts, resolve_num_gpu_experts
from vllm_kt_plugin.settings.catalogue import GIB
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.settings.model_memory import ModelMemory, estimate_model_memory, linear_bytes_per_weight
from vllm_kt_plugin.settings.variables import KTSettings

TINY = {
    "qwen3_moe": transformers.Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        moe_intermediate_size=32,
        intermediate_size=128,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
    ),
    "mixtral": transformers.MixtralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    ),
    "deepseek_v3": transformers.DeepseekV3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "glm4_moe": transformers.Glm4MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_group=1,
        topk_group=1,
    ),
}


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared" not in name


@pytest.mark.parametrize("arch", TINY)
def test_estimate_counts_every_weight_of_the_real_model(arch: str) -> None:
    """Against the transformers model itself (built on the meta device): routed-expert and
    other weights agree exactly, norms and biases aside (the estimate leaves them out)."""
    config = TINY[arch]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = {n: p.numel() for n, p in model.named_parameters()}
    routed = sum(v for n, v in params.items() if _is_routed_expert(n))
    other = sum(v for n, v in params.items() if not _is_routed_expert(n) and "norm" not in n and "bias" not in n)
    memory = estimate_model_memory(config.to_dict())
    assert memory.expert_params * memory.num_experts * memory.num_moe_layers == routed
    assert memory.non_expert_bytes == 2 * other  # bf16
    assert memory.expert_bytes == 2 * memory.expert_params


def test_moe_layers_follow_the_dense_layer_rules() -> None:
    assert estimate_model_memory(TINY["qwen3_moe"].to_dict()).moe_layers == (0, 2)  # mlp_only_layers=[1]
    assert estimate_model_memory(TINY["deepseek_v3"].to_dict()).moe_layers == (1, 2)  # first_k_dense_replace=1
    # MiMo-V2: a flag per layer (an int here raised TypeError in vllm serve's config check)
    mimo = {**TINY["qwen3_moe"].to_dict(), "num_hidden_layers": 4, "moe_layer_freq": [0, 1, 1, 0]}
    del mimo["decoder_sparse_step"]
    assert estimate_model_memory(mimo).moe_layers == (1, 2)


def test_quantized_checkpoints_count_their_stored_bytes() -> None:
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    assert linear_bytes_per_weight(fp8) == pytest.approx(1 + 4 / 128**2)
    assert linear_bytes_per_weight(gptq) == pytest.approx(0.5 + 2.5 / 128)
    assert linear_bytes_per_weight({"torch_dtype": "float32"}) == 4


def test_compressed_tensors_int4_counts_its_groups_and_what_it_ignores() -> None:
    """Kimi-K2-Thinking's layout: INT4 routed experts with a BF16 scale per 32 weights;
    attention and shared experts in its ignore list stay BF16."""
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    quant = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}
    kimi = {"quantization_config": {**quant, "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}}
    assert linear_bytes_per_weight(kimi) == pytest.approx(0.5 + 2 / 32)
    assert linear_bytes_per_weight(kimi, experts=False) == 2
    everything = {"quantization_config": {**quant, "ignore": ["lm_head"]}}
    assert linear_bytes_per_weight(everything, experts=False) == pytest.approx(0.5 + 2 / 32)


def test_missing_config_field_is_named() -> None:
    with pytest.raises(ValueError, match="n_routed_experts, num_experts, num_local_experts"):
        estimate_model_memory({"hidden_size": 8, "num_hidden_layers": 2, "moe_intermediate_size": 4})


# A model with round numbers: 10 MoE layers of 64 experts, 0.5 GiB per expert, 10 GiB of
# other weights. One expert in every layer takes 5 GiB.
ROUND = ModelMemory(
    num_experts=64, moe_layers=tuple(range(10)), expert_params=0, expert_bytes=GIB // 2, non_expert_bytes=10 * GIB
)


def test_largest_count_that_fits() -> None:
    # 80 GiB x 0.9 = 72 GiB granted - 12 reserve - 10 non-expert = 50 GiB -> 10 experts per layer
    budget = fit_gpu_experts(
        device_total_bytes=80 * GIB, gpu_memory_utilization=0.9, memory=ROUND, kv_cache_reserve_gb=12
    )
    assert budget.num_gpu_experts == 10
    for part in ("80.0 GB device", "72.0 GB granted", "12.0 GB KV-cache reserve", "10.0 GB non-expert", "50.0 GB"):
        assert part in budget.explanation, budget.explanation
    assert "10 of 64 experts per layer" in budget.explanation


def test_one_byte_less_is_one_expert_less() -> None:
    just_fits = int((12 + 10 + 50) * GIB / 0.9) + 1
    assert (
        fit_gpu_experts(
            device_total_bytes=just_fits, gpu_memory_utilization=0.9, memory=ROUND, kv_cache_reserve_gb=12
        ).num_gpu_experts
        == 10
    )
    assert (
        fit_gpu_experts(
            device_total_bytes=just_fits - 2**20, gpu_memory_utilization=0.9, memory=ROUND, kv_cache_reserve_gb=12
        ).num_gpu_experts
        == 9
    )


def test_default_reserve_is_a_fifth_of_the_granted_memory() -> None:
    # 100 GiB x 0.5 = 50 granted - 10 reserve (20%) - 10 non-expert = 30 GiB -> 6 experts
    budget = fit_gpu_experts(device_total_bytes=100 * GIB, gpu_memory_utilization=0.5, memory=ROUND)
    assert budget.num_gpu_experts == 6 and "10.0 GB KV-cache reserve" in budget.explanation


def test_default_reserve_is_at_least_two_gb() -> None:
    # 5 GiB granted: 20% would be 1 GiB, the floor is 2 GiB
    small = fit_gpu_experts(device_total_bytes=5 * GIB, gpu_memory_utilization=1.0, memory=ROUND)
    assert "2.0 GB KV-cache reserve" in small.explanation


def test_everything_fits_caps_at_the_layer_experts() -> None:
    budget = fit_gpu_experts(device_total_bytes=10_000 * GIB, gpu_memory_utilization=0.9, memory=ROUND)
    assert budget.num_gpu_experts == 64


def test_not_even_the_non_expert_weights_fit() -> None:
    budget = fit_gpu_experts(device_total_bytes=8 * GIB, gpu_memory_utilization=0.9, memory=ROUND)
    assert budget.num_gpu_experts == 0 and "alone exceed the granted memory" in budget.explanation


def test_tensor_parallel_splits_the_weights() -> None:
    # per GPU: 72 - 12 - 5 = 55 GiB; one expert per layer 2.5 GiB -> 22
    budget = fit_gpu_experts(
        device_total_bytes=80 * GIB,
        gpu_memory_utilization=0.9,
        memory=ROUND,
        kv_cache_reserve_gb=12,
        tensor_parallel_size=2,
    )
    assert budget.num_gpu_experts == 22 and "tp=2" in budget.explanation


def kt(env: dict[str, str]) -> KTSettings:
    return load_settings(env, cores=16, numa_nodes=1)


def test_auto_uses_the_device_memory() -> None:
    budget = resolve_num_gpu_experts(
        kt({"KT_NUM_GPU_EXPERTS": "auto", "KT_KV_CACHE_RESERVE_GB": "12"}),
        ROUND,
        gpu_memory_utilization=0.9,
        device_total_bytes=80 * GIB,
    )
    assert budget.num_gpu_experts == 10 and budget.explanation.startswith("KT_NUM_GPU_EXPERTS=auto: 80.0 GB")


def test_gpu_memory_gb_replaces_the_measured_size() -> None:
    budget = resolve_num_gpu_experts(
        kt({"KT_NUM_GPU_EXPERTS": "AUTO", "KT_KV_CACHE_RESERVE_GB": "12", "KT_GPU_MEMORY_GB": "80"}),
        ROUND,
        gpu_memory_utilization=0.9,
        device_total_bytes=None,
    )
    assert budget.num_gpu_experts == 10


def test_auto_without_a_gpu_asks_for_a_size() -> None:
    with pytest.raises(KTConfigError) as exc:
        resolve_num_gpu_experts(
            kt({"KT_NUM_GPU_EXPERTS": "auto"}), ROUND, gpu_memory_utilization=0.9, device_total_bytes=None
        )
    message = str(exc.value)
    assert "KT_NUM_GPU_EXPERTS='auto'" in message and "KT_GPU_MEMORY_GB" in message and "allowed" in message


@pytest.mark.parametrize("ratio,expected", [("0", 0), ("0.25", 16), ("0.5", 32), ("1", 64), ("0.3", 19)])
def test_ratio_of_the_layer_experts(ratio: str, expected: int) -> None:
    budget = resolve_num_gpu_experts(
        kt({"KT_GPU_EXPERTS_RATIO": ratio}), ROUND, gpu_memory_utilization=0.9, device_total_bytes=None
    )
    assert budget.num_gpu_experts == expected


def test_explicit_count_passes_through() -> None:
    budget = resolve_num_gpu_experts(
        kt({"KT_NUM_GPU_EXPERTS": "5"}), ROUND, gpu_memory_utilization=0.9, device_total_bytes=80 * GIB
    )
    assert budget.num_gpu_experts == 5


MISTAKES = [
    ({"KT_GPU_EXPERTS_RATIO": "1.5"}, "KT_GPU_EXPERTS_RATIO", "1.5"),
    ({"KT_GPU_EXPERTS_RATIO": "-0.1"}, "KT_GPU_EXPERTS_RATIO", "-0.1"),
    ({"KT_GPU_EXPERTS_RATIO": "half"}, "KT_GPU_EXPERTS_RATIO", "half"),
    ({"KT_GPU_EXPERTS_RATIO": "nan"}, "KT_GPU_EXPERTS_RATIO", "nan"),
    ({"KT_GPU_EXPERTS_RATIO": "0.5", "KT_NUM_GPU_EXPERTS": "4"}, "KT_GPU_EXPERTS_RATIO", "0.5"),
    ({"KT_NUM_GPU_EXPERTS": "automatic"}, "KT_NUM_GPU_EXPERTS", "automatic"),
    ({"KT_KV_CACHE_RESERVE_GB": "-1"}, "KT_KV_CACHE_RESERVE_GB", "-1"),
    ({"KT_GPU_MEMORY_GB": "0"}, "KT_GPU_MEMORY_GB", "0"),
    ({"KT_GPU_MEMORY_GB": "80GB"}, "KT_GPU_MEMORY_GB", "80GB"),
]


@pytest.mark.parametrize("env,variable,value", MISTAKES, ids=[f"{m[1]}={m[2]}" for m in MISTAKES])
def test_budget_variable_mistakes(env: dict[str, str], variable: str, value: str) -> None:
    with pytest.raises(KTConfigError) as exc:
        kt(env)
    message = str(exc.value)
    assert "\n" not in message and f"{variable}={value!r}" in message and "allowed" in message, message


# 48 layers of 128 experts of 1/64 GiB (Qwen3-30B-A3B-like proportions).
LAYERED = ModelMemory(
    num_experts=128, moe_layers=tuple(range(48)), expert_params=0, expert_bytes=GIB // 64, non_expert_bytes=4 * GIB
)


def test_staging_buffers_are_reserved() -> None:
    """With staging on, two buffers of a layer's CPU experts come out of the
    expert room. 72 - 12 - 4 = 56 GiB; without them
    74 experts fit (0.75 GiB each across 48 layers); with them n * 0.75 + 2 * (128 - n) / 64
    <= 56 -> 72."""
    settings = {"KT_NUM_GPU_EXPERTS": "auto", "KT_KV_CACHE_RESERVE_GB": "12", "KT_STAGING_MIN_TOKENS": "2048"}
    on = resolve_num_gpu_experts(kt(settings), LAYERED, gpu_memory_utilization=0.9, device_total_bytes=80 * GIB)
    assert on.num_gpu_experts == 72 and "GB of it for the staging buffers" in on.explanation, on.explanation
    off = resolve_num_gpu_experts(
        kt({**settings, "KT_STAGING_MIN_TOKENS": "0"}),
        LAYERED,
        gpu_memory_utilization=0.9,
        device_total_bytes=80 * GIB,
    )
    assert off.num_gpu_experts == 74 and "staging" not in off.explanation
    quantized = dataclasses.replace(LAYERED, quantized=True)  # staged: unquantized, or block-FP8 with FP8
    assert (
        resolve_num_gpu_experts(
            kt(settings), quantized, gpu_memory_utilization=0.9, device_total_bytes=80 * GIB
        ).num_gpu_experts
        == 74
    )
    block_fp8 = dataclasses.replace(quantized, block_fp8=True)
    for method, staged in (("FP8", 72), ("BF16", 74)):
        budget = resolve_num_gpu_experts(
            kt({**settings, "KT_METHOD": method}), block_fp8, gpu_memory_utilization=0.9, device_total_bytes=80 * GIB
        )
        assert budget.num_gpu_experts == staged, (method, budget.explanation)


def test_auto_staging_reserves_buffers_only_where_it_turns_on() -> None:
    """auto reserves the staging buffers like a set threshold where they are a small share
    of the GPU (2 x 2 GiB of 72 granted), and nothing where they would crowd the experts out
    (a 16 GiB GPU)."""
    auto = {"KT_NUM_GPU_EXPERTS": "auto", "KT_KV_CACHE_RESERVE_GB": "12"}
    big = resolve_num_gpu_experts(kt(auto), LAYERED, gpu_memory_utilization=0.9, device_total_bytes=80 * GIB)
    assert big.num_gpu_experts == 72 and "staging" in big.explanation
    small = resolve_num_gpu_experts(
        kt({**auto, "KT_KV_CACHE_RESERVE_GB": "2"}), LAYERED, gpu_memory_utilization=0.9, device_total_bytes=16 * GIB
    )
    assert "staging" not in small.explanation and small.num_gpu_experts == 11  # (14.4 - 2 - 4) / 0.75
    # the staging plan turns auto off beside dynamic experts, so no room is kept for it
    dynamic = {**auto, "KT_DYNAMIC_GPU_EXPERTS": "4"}
    moving = resolve_num_gpu_experts(kt(dynamic), LAYERED, gpu_memory_utilization=0.9, device_total_bytes=80 * GIB)
    assert moving.num_gpu_experts == 74 and "staging" not in moving.explanation
