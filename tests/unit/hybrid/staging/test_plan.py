"""The staging plan (``hybrid/staging/plan.py``): one pure decision, asked with the facts of
each stage (settings alone, the checkpoint, the model and host's memory, a layer); the
rules of the staged format, the FP8 copy and auto's room, and the host copy's RAM."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_kt_plugin.hybrid.staging.plan import (
    FP8_COPY_AUTO_METHODS,
    NO_CUDA_DEVICE,
    OFF,
    SPLIT_PATH,
    WHOLE_LAYER_PATH,
    StagingFacts,
    fp8_copy_refusal,
    fp8_expert_bytes,
    host_copy_bytes,
    plan_staging,
)
from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, GIB, UNQUANTIZED, WHOLE_LAYER_AUTO_MIN_TOKENS
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ModelMemory, estimate_model_memory
from vllm_kt_plugin.settings.variables import KTSettings

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
# 48 layers of 128 experts of 1/64 GiB (Qwen3-30B-A3B-like proportions).
LAYERED = ModelMemory(
    num_experts=128, moe_layers=tuple(range(48)), expert_params=0, expert_bytes=GIB // 64, non_expert_bytes=4 * GIB
)
HOPPER = (9, 0)


def settings(**env: str) -> KTSettings:
    return KTSettings.from_env({f"KT_{k.upper()}": v for k, v in env.items()}, cores=4, numa_nodes=1)


def layer(s: KTSettings, **facts: object) -> StagingFacts:
    """A layer's facts: unquantized experts on one CUDA rank, 6 of them on the CPU."""
    base = dict(experts=UNQUANTIZED, tensor_parallel_size=1, device="cuda", capability=HOPPER, cpu_experts=6)
    return StagingFacts(s, **{**base, **facts})  # type: ignore[arg-type]


def test_each_setting_plans_its_path() -> None:
    """auto on one rank: the split's cost model above the CUDA graphs; auto with tensor
    parallelism: the whole layer from its measured break-even; a number: the whole layer
    from it (raised above the graphs); a number and a share: the split with that share; 0:
    off."""
    auto = plan_staging(layer(settings(), cuda_graph_sizes=(1, 8, 16)))
    assert (auto.path, auto.min_tokens, auto.share) == (SPLIT_PATH, 17, None)
    assert not [note for note in auto.notes if "raised" in note]  # auto's 1 means "above the graphs": no news
    tp = plan_staging(layer(settings(), tensor_parallel_size=2))
    assert (tp.path, tp.min_tokens) == (WHOLE_LAYER_PATH, WHOLE_LAYER_AUTO_MIN_TOKENS)
    fixed = plan_staging(layer(settings(staging_min_tokens="12"), cuda_graph_sizes=(1, 8, 16)))
    assert (fixed.path, fixed.min_tokens) == (WHOLE_LAYER_PATH, 17)
    assert "KT_STAGING_MIN_TOKENS=12 raised to 17: batches up to 16 tokens replay CUDA graphs" in fixed.notes
    share = plan_staging(layer(settings(staging_min_tokens="12", staging_split="0.5")))
    assert (share.path, share.min_tokens, share.share) == (SPLIT_PATH, 12, 0.5)
    assert plan_staging(layer(settings(staging_min_tokens="0"))).path == OFF
    assert plan_staging(layer(settings(), cpu_experts=0)).path == OFF  # nothing to stage
    other_rank = plan_staging(
        layer(settings(staging_min_tokens="12"), tensor_parallel_size=2, computes_cpu_experts=False)
    )
    assert other_rank.path == WHOLE_LAYER_PATH  # every rank streams its shard


def test_auto_is_on_where_nothing_refuses_else_off_saying_why() -> None:
    """What ``auto`` reads: planning's verdict for the model (``off_because``), the layer's
    own staging rule, the device; each refusal leaves it off with its reason, said once
    (on vLLM's CPU build it says nothing: off is the norm there)."""
    assert plan_staging(layer(settings(), tensor_parallel_size=2)).min_tokens == WHOLE_LAYER_AUTO_MIN_TOKENS
    cannot = plan_staging(layer(settings(), experts="the layer cannot be staged"))
    assert cannot.path == OFF and cannot.min_tokens == 0 and "the layer cannot be staged" in (cannot.why_off or "")
    planned = plan_staging(layer(settings(), off_because="the staging would not fit"))
    assert planned.path == OFF and planned.min_tokens == 0
    assert planned.notes == ("staging (KT_STAGING_MIN_TOKENS=auto) off: the staging would not fit",)
    cpu_build = plan_staging(layer(settings(), device="cpu", capability=None))
    assert (cpu_build.path, cpu_build.why_off, cpu_build.notes) == (OFF, NO_CUDA_DEVICE, ())
    dynamic = plan_staging(layer(settings(dynamic_gpu_experts="4")))
    assert dynamic.path == OFF and "KT_DYNAMIC_GPU_EXPERTS moves experts" in (dynamic.why_off or "")


