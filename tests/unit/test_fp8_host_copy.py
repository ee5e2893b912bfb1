"""KT_GPU_PREFILL_FP8_COPY in the plans: the RAM plan, auto's refusal and doctor count the
block-FP8 host copy (a byte a weight plus block scales) instead of the BF16 one; serve and
doctor refuse it on a checkpoint whose experts are already quantized."""

from __future__ import annotations

import pytest

from vllm_kt_plugin.cpu_backends.base import CheckpointFormat
from vllm_kt_plugin.hybrid.serve_checks import validated
from vllm_kt_plugin.planning.gpu_budget import auto_gpu_prefill_refusal
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import estimate_model_memory
from vllm_kt_plugin.settings.variables import KTSettings
from vllm_kt_tools.cli.doctor import ERROR, OK, check_ram

# Qwen3-30B-A3B's shape (48 layers, 128 experts of hidden 2048 x expert width 768).
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}


def test_fp8_copy_halves_the_host_copy() -> None:
    memory = estimate_model_memory(QWEN3_30B)
    bf16 = memory.gpu_prefill_host_bytes(33, "AMXINT4")
    fp8 = memory.gpu_prefill_host_bytes(33, "AMXINT4", fp8_copy=True)
    assert bf16 == 95 * 48 * memory.expert_bytes
    scales = 4 * (3 * 2048 * 768 // (128 * 128) + 3)
    assert fp8 == 95 * 48 * (3 * 2048 * 768 + scales) and 0.49 * bf16 < fp8 < 0.51 * bf16
    # kt-kernel's BF16 writes its experts back (no copy), but the FP8 copy is a copy.
    assert memory.gpu_prefill_host_bytes(33, "BF16", fp8_copy=True) == fp8


def test_auto_and_doctor_count_the_fp8_copy() -> None:
    memory = estimate_model_memory(QWEN3_30B)
    int4 = memory.cpu_expert_bytes("AMXINT4")
    assert int4 is not None
    fp8 = memory.gpu_prefill_host_bytes(33, "AMXINT4", fp8_copy=True)
    bf16 = memory.gpu_prefill_host_bytes(33, "AMXINT4")
    room = int4 + (fp8 + bf16) // 2  # fits the FP8 copy, not the BF16 one
    assert check_ram("AMXINT4", QWEN3_30B, room, gpu_prefill_gpu_experts=33).level == ERROR
    with_fp8 = check_ram("AMXINT4", QWEN3_30B, room, gpu_prefill_gpu_experts=33, fp8_copy=True)
    assert with_fp8.level != ERROR and "block-FP8 copy" in with_fp8.reason, with_fp8
    args = dict(device_total_bytes=141 * 2**30, gpu_memory_utilization=0.9, num_gpu_experts=33, kt_method="AMXINT4")
    ram = int((int4 + (fp8 + bf16) // 2) / 0.9)
    assert "RAM" in (auto_gpu_prefill_refusal(memory, ram_available_bytes=ram, **args) or "")
    assert auto_gpu_prefill_refusal(memory, ram_available_bytes=ram, fp8_copy=True, **args) is None
    assert check_ram("AMXINT4", QWEN3_30B, 10 * room, gpu_prefill_gpu_experts=33, fp8_copy=True).level == OK


def test_fp8_copy_is_refused_at_config_time_on_a_quantized_checkpoint() -> None:
    """Decided from the settings and the checkpoint's format alone, so serve's config-time
    checks (and doctor, which runs them) refuse it before any weight loads."""
    env = {"KT_BACKEND": "torch", "KT_GPU_PREFILL_FP8_COPY": "1"}
    settings = KTSettings.from_env(env, cores=4, numa_nodes=1)
    assert settings.gpu_prefill_fp8_copy
    validated(settings, CheckpointFormat())  # a BF16 checkpoint: accepted
    env = {"KT_BACKEND": "kt_kernel", "KT_METHOD": "FP8", "KT_GPU_PREFILL_FP8_COPY": "1"}
    settings = KTSettings.from_env(env, cores=4, numa_nodes=1)
    fp8 = CheckpointFormat("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(KTConfigError) as refused:
        validated(settings, fp8)
    assert (refused.value.variable, str(refused.value.value)) == ("KT_GPU_PREFILL_FP8_COPY", "1")
    assert "already quantized (fp8)" in str(refused.value)


def test_fp8_copy_needs_gpu_prefill() -> None:
    with pytest.raises(KTConfigError, match="KT_GPU_PREFILL_MIN_TOKENS=0 turns GPU prefill off"):
        KTSettings.from_env({"KT_GPU_PREFILL_FP8_COPY": "1", "KT_GPU_PREFILL_MIN_TOKENS": "0"}, cores=4, numa_nodes=1)


def test_auto_turns_the_fp8_copy_on_only_where_it_adds_no_more_error_than_the_cpu_experts() -> None:
    """KT_GPU_PREFILL_FP8_COPY=auto (settings.staging): on for the AMX methods of an unquantized
    checkpoint on one rank of a GPU with FP8; each other case off, saying why; 0 and 1 as set."""
    from vllm_kt_plugin.settings.staging import FP8_COPY_AUTO_METHODS, fp8_copy_on, fp8_copy_refusal

    hopper = (9, 0)
    for method in FP8_COPY_AUTO_METHODS:
        assert fp8_copy_refusal(method, quantized=False, tensor_parallel_size=1, capability=hopper) is None
        assert fp8_copy_refusal(method.lower(), quantized=False, tensor_parallel_size=1, capability=(8, 9)) is None
    off = {
        "no CUDA device": ("AMXINT4", False, 1, None),
        "compute capability 8.0": ("AMXINT4", False, 1, (8, 0)),
        "quantized already": ("AMXINT4", True, 1, hopper),
        "one tensor-parallel rank, not 2": ("AMXINT4", False, 2, hopper),
        "KT_METHOD=BF16": ("BF16", False, 1, hopper),
    }
    for why, (method, quantized, tp, capability) in off.items():
        refusal = fp8_copy_refusal(method, quantized=quantized, tensor_parallel_size=tp, capability=capability)
        assert refusal is not None and why in refusal, (why, refusal)
        assert not fp8_copy_on(None, method, quantized=quantized, tensor_parallel_size=tp, capability=capability)
        assert fp8_copy_on(True, method, quantized=quantized, tensor_parallel_size=tp, capability=capability)
    assert not fp8_copy_on(False, "AMXINT4", quantized=False, tensor_parallel_size=1, capability=hopper)
