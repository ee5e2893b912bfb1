"""The GPU-prefill path (KT_GPU_PREFILL_MIN_TOKENS): forwards of at least the threshold's
tokens compute every expert on the GPU, the CPU experts from a staging buffer their
weights stream into (``gpu_prefill``: the host copy and the buffers).

Here: whether a layer takes the path and from how many tokens (the setting, ``auto``'s
planning verdict, the staging rule of ``settings.staging`` applied to the kernel vLLM
chose, CUDA graphs), where the staged experts come from (a host copy, or the CPU backend
writing its own), the host copy's lifecycle, and the forward itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.forward import Forward, ForwardPath, LayerParts, StageMarks
from vllm_kt_plugin.hybrid.gpu_experts import BLOCK_FP8_STAGING_BACKEND, native_experts_format, runs_raw_layout
from vllm_kt_plugin.hybrid.gpu_prefill import HostExperts, StagingBuffers
from vllm_kt_plugin.hybrid.metrics import GPU_PREFILL_PATH
from vllm_kt_plugin.hybrid.vllm_compat import is_block_fp8
from vllm_kt_plugin.planning.gpu_budget import NO_CUDA_DEVICE
from vllm_kt_plugin.settings.catalogue import (
    BLOCK_FP8,
    GIB,
    GPU_PREFILL_AUTO_MIN_TOKENS,
    GPU_PREFILL_AUTO_MIN_TOKENS_FP8,
    KT_GPU_LAYOUT_WRITERS,
    LOGGER_NAME,
    UNQUANTIZED,
)
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.staging import staging_refusal

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
    if threshold is None:
        fp8 = is_block_fp8(parts.gpu.native)
        break_even = GPU_PREFILL_AUTO_MIN_TOKENS_FP8 if fp8 else GPU_PREFILL_AUTO_MIN_TOKENS
        threshold = auto_min_tokens(parts.context.plan.gpu_prefill_refusal, refusal, break_even)
        if not threshold:
            return 0
    elif refusal is not None:
        raise KTConfigError("KT_GPU_PREFILL_MIN_TOKENS", str(threshold), refusal, "0 (off) for this checkpoint")
    graphs = parts.cuda_graph_batch_sizes
    if graphs and threshold <= graphs[-1]:
        logger.info_once(
            "kt-hybrid: KT_GPU_PREFILL_MIN_TOKENS=%d raised to %d: batches up to %d tokens replay CUDA graphs",
            threshold,
            graphs[-1] + 1,
            graphs[-1],
        )
        threshold = graphs[-1] + 1
    return threshold


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
        self.host = HostExperts(
            layer,
            parts.make_shadow_native,
            parts.placement.cpu_expert_ids(),
            create_args,
            pin=cuda,
            writer=self._gpu_layout_writer(cuda, create_args["params_dtype"]),
            moe_backend=BLOCK_FP8_STAGING_BACKEND if cuda and is_block_fp8(native) else None,
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
            source = f"the CPU experts' copy takes {copy_gib:.2f} GiB of {memory} memory ({len(hosts)} layers)"
        else:
            source = f"{settings.method} CPU experts written by {settings.backend} (no host copy)"
        logger.info_once(
            "kt-hybrid: GPU prefill for forwards of >= %d tokens: %s, %s",
            self.min_tokens,
            source,
            self.staging.describe(),
        )

    # --- forward -------------------------------------------------------------------------

    def run(self, forward: Forward, marks: StageMarks) -> torch.Tensor:
        host, staging, gpu = self.host, self.staging, self.parts.gpu
        assert host is not None and staging is not None
        layer, x, weights, ids = forward.layer, forward.x, forward.topk_weights, forward.topk_ids
        if staging.cuda and gpu.count and runs_raw_layout(gpu.native):
            out = gpu.apply_skipping_cpu_experts(layer, x, weights, ids)
        else:
            out = gpu.apply(layer, x, weights, ids)
        index, staged = staging.acquire(host)
        cpu_out = host.apply(staged, x, weights, ids)
        staging.release(index)
        # After this layer's work is queued: a written next layer blocks this thread.
        if self._next_host is None:
            self._next_host = self.parts.context.runtime.host_after(self.parts.layer_idx)
        if self._next_host is not host:
            staging.prefetch(self._next_host, busy=index)
        logger.info_once(
            "kt-hybrid: GPU prefill ran: a forward of >= %d tokens computed the CPU experts on the GPU",
            self.min_tokens,
        )
        return cpu_out if out is None else out + cpu_out


def build(parts: LayerParts) -> GPUPrefillPath | None:
    """The layer's GPU-prefill path, or None where GPU prefill is off for it."""
    min_tokens = gpu_prefill_min_tokens(parts)
    return GPUPrefillPath(parts, min_tokens) if min_tokens else None