def test_a_set_value_that_cannot_apply_is_refused_where_its_facts_are_known() -> None:
    """A number where the experts cannot be staged, a share with tensor parallelism: the
    plan carries the refusal (``check`` raises it); with the CPU experts unknown (config
    time, KT_NUM_GPU_EXPERTS=auto) the number is not refused yet, only off."""
    gptq = plan_staging(layer(settings(staging_min_tokens="64"), experts="quantized", quantized="gptq"))
    with pytest.raises(KTConfigError, match="this checkpoint's experts are quantized") as refused:
        gptq.check()
    assert (refused.value.variable, refused.value.value) == ("KT_STAGING_MIN_TOKENS", "64") and gptq.path == OFF
    unknown = plan_staging(layer(settings(staging_min_tokens="64"), experts="quantized", cpu_experts=None))
    assert unknown.refused is None and unknown.path == OFF
    with pytest.raises(KTConfigError, match="one tensor-parallel rank, not 2") as refused:
        plan_staging(layer(settings(staging_split="0.5"), tensor_parallel_size=2)).check()
    assert refused.value.variable == "KT_STAGING_SPLIT"
    assert plan_staging(layer(settings(staging_min_tokens="64"))).check().path == WHOLE_LAYER_PATH


def test_settings_alone_refuse_dynamic_experts_beside_a_set_number_and_a_copy_with_staging_off() -> None:
    with pytest.raises(KTConfigError, match="KT_STAGING_MIN_TOKENS=2048 is set too") as refused:
        plan_staging(StagingFacts(settings(dynamic_gpu_experts="1", staging_min_tokens="2048"))).check()
    assert (refused.value.variable, refused.value.value) == ("KT_DYNAMIC_GPU_EXPERTS", "1")
    with pytest.raises(KTConfigError, match="KT_STAGING_MIN_TOKENS=0 turns staging off"):
        plan_staging(StagingFacts(settings(staging_fp8_copy="1", staging_min_tokens="0"))).check()
    assert plan_staging(StagingFacts(settings(dynamic_gpu_experts="1"))).check().path == OFF  # auto: off, no refusal


