"""Which CPU experts GPU prefill (KT_GPU_PREFILL_MIN_TOKENS) can stage, and in which format
(KT_GPU_PREFILL_FP8_COPY): the one rule each,
used by planning (from the checkpoint's config, before the engine starts) and by each
layer (from the native method vLLM chose for it).

Unquantized experts are staged from a host copy, or as kt-kernel's BF16 writes them back;
block-FP8 experts only as kt-kernel's FP8 writes them back (``KT_GPU_LAYOUT_WRITERS``):
whole experts, so on one tensor-parallel rank, under CUDA.
"""

from __future__ import annotations

from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, KT_GPU_LAYOUT_WRITERS, UNQUANTIZED

BLOCK_FP8_RULE = "GPU prefill stages block-FP8 experts as kt-kernel's FP8 writes them back, under CUDA, whole"


def staging_refusal(
    experts: str,
    kt_method: str,
    tensor_parallel_size: int = 1,
    *,
    device: str | None = None,
    backend_writes: bool | None = None,
    backend: str = "",
) -> str | None:
    """Why GPU prefill cannot stage CPU experts stored as ``experts`` (``UNQUANTIZED``,
    ``BLOCK_FP8``, or a description of another format or kernel) with ``kt_method``, or
    None. ``device`` and ``backend_writes`` (whether the CPU backend can write its experts
    back), where known, are checked too."""
    if experts == UNQUANTIZED:
        return None
    if experts != BLOCK_FP8:
        return (
            "GPU prefill stages unquantized experts run by vLLM's Triton (or CPU) MoE kernels and block-FP8 "
            f"ones; this checkpoint's experts are {experts}"
        )
    if KT_GPU_LAYOUT_WRITERS.get(kt_method.upper()) != BLOCK_FP8:
        return f"{BLOCK_FP8_RULE}: KT_METHOD=FP8 (this checkpoint's default), not {kt_method}"
    if tensor_parallel_size > 1:
        return f"{BLOCK_FP8_RULE}: one tensor-parallel rank, not --tensor-parallel-size {tensor_parallel_size}"
    if device is not None and device != "cuda":
        return f"{BLOCK_FP8_RULE}: a CUDA device, not {device}"
    if backend_writes is False:
        return f"{BLOCK_FP8_RULE}: KT_BACKEND={backend} (this build) cannot write its FP8 experts back"
    return None


# KT_GPU_PREFILL_FP8_COPY=auto: the CPU methods whose own drift from BF16 CPU experts is at least
# the FP8 host copy's drift from the exact copy, measured the same way (tests/engine/test_gpu.py,
# test_fp8_copy_drift_within_the_cpu_methods_drift; docs/split.md): with them the copy adds no
# more error than the CPU experts carry. Measured first on vLLM's CPU build (AMX box,
# 2026-12-06, `python benchmarks/fp8_copy_accuracy.py`; chosen-token logprob drift, half the experts
# on the CPU, no completion differing):
#   model                FP8 copy   AMXINT8   AMXINT4
#   Qwen3-MoE, 128 wide  0.0150     0.0124    0.128
#   Mixtral              0.0016     0.0042    0.0265
#   DeepSeek-V3, 128     0.0118     0.0186    0.0384
# Within AMXINT4's everywhere; above AMXINT8's on Qwen3-MoE, so AMXINT8 keeps the exact copy.
FP8_COPY_AUTO_METHODS = ("AMXINT4",)
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on


def fp8_copy_refusal(
    kt_method: str, *, quantized: bool, tensor_parallel_size: int, capability: tuple[int, int] | None
) -> str | None:
    """Why KT_GPU_PREFILL_FP8_COPY=auto leaves GPU prefill's host copy in the checkpoint's
    format, or None where auto makes it block FP8. ``capability``: the CUDA device's, None
    without one."""
    if capability is None:
        return "no CUDA device"
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return f"the GPU (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor cores"
    if quantized:
        return "the checkpoint's experts are quantized already"
    if tensor_parallel_size > 1:
        return f"it quantizes whole experts: one tensor-parallel rank, not {tensor_parallel_size}"
    if kt_method.upper() not in FP8_COPY_AUTO_METHODS:
        return (
            f"KT_METHOD={kt_method}'s CPU experts are more accurate than the FP8 copy would be (auto turns it on "
            f"for {' and '.join(FP8_COPY_AUTO_METHODS)})"
        )
    return None


def fp8_copy_on(
    setting: bool | None,
    kt_method: str,
    *,
    quantized: bool,
    tensor_parallel_size: int,
    capability: tuple[int, int] | None,
) -> bool:
    """KT_GPU_PREFILL_FP8_COPY resolved: 1 or 0 as set, auto by ``fp8_copy_refusal``."""
    if setting is not None:
        return setting
    return (
        fp8_copy_refusal(
            kt_method, quantized=quantized, tensor_parallel_size=tensor_parallel_size, capability=capability
        )
        is None
    )
