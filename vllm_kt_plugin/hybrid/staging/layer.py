"""What both staging paths of a layer share (``LayerStaging``): its plan, its CPU experts on
the host (``HostExperts``: a copy, or the CPU backend writing its own), the device buffers
they stream through, and the GPU experts computed beside them.

The whole-layer path and the split each hold one and hand it the layer's weight lifecycle
(create, load a CPU expert's tensor, after loading); they differ only in how many CPU
experts a forward stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import Forward, LayerParts
from vllm_kt_plugin.hybrid.gpu_experts import BLOCK_FP8_STAGING_BACKEND, NativeKernel
from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts
from vllm_kt_plugin.hybrid.staging.plan import StagingPlan
from vllm_kt_plugin.settings.catalogue import AUTO, BLOCK_FP8, GIB, KT_GPU_LAYOUT_WRITERS, LOGGER_NAME, UNQUANTIZED
from vllm_kt_plugin.settings.errors import KTConfigError

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once

# The starts of the lines each path logs once, the first time it runs (tests look for them).
WHOLE_LAYER_RAN = "kt-hybrid: whole-layer stream ran"
SPLIT_RAN = "kt-hybrid: split ran"


class LayerStaging:
    """One layer's staging, shared by its staging path's stages (see the module docstring)."""

    def __init__(self, parts: LayerParts, plan: StagingPlan, kernel: NativeKernel) -> None:
        self.parts = parts
        self.plan = plan
        self.kernel = kernel
        self.host: HostExperts | None = None  # built in create_weights
        self.buffers: StagingBuffers | None = None  # the device's, after loading
        self.skips_cpu_picks = False  # the GPU experts drop the CPU experts' picks by an expert map

    def takes(self, forward: Forward, min_tokens: int) -> bool:
        """Whether a forward stages: loaded, large enough, and not captured into a CUDA
        graph (no Python runs at replay)."""
        return self.host is not None and forward.tokens >= min_tokens and not forward.capturing

    # --- weights -------------------------------------------------------------------------

    def create_weights(self, layer: RoutedExperts, create_args: dict[str, Any]) -> None:
        parts, plan = self.parts, self.plan
        cuda = parts.moe.device.type == "cuda"
        self.host = HostExperts(
            layer,
            parts.make_shadow_native,
            parts.placement.cpu_expert_ids(),
            create_args,
            pin=cuda,
            writer=self._gpu_layout_writer(cuda, create_args["params_dtype"]),
            moe_backend=BLOCK_FP8_STAGING_BACKEND if cuda and (self.kernel.block_fp8 or plan.fp8_copy) else None,
            fp8_copy=plan.fp8_copy,
        )
        mismatch = self.host.writer_mismatch()
        if mismatch is not None:  # e.g. biased experts, or other block scales: before any load
            asked = parts.context.settings.staging_min_tokens
            raise KTConfigError("KT_STAGING_MIN_TOKENS", "auto" if asked is AUTO else str(asked), mismatch, "0 (off)")
        parts.context.process.add_host_experts(parts.layer_idx, self.host)

    def _gpu_layout_writer(self, cuda: bool, params_dtype: torch.dtype) -> CPUExperts | None:
        """The CPU backend, where it can write its experts in the native kernel's layout
        (then no host copy is kept): under CUDA (vLLM's CPU kernels repack theirs), whole
        experts (no tensor parallelism), in the checkpoint's format (BF16 for unquantized
        checkpoints, FP8 for block-FP8 ones)."""
        parts, kernel = self.parts, self.kernel
        cpu = parts.cpu
        fits = cuda and parts.moe.tp_size == 1
        writes = cpu is not None and cpu.writes_gpu_layout
        method = parts.context.settings.method
        written = KT_GPU_LAYOUT_WRITERS.get(method) if isinstance(method, str) else None
        if kernel.block_fp8:  # the shadow then runs Triton (see HostExperts)
            same_format = written == BLOCK_FP8
        else:
            same_format = written == UNQUANTIZED and params_dtype == torch.bfloat16 and kernel.raw_layout
        return cpu if fits and writes and same_format else None

    def load_cpu_expert(
        self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, cpu_slot: int
    ) -> None:
        assert self.host is not None
        if self.host.copies:
            self.host.load(param_name, weight, weight_name, shard_id, cpu_slot)

    def after_loading(self, how: str) -> None:
        """The host copy finished and pinned, the device's buffers reserved for it, and one
        start-up line (``how``: how the path shares a forward's CPU experts out)."""
        assert self.host is not None
        parts, host = self.parts, self.host
        device = parts.moe.device
        load_format = str(get_current_vllm_config().load_config.load_format)
        host.finalize(load_format == "dummy", parts.placement.cpu_slot_of().to(device))
        process = parts.context.process
        self.buffers = process.staging(device)
        self.buffers.reserve(host)
        self.skips_cpu_picks = self.buffers.cuda and bool(parts.gpu.count) and self.kernel.raw_layout
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
            "kt-hybrid: staging for forwards of >= %d tokens%s: %s, %s",
            self.plan.min_tokens,
            how,
            source,
            self.buffers.describe(),
        )

    # --- forward -------------------------------------------------------------------------

    def gpu_experts(self, forward: Forward) -> torch.Tensor | None:
        """The GPU experts' share; under CUDA on vLLM's Triton kernels the CPU experts'
        picks are dropped by an expert map rather than weighted zero (thousands of them in
        a large forward would otherwise pile onto GPU slot 0)."""
        gpu = self.parts.gpu
        layer, x, weights, ids = forward.layer, forward.x, forward.topk_weights, forward.topk_ids
        if self.skips_cpu_picks:
            return gpu.apply_skipping_cpu_experts(layer, x, weights, ids)
        return gpu.apply(layer, x, weights, ids)