def test_fp8_copy_halves_the_host_copy() -> None:
    memory = estimate_model_memory(QWEN3_30B)
    bf16 = host_copy_bytes(memory, 33, "AMXINT4")
    fp8 = host_copy_bytes(memory, 33, "AMXINT4", fp8_copy=True)
    assert bf16 == 95 * 48 * memory.expert_bytes
    scales = 4 * (3 * 2048 * 768 // (128 * 128) + 3)
    assert fp8 == 95 * 48 * (3 * 2048 * 768 + scales) and 0.49 * bf16 < fp8 < 0.51 * bf16
    assert fp8_expert_bytes(memory) == 3 * 2048 * 768 + scales
    # kt-kernel's BF16 writes its experts back (no copy), but the FP8 copy is a copy.
    assert host_copy_bytes(memory, 33, "BF16", fp8_copy=True) == fp8


def test_the_host_copy_by_format_and_method() -> None:
    block_fp8 = dataclasses.replace(LAYERED, quantized=True, block_fp8=True)
    assert block_fp8.checkpoint_format == BLOCK_FP8
    # block-FP8: staged as kt-kernel's FP8 writes it back, from two pinned buffers of one layer
    assert host_copy_bytes(block_fp8, 32, "FP8") == 2 * 96 * block_fp8.expert_bytes
    assert host_copy_bytes(block_fp8, 32, "RAWINT4") == 0
    # FP8 experts from KT_WEIGHT_PATH on an unquantized checkpoint: a BF16 host copy of every layer
    assert host_copy_bytes(LAYERED, 32, "FP8") == 96 * LAYERED.num_moe_layers * LAYERED.expert_bytes
    assert host_copy_bytes(LAYERED, 32, "BF16") == 2 * 96 * LAYERED.expert_bytes


def _model(
    memory: ModelMemory = LAYERED,
    device: int | None = 80 * GIB,
    ram: int = 512 * GIB,
    kt_method: str = "AMXINT4",
    tp: int = 1,
    gpu_experts: int = 32,
    fp8_copy: str = "auto",
    capability: tuple[int, int] | None = None,
) -> StagingFacts:
    """The facts planning gives: the model's sizes, its GPU (granted: 0.9 of it) and RAM."""
    return StagingFacts(
        settings(method=kt_method, staging_fp8_copy=fp8_copy),
        experts=memory.checkpoint_format,
        quantized=memory.checkpoint_format if memory.quantized else None,
        tensor_parallel_size=tp,
        device="cpu" if device is None else "cuda",
        capability=capability,
        memory=memory,
        granted_gpu_bytes=None if device is None else 0.9 * device,
        gpu_experts=gpu_experts,
        ram_available_bytes=ram,
    )


def test_auto_room_refusals() -> None:
    """Why auto leaves staging off, per model and host; None where it turns on."""

    def refusal(**model: object) -> str | None:
        return plan_staging(_model(**model)).why_off  # type: ignore[arg-type]

    assert refusal() is None
    assert refusal(device=None) == NO_CUDA_DEVICE
    assert "quantized" in (refusal(memory=dataclasses.replace(LAYERED, quantized=True)) or "")
    block_fp8 = dataclasses.replace(LAYERED, quantized=True, block_fp8=True)
    assert "KT_METHOD=FP8" in (refusal(memory=block_fp8) or "")
    assert refusal(memory=block_fp8, kt_method="FP8") is None
    # kt-kernel writes whole experts: one tensor-parallel rank
    assert "tensor-parallel-size 2" in (refusal(memory=block_fp8, kt_method="FP8", tp=2) or "")
    assert "staging buffers" in (refusal(device=16 * GIB) or "")
    # host copy: 96 x 48 / 64 = 72 GiB, beside kt-kernel's experts: more than 90 % of 64 GiB
    assert "RAM" in (refusal(ram=64 * GIB) or "")


def test_auto_counts_the_fp8_copy_in_its_room() -> None:
    memory = estimate_model_memory(QWEN3_30B)
    int4 = memory.cpu_expert_bytes("AMXINT4")
    assert int4 is not None
    fp8 = host_copy_bytes(memory, 33, "AMXINT4", fp8_copy=True)
    bf16 = host_copy_bytes(memory, 33, "AMXINT4")
    ram = int((int4 + (fp8 + bf16) // 2) / 0.9)  # fits the FP8 copy, not the BF16 one
    room = dict(memory=memory, device=141 * GIB, ram=ram, gpu_experts=33)
    assert "RAM" in (plan_staging(_model(**room, fp8_copy="0")).why_off or "")  # type: ignore[arg-type]
    assert plan_staging(_model(**room, fp8_copy="1")).why_off is None  # type: ignore[arg-type]
    # auto: the copy is block FP8 on a GPU with FP8 for AMXINT4, so it fits there
    on_hopper = plan_staging(_model(**room, capability=HOPPER))  # type: ignore[arg-type]
    assert on_hopper.fp8_copy and on_hopper.why_off is None
    on_ampere = plan_staging(_model(**room, capability=(8, 0)))  # type: ignore[arg-type]
    assert not on_ampere.fp8_copy and "RAM" in (on_ampere.why_off or "")


def test_fp8_copy_needs_staging() -> None:
    with pytest.raises(KTConfigError, match="KT_STAGING_MIN_TOKENS=0 turns staging off"):
        plan_staging(StagingFacts(settings(staging_fp8_copy="1", staging_min_tokens="0"))).check()


def test_auto_turns_the_fp8_copy_on_only_where_it_adds_no_more_error_than_the_cpu_experts() -> None:
    """KT_STAGING_FP8_COPY=auto: on for the AMX methods of an unquantized checkpoint on one
    rank of a GPU with FP8; each other case off, saying why; 0 and 1 as set."""
    for method in FP8_COPY_AUTO_METHODS:
        assert fp8_copy_refusal(method, quantized=False, tensor_parallel_size=1, capability=HOPPER) is None
        assert fp8_copy_refusal(method.lower(), quantized=False, tensor_parallel_size=1, capability=(8, 9)) is None
    off = {
        "no CUDA device": ("AMXINT4", False, 1, None),
        "compute capability 8.0": ("AMXINT4", False, 1, (8, 0)),
        "quantized already": ("AMXINT4", True, 1, HOPPER),
        "one tensor-parallel rank, not 2": ("AMXINT4", False, 2, HOPPER),
        "KT_METHOD=BF16": ("BF16", False, 1, HOPPER),
    }

    def copy(setting: str, method: str, quantized: bool, tp: int, capability: tuple[int, int] | None) -> bool:
        s = settings(method=method, staging_fp8_copy=setting, staging_min_tokens="64")
        facts = layer(s, tensor_parallel_size=tp, capability=capability, quantized="fp8" if quantized else None)
        plan = plan_staging(dataclasses.replace(facts, device="cuda" if capability else "cpu"))
        return plan.fp8_copy if plan.refused is None else "refused"  # type: ignore[return-value]

    for why, (method, quantized, tp, capability) in off.items():
        refusal = fp8_copy_refusal(method, quantized=quantized, tensor_parallel_size=tp, capability=capability)
        assert refusal is not None and why in refusal, (why, refusal)
        assert not copy("auto", method, quantized, tp, capability)
    assert copy("1", "AMXINT4", False, 1, None) is True  # 1 as set where it can apply (the CPU build too)
    assert copy("1", "BF16", False, 1, HOPPER) is True
    assert copy("1", "AMXINT4", True, 1, HOPPER) == "refused"  # ... and refused where it cannot
    assert copy("0", "AMXINT4", False, 1, HOPPER) is False
    assert copy("auto", "AMXINT4", False, 1, HOPPER) is True
