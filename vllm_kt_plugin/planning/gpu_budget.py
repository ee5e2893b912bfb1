"""How many experts per MoE layer fit on the GPU: ``KT_NUM_GPU_EXPERTS=auto`` and
``KT_GPU_EXPERTS_RATIO``. vLLM grants itself ``total x gpu_memory_utilization``; the budget
takes the non-expert weights and the KV-cache reserve (``KT_KV_CACHE_RESERVE_GB``) from it,
and the staging buffers where the staging plan stages; the rest holds ``n`` experts in each
MoE layer (per GPU: each weight's 1/tp with tensor parallelism):

    n = floor((total x utilization - reserve - non_expert / tp) / (moe_layers x expert / tp))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vllm_kt_plugin.hybrid.staging.plan import OFF, StagingFacts, buffer_bytes, plan_staging
from vllm_kt_plugin.settings.catalogue import GIB
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ModelMemory
from vllm_kt_plugin.settings.variables import KTSettings

# Default KV-cache reserve: a fifth of the granted memory, at least 2 GB (activations and
# CUDA graphs need about that much even for a short context).
DEFAULT_RESERVE_FRACTION = 0.2
MIN_RESERVE_GB = 2.0
# The vLLM default, assumed by the preset tables (the actual value is used for auto).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class GPUExpertBudget:
    """The per-layer GPU expert count and the line that explains where it came from."""

    num_gpu_experts: int
    explanation: str


def default_reserve_gb(granted_gb: float) -> float:
    return max(MIN_RESERVE_GB, DEFAULT_RESERVE_FRACTION * granted_gb)


def fit_gpu_experts(
    *,
    device_total_bytes: int,
    gpu_memory_utilization: float,
    memory: ModelMemory,
    kv_cache_reserve_gb: float | None = None,
    tensor_parallel_size: int = 1,
    staging: bool = False,
) -> GPUExpertBudget:
    """The largest per-layer expert count whose weights fit beside the non-expert weights
    and the KV-cache reserve (and, with ``staging``, its two buffers of a layer's CPU
    experts each); pure arithmetic on the figures given."""
    tp = max(1, tensor_parallel_size)
    granted = device_total_bytes * gpu_memory_utilization
    reserve_gb = default_reserve_gb(granted / GIB) if kv_cache_reserve_gb is None else kv_cache_reserve_gb
    reserve = reserve_gb * GIB
    non_expert = memory.non_expert_bytes / tp
    per_layer_expert = memory.num_moe_layers * memory.expert_bytes / tp
    room = granted - reserve - non_expert
    count = 0 if room <= 0 or per_layer_expert <= 0 else min(memory.num_experts, math.floor(room / per_layer_expert))

    def buffers(n: int) -> float:
        return buffer_bytes(memory, n, tp) if staging else 0.0

    while count > 0 and count * per_layer_expert + buffers(count) > room:
        count -= 1
    explanation = (
        f"{_gb(device_total_bytes)} GB device x {gpu_memory_utilization:g} = {_gb(granted)} GB granted"
        f" - {reserve_gb:.1f} GB KV-cache reserve - {_gb(non_expert)} GB non-expert weights"
        f" = {_gb(max(room, 0))} GB for experts; one expert in each of {memory.num_moe_layers} MoE layers"
        f" takes {_gb(per_layer_expert)} GB"
        + (f" (per GPU, tp={tp})" if tp > 1 else "")
        + (f" ({_gb(buffers(count))} GB of it for the staging buffers)" if staging else "")
        + f" -> {count} of {memory.num_experts} experts per layer on the GPU"
    )
    if room <= 0:
        explanation += " (the non-expert weights and the reserve alone exceed the granted memory)"
    return GPUExpertBudget(count, explanation)


def stages(settings: KTSettings, memory: ModelMemory, granted_bytes: float, tensor_parallel_size: int) -> bool:
    """Whether the staging plan stages this model's CPU experts on the GPU being sized (so
    the budget keeps room for its buffers)."""
    facts = StagingFacts(
        settings,
        experts=memory.checkpoint_format,
        tensor_parallel_size=tensor_parallel_size,
        device="cuda",
        memory=memory,
        granted_gpu_bytes=granted_bytes,
    )
    return plan_staging(facts).path != OFF


def measured_device_total_bytes() -> int | None:
    """Total memory of this process's current CUDA device; None without CUDA (vLLM's CPU
    platform). Call it in the worker, where vLLM has already initialized CUDA."""
    import torch  # deferred: the budget arithmetic above runs without torch (doctor, presets)

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def measured_device_capability() -> tuple[int, int] | None:
    """This process's current CUDA device's compute capability; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))  # type: ignore[return-value]


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


def fixed_num_gpu_experts(settings: KTSettings, experts: int) -> GPUExpertBudget | None:
    """The count KT_GPU_EXPERTS_RATIO or a numeric KT_NUM_GPU_EXPERTS gives, without the
    model's sizes; None for ``auto``."""
    if settings.gpu_experts_ratio is not None:
        count = round(settings.gpu_experts_ratio * experts)
        return GPUExpertBudget(count, f"KT_GPU_EXPERTS_RATIO={settings.gpu_experts_ratio:g} of {experts} -> {count}")
    if settings.gpu_experts_auto:
        return None
    # At most ``experts``: KTSettings.check_model refused more at config time.
    return GPUExpertBudget(settings.num_gpu_experts, f"KT_NUM_GPU_EXPERTS={settings.num_gpu_experts}")


def resolve_num_gpu_experts(
    settings: KTSettings,
    memory: ModelMemory,
    *,
    gpu_memory_utilization: float,
    device_total_bytes: int | None,
    tensor_parallel_size: int = 1,
) -> GPUExpertBudget:
    """GPU experts per layer from the settings: a number, a ratio of the layer's experts,
    or ``auto`` (fit the device). ``KT_GPU_MEMORY_GB``, when set, replaces the measured
    ``device_total_bytes`` (None where vLLM's platform has no GPU)."""
    fixed = fixed_num_gpu_experts(settings, memory.num_experts)
    if fixed is not None:
        return fixed
    if settings.gpu_memory_gb is not None:
        device_total_bytes = int(settings.gpu_memory_gb * GIB)
    if device_total_bytes is None:
        raise KTConfigError(
            "KT_NUM_GPU_EXPERTS",
            "auto",
            "no GPU to measure on this platform",
            "set KT_GPU_MEMORY_GB to the GPU size, or KT_NUM_GPU_EXPERTS to a number",
        )
    budget = fit_gpu_experts(
        device_total_bytes=device_total_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        memory=memory,
        kv_cache_reserve_gb=settings.kv_cache_reserve_gb,
        tensor_parallel_size=tensor_parallel_size,
        staging=stages(settings, memory, device_total_bytes * gpu_memory_utilization, tensor_parallel_size),
    )
    return GPUExpertBudget(budget.num_gpu_experts, f"KT_NUM_GPU_EXPERTS=auto: {budget.explanation}")
