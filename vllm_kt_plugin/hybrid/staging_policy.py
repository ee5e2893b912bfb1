"""Whether and how a layer stages its CPU experts on the GPU, asked by both staging paths'
builders (``gpu_prefill_path.build``, ``split_path.build``) when vLLM builds the layer:
from how many tokens (KT_GPU_PREFILL_MIN_TOKENS: the setting, ``auto``'s planning verdict,
the staging rule of ``settings.staging`` applied to the kernel vLLM chose, CUDA graphs),
whole layer or split (``splits``: KT_GPU_PREFILL_SPLIT, or ``auto`` on one tensor-parallel
rank), and with the block-FP8 copy or the checkpoint's format (KT_GPU_PREFILL_FP8_COPY).
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import LayerParts
from vllm_kt_plugin.hybrid.gpu_experts import kernel_of, native_experts_format, native_is_stageable
from vllm_kt_plugin.hybrid.host_experts import FP8_BLOCK
from vllm_kt_plugin.hybrid.vllm_compat import cpu_runs_block_fp8_moe
from vllm_kt_plugin.planning.gpu_budget import NO_CUDA_DEVICE
from vllm_kt_plugin.settings.catalogue import GPU_PREFILL_AUTO_MIN_TOKENS, LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.staging import fp8_copy_refusal, staging_refusal

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once


def layer_staging_refusal(parts: LayerParts) -> str | None:
    """Why GPU prefill cannot stage this layer's CPU experts, or None (``settings.staging``
    on the kernel vLLM chose, this rank's device and the CPU backend)."""
    settings = parts.context.settings
    return staging_refusal(
        native_experts_format(parts.gpu.native),
        settings.method or "",
        parts.moe.tp_size,
        device=parts.moe.device.type,
        backend_writes=None if parts.cpu is None else parts.cpu.writes_gpu_layout,
        backend=settings.backend,
    )


def auto_min_tokens(plan_refusal: str | None, staging_refusal: str | None, break_even: int) -> int:
    """KT_GPU_PREFILL_MIN_TOKENS=auto: ``break_even`` where the layer's CPU experts can be
    staged and the model and host leave room (``plan_refusal``: planning's verdict); else
    0, saying why once."""
    refusal = plan_refusal or staging_refusal
    if refusal is not None:
        if refusal != NO_CUDA_DEVICE:
            logger.info_once("kt-hybrid: GPU prefill (KT_GPU_PREFILL_MIN_TOKENS=auto) off: %s", refusal)
        return 0
    return break_even


def splits(parts: LayerParts) -> bool:
    """Whether the layer's forwards above the threshold take the split (``split_path``)
    instead of the whole-layer stream: KT_GPU_PREFILL_SPLIT=<share>, or auto (the cost
    model) under KT_GPU_PREFILL_MIN_TOKENS=auto; whole experts only, so one tensor-parallel
    rank, which computes CPU experts."""
    settings = parts.context.settings
    wanted = settings.gpu_prefill_split is not None or settings.gpu_prefill_min_tokens is None
    return wanted and parts.cpu is not None and parts.moe.tp_size == 1


