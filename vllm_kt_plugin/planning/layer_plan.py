"""Which experts each MoE layer keeps on the GPU, and the model's staging plan, decided
once per model.

The count comes from KT_NUM_GPU_EXPERTS (a number or ``auto``, sized to the device) or
KT_GPU_EXPERTS_RATIO; the choice of experts from KT_EXPERT_PLACEMENT. All layers are
planned together because front-loading spreads one total over them. The staging plan
(``hybrid.staging.plan``) is the model's, for this device and host; each layer reads it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm_kt_plugin.hybrid.staging.plan import StagingFacts, StagingPlan, plan_staging
from vllm_kt_plugin.planning.gpu_budget import (
    fixed_num_gpu_experts,
    measured_device_capability,
    measured_device_total_bytes,
    resolve_num_gpu_experts,
)
from vllm_kt_plugin.planning.placement import ExpertPlacement, plan_placements, plan_placements_from_settings
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError
from vllm_kt_plugin.settings.model_memory import ModelConfigError, ModelMemory, estimate_model_memory
from vllm_kt_plugin.settings.routing_profile import RoutingProfile, load_routing_profile
from vllm_kt_plugin.settings.variables import KTSettings

logger = logging.getLogger(LOGGER_NAME)

# Strategies that need every MoE layer's index (and so the model's config) to plan.
NEEDS_ALL_LAYERS = frozenset({"front-loading"})


def model_memory(settings: KTSettings, hf_config: Mapping[str, Any]) -> ModelMemory | None:
    """The model's weight sizes, or None where they are not needed and cannot be read."""
    try:
        return estimate_model_memory(hf_config)
    except ModelConfigError as exc:
        if settings.gpu_experts_auto or settings.expert_placement in NEEDS_ALL_LAYERS:
            variable, value = (
                ("KT_NUM_GPU_EXPERTS", "auto")
                if settings.gpu_experts_auto
                else ("KT_EXPERT_PLACEMENT", settings.expert_placement)
            )
            raise KTConfigError(
                variable,
                value,
                f"for this model: {exc}",
                "a fixed KT_NUM_GPU_EXPERTS with KT_EXPERT_PLACEMENT uniform, random or frequency",
            ) from None
        return None


def check_plan(settings: KTSettings, hf_config: Mapping[str, Any], num_experts: int) -> None:
    """Front-end checks (before the engine starts): the sizes ``auto`` and front-loading
    need, and the routing profile frequency placement reads."""
    memory = model_memory(settings, hf_config)
    if settings.expert_placement == "frequency":
        layers = memory.moe_layers if memory is not None else ()
        plan_placements_from_settings(settings, layers, num_experts, 0)  # loads and checks the profile


# (decoder layers, pipeline stages) -> the layers this worker's stage builds; None: all of them
StageLayers = Callable[[int, int], "range | None"]


def _whole_model(num_layers: int, stages: int) -> range | None:
    return None


class LayerPlan:
    """Per-layer placements, computed on the first layer vLLM builds (in the worker, where
    the device and vLLM's memory settings are known). ``stage_layers`` tells a pipeline
    stage its layers (``hybrid.vllm_compat.pipeline_stage_layers``: vLLM's parallel groups
    are reached from there, not from planning)."""

    def __init__(self, settings: KTSettings, stage_layers: StageLayers = _whole_model) -> None:
        self.settings = settings
        self.stage_layers = stage_layers
        self.placements: dict[int, ExpertPlacement] | None = None
        self.num_gpu_experts = 0
        self.staging = StagingPlan(why_off="not planned yet")  # the model's, once planned

    @functools.cached_property
    def profile(self) -> RoutingProfile | None:
        """KT_EXPERT_PROFILE, read once for all layers (frequency placement only)."""
        return (
            load_routing_profile(self.settings.expert_profile)
            if self.settings.expert_placement == "frequency"
            else None
        )

    def _place(self, strategy: str, layers: Sequence[int], num_experts: int) -> dict[int, ExpertPlacement]:
        seed = self.settings.expert_placement_seed
        return plan_placements(strategy, layers, num_experts, self.num_gpu_experts, seed=seed, profile=self.profile)

    def placement_for(self, layer_idx: int, num_experts: int) -> ExpertPlacement:
        if self.placements is None:
            self.placements = self._plan(num_experts)
        placement = self.placements.get(layer_idx)
        if placement is None:  # a layer the config does not list (e.g. built on its own)
            strategy = (
                "uniform" if self.settings.expert_placement in NEEDS_ALL_LAYERS else self.settings.expert_placement
            )
            placement = self._place(strategy, [layer_idx], num_experts)[layer_idx]
            self.placements[layer_idx] = placement
        return placement

    def _plan(self, num_experts: int) -> dict[int, ExpertPlacement]:
        from vllm.config import get_current_vllm_config  # deferred: planning is pure logic until here

        vllm_config = get_current_vllm_config()
        memory = model_memory(self.settings, vllm_config.model_config.hf_config.to_dict())
        if memory is not None:
            memory = _this_stage(memory, vllm_config, self.stage_layers)
        if memory is None:  # model_memory refused auto and front-loading already
            fixed = fixed_num_gpu_experts(self.settings, num_experts)
            assert fixed is not None
            self.num_gpu_experts = fixed.num_gpu_experts
            self.staging = plan_staging(StagingFacts(self.settings, off_because="the model's sizes are unknown"))
            return {}
        device_total_bytes = measured_device_total_bytes()
        utilization = vllm_config.cache_config.gpu_memory_utilization
        tp = vllm_config.parallel_config.tensor_parallel_size
        budget = resolve_num_gpu_experts(
            self.settings,
            memory,
            gpu_memory_utilization=utilization,
            device_total_bytes=device_total_bytes,
            tensor_parallel_size=tp,
        )
        self.num_gpu_experts = budget.num_gpu_experts
        capability = measured_device_capability()
        self.staging = plan_staging(
            StagingFacts(
                self.settings,
                experts=memory.checkpoint_format,
                quantized=memory.checkpoint_format if memory.quantized else None,
                tensor_parallel_size=tp,
                device="cpu" if device_total_bytes is None else "cuda",
                capability=capability,
                memory=memory,
                granted_gpu_bytes=None if device_total_bytes is None else device_total_bytes * utilization,
                gpu_experts=self.num_gpu_experts,
                ram_available_bytes=_ram_available_bytes(),
            )
        )
        logger.info("kt-hybrid: %s; placement %s", budget.explanation, self.settings.expert_placement)
        return self._place(self.settings.expert_placement, memory.moe_layers, num_experts)


def _this_stage(memory: ModelMemory, vllm_config: Any, stage_layers: StageLayers) -> ModelMemory:
    """With pipeline parallelism, the share of the stage this worker builds: its GPU
    holds only its own layers, so ``auto`` sizes their experts to it."""
    num_layers = vllm_config.model_config.hf_config.get_text_config().num_hidden_layers
    layers = stage_layers(num_layers, vllm_config.parallel_config.pipeline_parallel_size)
    return memory if layers is None else memory.stage(layers, num_layers)


def _ram_available_bytes() -> int:
    """Available RAM now (when the first layer is built, before any expert is loaded)."""
    import psutil  # deferred: a vLLM dependency, needed only in the worker

    return int(psutil.virtual_memory().available)
