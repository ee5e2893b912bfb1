"""Which CPU experts GPU prefill (KT_GPU_PREFILL_MIN_TOKENS) can stage: the one rule,
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