def gpu_prefill_min_tokens(parts: LayerParts) -> int:
    """KT_GPU_PREFILL_MIN_TOKENS for this layer: 0 where it cannot apply; never at or
    below a CUDA-graph batch size (captured batches replay the CPU path)."""
    settings = parts.context.settings
    threshold = settings.gpu_prefill_min_tokens
    if threshold == 0 or not parts.placement.num_cpu_experts:
        return 0
    if threshold is None and settings.dynamic_gpu_experts:
        logger.info_once(
            "kt-hybrid: GPU prefill (KT_GPU_PREFILL_MIN_TOKENS=auto) off: KT_DYNAMIC_GPU_EXPERTS moves experts, "
            "GPU prefill stages a fixed set"
        )
        return 0
    refusal = layer_staging_refusal(parts)
    if settings.gpu_prefill_fp8_copy:
        check_fp8_copy(parts, refusal)
    share = settings.gpu_prefill_split
    if share is not None and parts.moe.tp_size > 1:  # known only here: the parallel config is the layer's
        raise KTConfigError(
            "KT_GPU_PREFILL_SPLIT",
            str(share),
            f"the split stages whole experts: one tensor-parallel rank, not {parts.moe.tp_size}",
            "auto with --tensor-parallel-size > 1",
        )
    if threshold is None:
        # auto: the split's cost model decides each forward above the CUDA-graph batches
        # (raised below); tensor parallelism keeps the whole layer's measured break-even.
        least = 1 if splits(parts) else GPU_PREFILL_AUTO_MIN_TOKENS
        threshold = auto_min_tokens(parts.context.plan.gpu_prefill_refusal, refusal, least)
        if not threshold:
            return 0
    elif refusal is not None:
        raise KTConfigError("KT_GPU_PREFILL_MIN_TOKENS", str(threshold), refusal, "0 (off) for this checkpoint")
    graphs = parts.cuda_graph_batch_sizes
    if graphs and threshold <= graphs[-1]:
        if threshold > 1:  # auto's 1 means "every forward outside the graphs"
            logger.info_once(
                "kt-hybrid: KT_GPU_PREFILL_MIN_TOKENS=%d raised to %d: batches up to %d tokens replay CUDA graphs",
                threshold,
                graphs[-1] + 1,
                graphs[-1],
            )
        threshold = graphs[-1] + 1
    return threshold


def check_fp8_copy(parts: LayerParts, refusal: str | None) -> None:
    """KT_GPU_PREFILL_FP8_COPY=1 quantizes unquantized experts, whole (one rank), for a
    kernel that runs block FP8. A quantized checkpoint is refused at config time
    (``serve_checks``); what needs the layer (its kernel, parallelism, device) here."""
    why = refusal
    if why is None and not native_is_stageable(parts.gpu.native):
        why = f"this checkpoint's experts are already quantized ({kernel_of(parts.gpu.native)})"
    if why is None and parts.moe.tp_size > 1:
        why = f"it quantizes whole experts: one tensor-parallel rank, not {parts.moe.tp_size}"
    if why is None and parts.moe.device.type == "cpu" and not cpu_runs_block_fp8_moe():
        why = "vLLM's CPU build runs block-FP8 MoE only on AMX CPUs, and this one has no AMX"
    widths = (parts.moe.hidden_dim, parts.moe.intermediate_size)
    if why is None and parts.moe.device.type == "cpu" and any(width % FP8_BLOCK for width in widths):
        # vLLM 0.32 refines narrower experts' blocks (64 x 64), which CPUExpertsFp8 does not take
        why = (
            f"vLLM's CPU build runs block-FP8 MoE with {FP8_BLOCK} x {FP8_BLOCK} blocks only, and this layer's "
            f"experts are {widths[0]} x {widths[1]}"
        )
    if why is not None:
        raise KTConfigError("KT_GPU_PREFILL_FP8_COPY", "1", why, "0 for this checkpoint")


def fp8_copy_for(parts: LayerParts) -> bool:
    """KT_GPU_PREFILL_FP8_COPY for this layer: 1 checked (``check_fp8_copy``: gpu_prefill_min_tokens
    did), 0 off, auto by ``settings.staging.fp8_copy_refusal`` on the kernel and device vLLM
    chose (said once, either way)."""
    settings = parts.context.settings
    if settings.gpu_prefill_fp8_copy is not None:
        return settings.gpu_prefill_fp8_copy
    device = parts.moe.device
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    why = fp8_copy_refusal(
        settings.method or "",
        quantized=not native_is_stageable(parts.gpu.native),
        tensor_parallel_size=parts.moe.tp_size,
        capability=capability,  # type: ignore[arg-type]
    )
    if why is None:
        logger.info_once(
            "kt-hybrid: GPU prefill's host copy is block FP8 (KT_GPU_PREFILL_FP8_COPY=auto: %s CPU experts on a GPU "
            "with FP8; 0 keeps the checkpoint's format)",
            settings.method,
        )
    elif capability is not None:
        logger.info_once("kt-hybrid: GPU prefill's host copy keeps the checkpoint's format (FP8 copy auto: %s)", why)
    return why is None
