"""A layer's staging path, built from its plan: ``build(parts)`` gathers the layer's facts,
asks ``plan.plan_staging`` once, says the plan's notes, and returns the path it chose:
``WholeLayerPath`` or ``SplitPath`` (siblings around one ``LayerStaging``), or None.

The facts come from the layer as vLLM built it: the kernel it chose for the GPU experts
(read once, ``gpu_experts.native_kernel``), its device, parallelism and CUDA graphs, its
CPU backend, and the model's plan from planning (``LayerPlan.staging``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.contracts import ForwardPath, LayerParts
from vllm_kt_plugin.hybrid.gpu_experts import NativeKernel, native_kernel
from vllm_kt_plugin.hybrid.staging.layer import LayerStaging
from vllm_kt_plugin.hybrid.staging.plan import OFF, SPLIT_PATH, StagingFacts, StagingPlan, plan_staging
from vllm_kt_plugin.hybrid.staging.split import SplitPath
from vllm_kt_plugin.hybrid.staging.whole_layer import WholeLayerPath
from vllm_kt_plugin.hybrid.vllm_compat import cpu_runs_block_fp8_moe
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once

StagingPath = WholeLayerPath | SplitPath


def layer_facts(parts: LayerParts, kernel: NativeKernel) -> StagingFacts:
    """What the staging plan reads of a layer vLLM built (``kernel``: its GPU experts')."""
    device, planned = parts.moe.device, parts.context.plan.staging
    cuda = device.type == "cuda"
    return StagingFacts(
        parts.context.settings,
        experts=kernel.experts,
        quantized=None if kernel.reads_layer else kernel.name,
        tensor_parallel_size=parts.moe.tp_size,
        device=device.type,
        capability=tuple(torch.cuda.get_device_capability(device)) if cuda else None,  # type: ignore[arg-type]
        cpu_experts=parts.placement.num_cpu_experts,
        computes_cpu_experts=parts.cpu is not None,
        backend_writes=None if parts.cpu is None else parts.cpu.writes_gpu_layout,
        cpu_block_fp8_moe=None if cuda else cpu_runs_block_fp8_moe(),
        expert_widths=(parts.moe.hidden_dim, parts.moe.intermediate_size),
        cuda_graph_sizes=parts.cuda_graph_batch_sizes,
        off_because=planned.why_off if planned.path == OFF else None,
    )


def layer_plan(parts: LayerParts, kernel: NativeKernel) -> StagingPlan:
    """The layer's plan (a set value that cannot apply raises), its notes said once."""
    plan = plan_staging(layer_facts(parts, kernel)).check()
    for note in plan.notes:
        logger.info_once("kt-hybrid: %s", note)
    return plan


def build(parts: LayerParts) -> ForwardPath | None:
    """The layer's staging path, or None where its plan stages nothing."""
    kernel = native_kernel(parts.gpu.native)
    plan = layer_plan(parts, kernel)
    if plan.path == OFF:
        return None
    staging = LayerStaging(parts, plan, kernel)
    if plan.path == SPLIT_PATH:
        assert parts.cpu is not None  # the plan splits only where this rank computes CPU experts
        return SplitPath(staging, parts.cpu)
    return WholeLayerPath(staging)


def staging_path(paths: Iterable[ForwardPath]) -> StagingPath | None:
    """The staging path among a layer's paths (None where it has none)."""
    return next((p for p in paths if isinstance(p, WholeLayerPath | SplitPath)), None)
