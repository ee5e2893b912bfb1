"""The GPU-prefill path (KT_GPU_PREFILL_MIN_TOKENS): forwards of at least the threshold's
tokens compute every expert on the GPU, the CPU experts from a staging buffer their
weights stream into (``host_experts``: the host copy, ``staging_buffers``: the buffers).

Here: whether a layer takes the path and from how many tokens (the setting, ``auto``'s
planning verdict, the staging rule of ``settings.staging`` applied to the kernel vLLM
chose, CUDA graphs), where the staged experts come from (a host copy, in the checkpoint's
format or block FP8 with KT_GPU_PREFILL_FP8_COPY, or the CPU backend writing its own),
the host copy's lifecycle, and the forward itself.

Where the split applies (``splits``: KT_GPU_PREFILL_SPLIT, or ``auto`` on one
tensor-parallel rank), ``split_path.SplitPath`` takes this path's place: the same host copy
and buffers, a part of the CPU experts per forward instead of all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, LayerParts, StageMarks
from vllm_kt_plugin.hybrid.gpu_experts import (
    BLOCK_FP8_STAGING_BACKEND,
    kernel_of,
    native_experts_format,
    native_is_stageable,
    runs_raw_layout,
)
from vllm_kt_plugin.hybrid.host_experts import FP8_BLOCK, HostExperts
from vllm_kt_plugin.hybrid.metrics import GPU_PREFILL_PATH
from vllm_kt_plugin.hybrid.staging_buffers import StagingBuffers
from vllm_kt_plugin.hybrid.vllm_compat import cpu_runs_block_fp8_moe, is_block_fp8
from vllm_kt_plugin.planning.gpu_budget import NO_CUDA_DEVICE
from vllm_kt_plugin.settings.catalogue import (
    BLOCK_FP8,
    GIB,
    GPU_PREFILL_AUTO_MIN_TOKENS,
    KT_GPU_LAYOUT_WRITERS,
    LOGGER_NAME,
    UNQUANTIZED,
)
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.staging import fp8_copy_refusal, staging_refusal

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kt_plugin.cpu_backends.base import CPUExperts

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


class GPUPrefillPath(ForwardPath):
    """Every routed expert on the GPU: the GPU experts as always, the CPU experts from the
    staging buffer, while the next layer's CPU experts are copied into the other."""

    name = GPU_PREFILL_PATH

    def __init__(self, parts: LayerParts, min_tokens: int) -> None:
        self.parts = parts
        self.min_tokens = min_tokens
        self.host: HostExperts | None = None  # built in create_weights
        self.staging: StagingBuffers | None = None  # after loading
        self._next_host: HostExperts | None = None

    def takes(self, forward: Forward) -> bool:
        return self.host is not None and forward.tokens >= self.min_tokens and not forward.capturing

    # --- weights -------------------------------------------------------------------------

    def create_weights(self, layer: RoutedExperts, create_args: dict[str, Any]) -> None:
        parts = self.parts
        cuda = parts.moe.device.type == "cuda"
        native = parts.gpu.native
        fp8_copy = fp8_copy_for(parts)
        self.host = HostExperts(
            layer,
            parts.make_shadow_native,
            parts.placement.cpu_expert_ids(),
            create_args,
            pin=cuda,
            writer=self._gpu_layout_writer(cuda, create_args["params_dtype"]),
            moe_backend=BLOCK_FP8_STAGING_BACKEND if cuda and (is_block_fp8(native) or fp8_copy) else None,
            fp8_copy=fp8_copy,
        )
        mismatch = self.host.writer_mismatch()
        if mismatch is not None:  # e.g. biased experts, or other block scales: before any load
            threshold = parts.context.settings.gpu_prefill_min_tokens
            raise KTConfigError(
                "KT_GPU_PREFILL_MIN_TOKENS", "auto" if threshold is None else str(threshold), mismatch, "0 (off)"
            )
        parts.context.runtime.add_host(parts.layer_idx, self.host)

    def _gpu_layout_writer(self, cuda: bool, params_dtype: torch.dtype) -> CPUExperts | None:
        """The CPU backend, where it can write its experts in the native kernel's layout
        (then GPU prefill keeps no host copy): under CUDA (vLLM's CPU kernels repack
        theirs), whole experts (no tensor parallelism), in the checkpoint's format (BF16
        for unquantized checkpoints, FP8 for block-FP8 ones)."""
        parts = self.parts
        native, cpu = parts.gpu.native, parts.cpu
        fits = cuda and parts.moe.tp_size == 1
        writes = cpu is not None and cpu.writes_gpu_layout
        written = KT_GPU_LAYOUT_WRITERS.get(parts.context.settings.method or "")
        if is_block_fp8(native):  # the shadow then runs Triton (see HostExperts)
            same_format = written == BLOCK_FP8
        else:
            same_format = written == UNQUANTIZED and params_dtype == torch.bfloat16 and runs_raw_layout(native)
        return cpu if fits and writes and same_format else None

    def load_cpu_expert(
        self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, cpu_slot: int
    ) -> None:
        assert self.host is not None
        if self.host.copies:
            self.host.load(param_name, weight, weight_name, shard_id, cpu_slot)

    def after_loading(self, layer: RoutedExperts) -> None:
        assert self.host is not None
        parts, host = self.parts, self.host
        device = parts.moe.device
        load_format = str(get_current_vllm_config().load_config.load_format)
        host.finalize(load_format == "dummy", parts.placement.cpu_slot_of().to(device))
        runtime = parts.context.runtime
        self.staging = runtime.staging(device)
        self.staging.reserve(host)
        settings = parts.context.settings
        if host.copies:
            hosts = [h for _, h in runtime.hosts]
            memory = "pinned host" if device.type == "cuda" else "host"
            copy_gib = sum(h.host_nbytes for h in hosts) / GIB
            fp8 = " block-FP8" if host.fp8_copy else ""
            source = f"the CPU experts'{fp8} copy takes {copy_gib:.2f} GiB of {memory} memory ({len(hosts)} layers)"
        else:
            source = f"{settings.method} CPU experts written by {settings.backend} (no host copy)"
        logger.info_once(
            "kt-hybrid: GPU prefill for forwards of >= %d tokens%s: %s, %s",
            self.min_tokens,
            self.describe(),
            source,
            self.staging.describe(),
        )

    def describe(self) -> str:
        """How the path shares a forward's CPU experts out, for the start-up log."""
        return " (whole layer)"

    # --- forward -------------------------------------------------------------------------

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        host, staging = self.host, self.staging
        assert host is not None and staging is not None
        x, weights, ids = forward.x, forward.topk_weights, forward.topk_ids
        out = self.gpu_experts(forward)
        index, staged = staging.acquire(host)
        cpu_out = host.apply(staged, x, weights, ids)
        staging.release(index)
        marks.planned(host.num_experts, host.num_experts)
        marks.gpu_done()
        # After this layer's work is queued: a written next layer blocks this thread.
        if self._next_host is None:
            self._next_host = self.parts.context.runtime.host_after(self.parts.layer_idx)
        if self._next_host is not host:
            staging.prefetch(self._next_host, busy=index)
        logger.info_once(
            "kt-hybrid: GPU prefill ran: a forward of >= %d tokens computed the CPU experts on the GPU",
            self.min_tokens,
        )
        marks.synced()
        return cpu_out if out is None else out + cpu_out

    def gpu_experts(self, forward: Forward) -> torch.Tensor | None:
        """The GPU experts' share; under CUDA on vLLM's Triton kernels the CPU experts'
        picks are dropped by an expert map rather than weighted zero."""
        gpu, staging = self.parts.gpu, self.staging
        layer, x, weights, ids = forward.layer, forward.x, forward.topk_weights, forward.topk_ids
        if staging is not None and staging.cuda and gpu.count and runs_raw_layout(gpu.native):
            return gpu.apply_skipping_cpu_experts(layer, x, weights, ids)
        return gpu.apply(layer, x, weights, ids)


def build(parts: LayerParts) -> GPUPrefillPath | None:
    """The layer's GPU-prefill path, or None where GPU prefill is off for it or the split
    takes its place (``split_path.build``)."""
    if splits(parts):
        return None
    min_tokens = gpu_prefill_min_tokens(parts)
    return GPUPrefillPath(parts, min_tokens) if min_tokens else None
