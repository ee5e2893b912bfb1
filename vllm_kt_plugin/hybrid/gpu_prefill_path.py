"""The GPU-prefill path (KT_GPU_PREFILL_MIN_TOKENS): forwards of at least the threshold's
tokens compute every expert on the GPU, the CPU experts from a staging buffer their
weights stream into (``host_experts``: the host copy, ``staging_buffers``: the buffers).

Here: where the staged experts come from (a host copy, in the checkpoint's format or block
FP8 with KT_GPU_PREFILL_FP8_COPY, or the CPU backend writing its own), the host copy's
lifecycle, and the forward itself. Whether a layer takes the path, from how many tokens and
with which copy: ``staging_policy``.

Where the split applies (``staging_policy.splits``: KT_GPU_PREFILL_SPLIT, or ``auto`` on one
tensor-parallel rank), ``split_path.SplitPath`` takes this path's place: the same host copy
and buffers, a part of the CPU experts per forward instead of all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import Forward, ForwardPath, LayerParts, StageMarks
from vllm_kt_plugin.hybrid.gpu_experts import BLOCK_FP8_STAGING_BACKEND, runs_raw_layout
from vllm_kt_plugin.hybrid.host_experts import HostExperts
from vllm_kt_plugin.hybrid.metrics import GPU_PREFILL_PATH
from vllm_kt_plugin.hybrid.staging_buffers import StagingBuffers
from vllm_kt_plugin.hybrid.staging_policy import fp8_copy_for, gpu_prefill_min_tokens, splits
from vllm_kt_plugin.hybrid.vllm_compat import is_block_fp8
from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, GIB, KT_GPU_LAYOUT_WRITERS, LOGGER_NAME, UNQUANTIZED
from vllm_kt_plugin.settings.errors import KTConfigError

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kt_plugin.cpu_backends.base import CPUExperts

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once


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
        parts.context.process.add_host_experts(parts.layer_idx, self.host)

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
        process = parts.context.process
        self.staging = process.staging(device)
        self.staging.reserve(host)
        settings = parts.context.settings
        if host.copies:
            hosts = [h for _, h in process.host_experts]
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
        marks.planned(host.num_experts, host.num_experts, GPU_PREFILL_PATH)
        marks.gpu_done()
        # After this layer's work is queued: a written next layer blocks this thread.
        if self._next_host is None:
            self._next_host = self.parts.context.process.host_experts_after(self.parts.layer_idx)
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
