"""Every place kt-hybrid reaches into vLLM beyond its public interfaces, in one module
(as ``cpu_backends/kt_kernel/compat.py`` does for kt-kernel).

Each function says which behaviour of vLLM 0.32.0 it relies on; ``TOUCHES`` lists the
attributes it reads or writes, which ``tests/unit/test_vllm_compat.py`` checks on the
installed vLLM. Outside this module (and the tooling's ``vllm_kt_tools/support/
vllm_internals.py``) only the public interfaces on the allow-lists of test_layout.py and
test_vllm_compat.py are used.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.cpu_backends.base import ExpertMath
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

logger = logging.getLogger(LOGGER_NAME)

VLLM_VERSION = "0.32.0"  # the version whose behaviour every touch below was read from


@dataclass(frozen=True)
class Touch:
    """One attribute of vLLM that kt-hybrid relies on: ``owner`` (``module`` or
    ``module:Class``), the attribute, whether it lives on the owner itself, on instances of
    the class, or on instances as the class's ``__init__`` sets them, and what we rely on."""

    owner: str
    attribute: str
    on: str  # "owner", "instance" or "init"
    relied_on: str


TOUCHES: tuple[Touch, ...] = (
    Touch(
        "vllm.model_executor.layers.fused_moe.runner.moe_runner",
        "get_layer_from_name",
        "owner",
        "finds a MoE layer's runner in the forward context by name, as vLLM's moe_forward op does",
    ),
    Touch(
        "vllm.config.model:ModelConfig",
        "_verify_quantization",
        "owner",
        "resolves a checkpoint's quantization_config to vLLM's method name (gptq -> gptq_marlin ...)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "_expert_map",
        "instance",
        "a registered buffer; RoutedExperts.expert_map returns it to the kernels at each call",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "local_num_experts",
        "instance",
        "set by update_expert_map_info after get_quant_method; the native method post-processes that many",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "expert_map_manager",
        "instance",
        "num_fused_shared_experts > 0 where ROCm AITER fuses shared experts into the routed ones",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.expert_map_manager:ExpertMapManager",
        "num_fused_shared_experts",
        "instance",
        "shared experts fused into the routed ones (ROCm AITER), which kt-hybrid cannot split",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig",
        "num_local_experts",
        "instance",
        "the native method sizes its weights by it when it creates them (set_local_num_experts)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig",
        "moe_backend",
        "instance",
        "the kernel a shadow's native method picks (\"auto\" or a backend's name; bare_copy)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner",
        "routed_experts",
        "instance",
        "the runner registered in the forward context under the layer's name holds the RoutedExperts",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod",
        "unquantized_backend",
        "instance",
        "the chosen kernel (TRITON, CPU, FLASHINFER, ...), set in __init__",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase",
        "moe_kernel",
        "instance",
        "None until the method has picked its modular kernel",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase",
        "moe_quant_config",
        "instance",
        "None until RoutedExperts._ensure_moe_quant_config_init fills it from get_fused_moe_quant_config",
    ),
    Touch(
        "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod",
        "_init_moe_kernel",
        "owner",
        "builds moe_quant_config and moe_kernel from the layer's scales (called again for new weights)",
    ),
    Touch(
        "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod",
        "block_quant",
        "instance",
        "True for block-FP8 checkpoints (weight_block_size set)",
    ),
    Touch(
        "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod",
        "fp8_backend",
        "instance",
        "the chosen FP8 MoE kernel (TRITON runs the checkpoint's layout unchanged)",
    ),
    Touch(
        "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod",
        "experts_cls",
        "instance",
        "the experts kernel class chosen in __init__ with fp8_backend (kernel_chosen)",
    ),
    Touch(
        "vllm.ray.ray_env",
        "DEFAULT_ENV_VAR_PREFIXES",
        "owner",
        "a set of prefixes whose variables vLLM's Ray executor copies to its workers (VLLM_ among them)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.moe_output",
        "UnfinalizedMoEOutput",
        "owner",
        "what a modular kernel's apply returns when it defers its finalize (instead of the output tensor)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "weight_loader",
        "owner",
        "called positionally (param, loaded_weight, weight_name, shard_id, expert_id, return_success), shard ids "
        "w1/w3/w2, marked supports_moe_loading; each expert parameter carries it as its weight_loader",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "swiglu_limit",
        "instance",
        "not None for a clamped SwiGLU (gpt-oss), which kt-kernel does not compute",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "swiglu_alpha",
        "instance",
        "not None for a scaled SwiGLU (gpt-oss), which kt-kernel does not compute",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
        "swiglu_beta",
        "instance",
        "not None for SwiGLU's offset of up (MiniMax-M3), which kt-kernel does not compute",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig",
        "is_lora_enabled",
        "instance",
        "True where LoRA adapters reach the MoE layer, which kt-hybrid does not support",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.config:FusedMoEParallelConfig",
        "pcp_size",
        "instance",
        "prefill-context parallelism's size (1 = off), which kt-hybrid does not support",
    ),
    Touch(
        "vllm.model_executor.models.utils",
        "extract_layer_index",
        "owner",
        "a module prefix's decoder layer index (model.layers.7.mlp.experts -> 7), as models number their layers",
    ),
    Touch(
        "vllm.distributed.parallel_state",
        "get_pp_group",
        "owner",
        "the pipeline group (world_size, rank_in_group) of this worker, once model parallelism is initialized",
    ),
    Touch(
        "vllm.distributed.parallel_state",
        "model_parallel_is_initialized",
        "owner",
        "False in the front end, where no parallel group exists yet",
    ),
    Touch(
        "vllm.distributed.parallel_state",
        "get_tensor_model_parallel_world_size",
        "owner",
        "this worker's tensor-parallel size",
    ),
    Touch(
        "vllm.distributed.parallel_state",
        "get_node_count",
        "owner",
        "the hosts the engine's workers span",
    ),
    Touch(
        "vllm.distributed.utils",
        "get_pp_indices",
        "owner",
        "(start, end) of the decoder layers make_layers builds in a pipeline stage (VLLM_PP_LAYER_PARTITION)",
    ),
    Touch(
        "vllm.transformers_utils.model_arch_config_convertor",
        "MODEL_ARCH_CONFIG_CONVERTORS",
        "owner",
        "model_type -> the convertor that reads a model's expert counts as vLLM does (the base class else)",
    ),
    Touch(
        "vllm.transformers_utils.model_arch_config_convertor",
        "ModelArchConfigConvertorBase",
        "owner",
        "(hf_config, text_config) -> get_num_experts(), get_num_experts_per_token()",
    ),
    Touch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "owner",
        "the engine core's scheduler; SchedulerConfig.get_scheduler_cls picks it without async scheduling",
    ),
    Touch(
        "vllm.v1.core.sched.async_scheduler",
        "AsyncScheduler",
        "owner",
        "the engine core's scheduler with async scheduling (a Scheduler subclass)",
    ),
    Touch(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "schedule",
        "owner",
        "schedule(throttle_prefills) builds one step; the engine core calls it once per step",
    ),
    Touch(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "running",
        "instance",
        "the running batch, a list of Requests",
    ),
    Touch(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "waiting",
        "instance",
        "a RequestQueue of new and preempted requests, iterable",
    ),
    Touch(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "kv_holding_waiting",
        "instance",
        "a RequestQueue of waiting requests that hold KV blocks, admitted before any other",
    ),
    Touch(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "_pause_state",
        "instance",
        "a PauseState; under PAUSED_NEW schedule() admits no request from waiting",
    ),
    Touch(
        "vllm.v1.core.sched.interface",
        "PauseState",
        "owner",
        "UNPAUSED, PAUSED_NEW (running and KV-holding requests only), PAUSED_ALL",
    ),
    Touch(
        "vllm.v1.request:Request",
        "num_tokens",
        "instance",
        "prompt and output tokens so far",
    ),
    Touch(
        "vllm.v1.request:Request",
        "num_computed_tokens",
        "instance",
        "tokens whose KV is computed (0 for a new request)",
    ),
    Touch(
        "vllm.v1.request:Request",
        "arrival_time",
        "instance",
        "time.time() when the front end took the request",
    ),
    Touch(
        "torch.cpu",
        "_is_amx_tile_supported",
        "owner",
        "whether the CPU has AMX tiles, as vLLM's CPU build itself asks (its kernels' ISA choice)",
    ),
    Touch(
        "torch.cpu",
        "_init_amx",
        "owner",
        "asks Linux for AMX tile permission (arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's CPU kernels do not",
    ),
    Touch(
        "vllm.model_executor.models.gpt_oss:GptOssModel",
        "_load_weights_other",
        "owner",
        "copies each layer's stack of every expert's unquantized tensor with param.copy_, not through the "
        "expert loader (route_stack_copies)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "_compute_routing",
        "owner",
        "(self, hidden_states, router_logits, indices_type, *, input_ids) -> (weights, ids); the CPU build's "
        "routing for every MoE layer, asserting softmax where a router has no groups and no custom function",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router",
        "_grouped_topk",
        "owner",
        "grouped top-k by keyword (gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func, "
        "routed_scaling_factor, e_score_correction_bias); softmax or sigmoid, bias for selection only",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "use_grouped_topk",
        "init",
        "whether the router groups experts (its grouped branch runs _grouped_topk)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "custom_routing_function",
        "init",
        "a model's own routing function, or None",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "scoring_func",
        "init",
        "softmax, sigmoid or sqrtsoftplus, as the model gave it",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "renormalize",
        "init",
        "whether the chosen experts' weights are scaled to sum to 1",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "routed_scaling_factor",
        "init",
        "the factor on the routing weights (1.0 where the runner scales the output instead)",
    ),
    Touch(
        "vllm.model_executor.layers.fused_moe.router.cpu_router:CPURouter",
        "e_score_correction_bias",
        "init",
        "a per-expert bias added to the scores for selection only, or None",
    ),
)


# --- quantization config ----------------------------------------------------------------


def resolve_native_method_name(hf_quant_cfg: dict[str, Any]) -> str:
    """The vLLM method for a checkpoint's ``quantization_config`` — e.g. ``gptq`` becomes
    ``gptq_marlin`` where Marlin runs. vLLM 0.32 decides this in
    ``ModelConfig._verify_quantization``, which reads only the four attributes of the
    stand-in below and writes ``quantization``; we run that same code."""
    from vllm.config.model import ModelConfig

    stand_in = SimpleNamespace(
        quantization=None,
        model_arch_config=SimpleNamespace(quantization_config=hf_quant_cfg),
        hf_config=None,
        allow_deprecated_quantization=False,
    )
    ModelConfig._verify_quantization(stand_in)  # type: ignore[arg-type]
    name = stand_in.quantization
    if not name:
        raise ValueError(f"cannot tell the quantization method of {hf_quant_cfg!r}")
    return str(name)


def let_ray_workers_inherit(prefix: str) -> None:
    """Variables named ``prefix*`` travel to Ray workers as vLLM's own VLLM_* do: vLLM 0.32's
    Ray executor copies the driver's variables by the prefixes in ``DEFAULT_ENV_VAR_PREFIXES``
    (a worker on another host would otherwise start with none of them)."""
    from vllm.ray.ray_env import DEFAULT_ENV_VAR_PREFIXES

    DEFAULT_ENV_VAR_PREFIXES.add(prefix)


# --- vLLM's CPU router --------------------------------------------------------------------


def route_ungrouped_sigmoid_on_cpu() -> bool:
    """vLLM 0.32's CPU router computes a sigmoid top-k without expert groups as its grouped
    top-k with one group; every other router is left as it was. Idempotent; whether the
    platform is vLLM's CPU build (elsewhere nothing changes).

    Why: ``CPURouter._compute_routing`` asserts softmax there (MiniMax-M2, Laguna), where CUDA
    runs fused_topk_bias: sigmoid scores, the bias for selection only, weights unbiased."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    own = cpu_router.CPURouter._compute_routing
    if getattr(own, "kt_one_group", False):
        return True

    @functools.wraps(own)
    def _compute_routing(
        self: Any,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        indices_type: torch.dtype | None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            self.use_grouped_topk
            or self.custom_routing_function is not None
            or self.scoring_func in ("softmax", "sqrtsoftplus")
        ):
            return own(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        bias = self.e_score_correction_bias
        return cpu_router._grouped_topk(
            gating_output=router_logits,
            topk=self.top_k,
            renormalize=self.renormalize,
            num_expert_group=1,
            topk_group=1,
            scoring_func=self.scoring_func,
            # as CUDA: with a bias, fused_topk_bias scales the weights; without one the factory
            # picks FusedTopKRouter, which is never given the factor
            routed_scaling_factor=self.routed_scaling_factor if bias is not None else 1.0,
            e_score_correction_bias=bias,
        )

    _compute_routing.kt_one_group = True  # type: ignore[attr-defined]
    cpu_router.CPURouter._compute_routing = _compute_routing  # type: ignore[method-assign]
    logger.info("kt-hybrid: vLLM's CPU router computes sigmoid top-k without groups as one group")
    return True


# Per-layer lists that say which decoder layers are MoE layers: Nemotron-H's layer kinds (a
# list of mixer kinds only, as Jamba's, says nothing of the MLPs) and DeepSeek's and GLM's MLP
# kinds. vLLM's convertor reads the expert counts alone, which a config with no MoE layer may
# still carry as its class's defaults: Cosmos3-Edge's config subclasses Nemotron-H's (8 routed
# experts) and lists attention and plain MLP layers only.
def _has_moe_layers(text_config: Any) -> bool | None:
    kinds = getattr(text_config, "layers_block_type", None)
    if isinstance(kinds, list | tuple) and {"mlp", "moe"} & set(kinds):
        return "moe" in kinds
    kinds = getattr(text_config, "mlp_layer_types", None)
    if isinstance(kinds, list | tuple) and kinds:
        return any(kind != "dense" for kind in kinds)
    return None


def routed_expert_counts(hf_config: Any) -> tuple[int, int]:
    """(routed experts per layer, experts per token) as vLLM 0.32 reads them for the model:
    through the convertor registered for its ``model_type`` (the base convertor else); (0, 0)
    where the config lists its layers' kinds and none is a MoE layer (``_has_moe_layers``)."""
    # vLLM's convertor module and vllm.config.model import each other: imported first, the
    # convertor's import fails half-done (a process that has loaded no vLLM config yet)
    import vllm.config  # noqa: F401
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    text = hf_config.get_text_config()
    if _has_moe_layers(text) is False:
        return 0, 0
    convertor_cls = MODEL_ARCH_CONFIG_CONVERTORS.get(getattr(hf_config, "model_type", ""), ModelArchConfigConvertorBase)
    convertor = convertor_cls(hf_config, text)
    return convertor.get_num_experts(), convertor.get_num_experts_per_token()


def layer_index(prefix: str) -> int:
    """The decoder layer index in a module prefix (``model.layers.7.mlp.experts`` -> 7),
    as vLLM's models number their layers."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(prefix)


# --- parallel groups ----------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelPlace:
    """This worker's place in vLLM's parallel groups."""

    pipeline_stages: int
    pipeline_rank: int
    tensor_parallel_size: int
    nodes: int


def parallel_place() -> ParallelPlace | None:
    """This worker's place; None where vLLM's model-parallel groups do not exist (the front
    end, before any worker)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    pipeline = parallel_state.get_pp_group()
    return ParallelPlace(
        pipeline_stages=pipeline.world_size,
        pipeline_rank=pipeline.rank_in_group,
        tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        nodes=parallel_state.get_node_count(),
    )


def pipeline_stage_layers(num_layers: int, stages: int) -> range | None:
    """The decoder layers this worker's pipeline stage builds (of ``num_layers``, in
    ``stages`` stages), as vLLM 0.32's ``make_layers`` splits them; None with one stage or
    outside a worker."""
    from vllm.distributed import parallel_state
    from vllm.distributed.utils import get_pp_indices

    if stages == 1 or not parallel_state.model_parallel_is_initialized():
        return None
    start, end = get_pp_indices(num_layers, parallel_state.get_pp_group().rank_in_group, stages)
    return range(start, end)


# --- the layer's expert count and quant method --------------------------------------------


def set_local_num_experts(layer: RoutedExperts, num_experts: int) -> None:
    """The native method sizes its weights by ``moe_config.num_local_experts`` and
    post-processes them by ``layer.local_num_experts``; vLLM 0.32 has computed neither
    when it asks the quantization config for the method, so we set both first."""
    layer.moe_config.num_local_experts = num_experts
    layer.local_num_experts = num_experts


def attach_quant_method(layer: torch.nn.Module, method: FusedMoEMethodBase) -> None:
    """``layer.quant_method = method`` without nn.Module's setattr: the method may be an
    nn.Module (a CustomOp), which setattr would register as a child."""
    object.__setattr__(layer, "quant_method", method)


@contextlib.contextmanager
def native_view(layer: RoutedExperts, native: FusedMoEMethodBase) -> Iterator[None]:
    """``layer.quant_method`` is ``native`` for the duration: vLLM 0.32's expert weight
    loader special-cases methods by class name (compressed-tensors, ModelOpt) and reads
    attributes such as ``weight_scale_refine`` from ``layer.quant_method``."""
    own = layer.__dict__["quant_method"]
    attach_quant_method(layer, native)
    try:
        yield
    finally:
        attach_quant_method(layer, own)


def fused_shared_experts(layer: RoutedExperts) -> int:
    """Shared experts fused into the routed ones (ROCm AITER), which we cannot split."""
    return int(layer.expert_map_manager.num_fused_shared_experts)


def clamped_swiglu(layer: RoutedExperts) -> bool:
    """Whether the experts use a clamped or scaled SwiGLU (gpt-oss: vLLM 0.32 keeps its
    ``swiglu_limit`` and ``swiglu_alpha`` on the layer)."""
    return layer.swiglu_limit is not None or layer.swiglu_alpha is not None


def lora_enabled(moe: FusedMoEConfig) -> bool:
    """Whether LoRA adapters reach the MoE layer (vLLM 0.32: ``FusedMoEConfig.is_lora_enabled``)."""
    return bool(moe.is_lora_enabled)


def prefill_context_parallel_size(parallel: FusedMoEParallelConfig) -> int:
    """Prefill-context parallelism's size, 1 when off (vLLM 0.32: ``pcp_size``)."""
    return int(parallel.pcp_size)


# --- loading expert weights ------------------------------------------------------------------

# vLLM 0.32's expert shard ids: ``w13_weight`` holds w1 (gate) then w3 (up) of each expert,
# ``w2_weight`` its w2 (down); its loader refuses any other id.
GATE_SHARD, UP_SHARD, DOWN_SHARD = "w1", "w3", "w2"


def load_expert_weight(
    layer: RoutedExperts, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int
) -> bool:
    """One expert's checkpoint tensor into ``layer``'s parameter ``param_name`` through vLLM's
    expert loader, as a model's ``load_weights`` calls it; whether it took the tensor."""
    return bool(layer.weight_loader(getattr(layer, param_name), weight, weight_name, shard_id, expert_id, True))


def wrap_expert_weight_loaders(
    layer: RoutedExperts, new: Iterable[str], wrap: Callable[[Callable[..., Any], str], Callable[..., Any]]
) -> None:
    """The parameters named in ``new`` load through ``wrap(their loader, name)``: vLLM 0.32's
    models load each checkpoint tensor through its parameter's ``weight_loader`` attribute
    (the layer's ``weight_loader``, or a method's own), called as the layer's is (see
    ``load_expert_weight``); the mark ``supports_moe_loading`` is what vLLM's own carries."""
    for name, param in layer.named_parameters(recurse=False):
        loader = getattr(param, "weight_loader", None)
        if name in new and loader is not None:
            wrapped = wrap(loader, name)
            wrapped.supports_moe_loading = True  # type: ignore[attr-defined]
            param.weight_loader = wrapped  # type: ignore[attr-defined]


def route_stack_copies(
    layer: RoutedExperts, names: Iterable[str], num_experts: int, copy_stack: Callable[[str, torch.Tensor], None]
) -> None:
    """A copy into a parameter named in ``names`` of one tensor for each of the layer's
    ``num_experts`` experts goes to ``copy_stack(name, stack)``; any other copy is the
    tensor's own. vLLM 0.32's gpt_oss.py (``GptOssModel._load_weights_other``) loads
    unquantized experts so, ``param.copy_(stack)``, past the expert loader. Until
    ``stack_copies_released``."""
    names = set(names)
    for name, param in layer.named_parameters(recurse=False):
        if name in names:
            param.copy_ = _stack_copy(param, name, num_experts, copy_stack)  # type: ignore[method-assign]


def _stack_copy(
    param: torch.nn.Parameter, name: str, num_experts: int, copy_stack: Callable[[str, torch.Tensor], None]
) -> Callable[..., torch.Tensor]:
    own = param.copy_

    def copy_(src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if src.dim() >= 1 and src.shape[0] == num_experts != param.shape[0]:
            copy_stack(name, src)
            return param
        return own(src, non_blocking)

    return copy_


def stack_copies_released(layer: RoutedExperts) -> None:
    """Undoes ``route_stack_copies``: after loading, copies are the tensors' own."""
    for param in layer.parameters(recurse=False):
        param.__dict__.pop("copy_", None)


# --- expert maps ------------------------------------------------------------------------


def set_expert_map(layer: RoutedExperts, expert_map: torch.Tensor | None) -> None:
    """``layer.expert_map`` (vLLM 0.32: the ``_expert_map`` buffer, read by the kernels at
    each call, -1 for experts they skip) becomes ``expert_map``."""
    layer._buffers["_expert_map"] = expert_map


@contextlib.contextmanager
def expert_map_set(layer: RoutedExperts, expert_map: torch.Tensor) -> Iterator[None]:
    """``set_expert_map`` for the duration."""
    own = layer._buffers.get("_expert_map")
    set_expert_map(layer, expert_map)
    try:
        yield
    finally:
        set_expert_map(layer, own)


# --- shadows: copies of a layer that own their weights ----------------------------------------


def bare_copy(layer: RoutedExperts, num_experts: int, moe_backend: str | None = None) -> RoutedExperts:
    """A shallow copy of ``layer`` with no parameters or children of its own, its routing
    buffers (the expert map) shared, sized for ``num_experts`` (its own ``moe_config``
    copy), on vLLM's ``moe_backend`` where given."""
    shadow = copy.copy(layer)
    shadow._parameters = {}
    shadow._buffers = dict(layer._buffers)
    shadow._modules = {}
    shadow.moe_config = copy.copy(layer.moe_config)
    if moe_backend is not None:
        shadow.moe_config.moe_backend = moe_backend
    set_local_num_experts(shadow, num_experts)
    return shadow


@contextlib.contextmanager
def parameters_swapped(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters are ``tensors`` for the duration (no copy, no registration)."""
    own = module._parameters
    module._parameters = {name: torch.nn.Parameter(t, requires_grad=False) for name, t in tensors.items()}
    try:
        yield
    finally:
        module._parameters = own


# --- the native method's kernel -----------------------------------------------------------


def unquantized_backend_name(native: FusedMoEMethodBase) -> str | None:
    """The kernel vLLM chose for unquantized experts (``TRITON``, ``CPU``, ...), else None."""
    return getattr(getattr(native, "unquantized_backend", None), "name", None)


def is_block_fp8(native: FusedMoEMethodBase) -> bool:
    """Whether the native method runs block-FP8 experts (DeepSeek-V3, Qwen3-*-FP8)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    return isinstance(native, Fp8MoEMethod) and native.block_quant


def block_fp8_method(shadow: RoutedExperts, block: int) -> FusedMoEMethodBase:
    """vLLM's FP8 MoE method with ``block`` x ``block`` weight blocks and dynamic activation
    scales, as a block-FP8 checkpoint would get (the FP8 host copy's shadow)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

    config = Fp8Config(activation_scheme="dynamic", weight_block_size=[block, block])
    return Fp8MoEMethod(config, shadow)


def cpu_runs_block_fp8_moe() -> bool:
    """Whether vLLM 0.32's CPU build can run block-FP8 MoE here: its CPUExpertsFp8 kernel
    needs AMX tiles (asked through torch's private probe, the one vLLM's CPU build uses)."""
    return bool(torch.cpu._is_amx_tile_supported())  # type: ignore[attr-defined]


@functools.cache
def ask_for_amx_tiles() -> bool:
    """Ask Linux once per process for AMX tile permission (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, through torch's private wrapper); whether tiles may be used.

    Why: on an AMX CPU, vLLM 0.32's CPU build runs AMX instructions in its kernels (its
    attention, ``cpu_attention_with_kv_cache``, and its MoE kernels) without asking first.
    Under torch.compile an earlier oneDNN matmul happens to ask; with ``--enforce-eager``
    nothing does, and the worker dies of SIGILL (exit code -4) at the first request, plain
    vLLM too (``tests/engine/test_serving_e2e.py::test_enforce_eager_serves_on_amx``).
    kt-kernel asks only from its own threads at their first forward. So every process that
    builds a kt-hybrid layer asks here, before its first forward. A no-op without AMX."""
    if not torch.cpu._is_amx_tile_supported():  # type: ignore[attr-defined]
        return False
    granted = bool(torch.cpu._init_amx())  # type: ignore[attr-defined]
    if not granted:
        logger.warning(
            "kt-hybrid: Linux refused AMX tile permission (arch_prctl ARCH_REQ_XCOMP_PERM needs kernel >= 5.16); "
            "vLLM's CPU kernels may die of SIGILL with --enforce-eager"
        )
    return granted


def is_unfinalized(out: object) -> bool:
    """Whether a native method's ``apply`` deferred its finalize (vLLM 0.32's modular
    kernels may return an ``UnfinalizedMoEOutput`` instead of the output tensor)."""
    from vllm.model_executor.layers.fused_moe.moe_output import UnfinalizedMoEOutput

    return isinstance(out, UnfinalizedMoEOutput)


def fp8_backend_name(native: FusedMoEMethodBase) -> str | None:
    """The FP8 MoE kernel vLLM chose (``TRITON``, ``DEEPGEMM``, ...), else None."""
    return getattr(getattr(native, "fp8_backend", None), "name", None)


def kernel_chosen(native: FusedMoEMethodBase) -> bool:
    """Whether the native method has picked its kernel (``is_monolithic`` fails before:
    e.g. fp8 picks at loading)."""
    return native.moe_kernel is not None or getattr(native, "experts_cls", None) is not None


def can_rebuild_moe_kernel(native: FusedMoEMethodBase) -> bool:
    return hasattr(native, "_init_moe_kernel")


def rebuild_moe_kernel(native: FusedMoEMethodBase, layer: RoutedExperts) -> tuple[Any, Any]:
    """Build ``native``'s kernel again from ``layer``'s tensors (vLLM 0.32's FP8 method
    builds it once, at setup, in ``_init_moe_kernel``, which it also calls for weights
    already in kernel format); returns (moe_quant_config, moe_kernel)."""
    native._init_moe_kernel(layer)  # type: ignore[attr-defined]
    return native.moe_quant_config, native.moe_kernel


def native_moe_quant_config(native: FusedMoEMethodBase, layer: RoutedExperts) -> Any:
    """The native method's FusedMoEQuantConfig, made once and kept where vLLM 0.32 keeps it:
    ``RoutedExperts._ensure_moe_quant_config_init`` fills ``quant_method.moe_quant_config``,
    but the layer's quant_method is kt-hybrid's, so we fill the native method's ourselves."""
    if native.moe_quant_config is None:
        native.moe_quant_config = native.get_fused_moe_quant_config(layer)
    return native.moe_quant_config


def use_moe_kernel(native: FusedMoEMethodBase, kernel: tuple[Any, Any]) -> None:
    """Point ``native`` at a kernel ``rebuild_moe_kernel`` returned."""
    native.moe_quant_config, native.moe_kernel = kernel


# --- the forward context ----------------------------------------------------------------


def routed_experts_of(layer_name: str) -> RoutedExperts:
    """The RoutedExperts of MoE layer ``layer_name``, from vLLM's forward context, as
    vLLM's own ``moe_forward`` op finds its layer: vLLM 0.32 registers the layer's
    MoERunner (not the RoutedExperts) in ``static_forward_context`` under the same name."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import get_layer_from_name

    return get_layer_from_name(layer_name).routed_experts  # type: ignore[attr-defined,no-any-return]


# --- the engine core's scheduler (hybrid/scheduler.py) ------------------------------------------


class SchedulerView:
    """What kt-hybrid's scheduler reads of vLLM 0.32's ``Scheduler`` before a step
    (``admission.WaitingQueues``): the running batch is ``running``, new and preempted
    requests wait in ``waiting``, those holding KV blocks in ``kv_holding_waiting`` (admitted
    before any other), the pause state is ``_pause_state``; a ``Request`` still has
    ``num_tokens - num_computed_tokens`` to compute and arrived at ``arrival_time``
    (``time.time()`` in the front end)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def busy(self) -> int:
        return len(self.scheduler.running)

    def paused(self) -> bool:
        from vllm.v1.core.sched.interface import PauseState

        return self.scheduler._pause_state != PauseState.UNPAUSED or bool(self.scheduler.kv_holding_waiting)

    def queued(self) -> list[tuple[int, float]]:
        return [(r.num_tokens - r.num_computed_tokens, r.arrival_time) for r in self.scheduler.waiting]


@contextlib.contextmanager
def new_requests_held(scheduler: Any) -> Iterator[None]:
    """vLLM 0.32's ``Scheduler.schedule`` admits no waiting request under the pause state
    ``PAUSED_NEW`` and still runs the rest of a step (with nothing running: a step of zero
    tokens, which the engine core's busy loop follows with a 1 ms sleep and a look at its
    input queue). The state is written directly, and put back: ``set_pause_state`` logs at
    INFO, which would be one line per millisecond held."""
    from vllm.v1.core.sched.interface import PauseState

    own = scheduler._pause_state
    scheduler._pause_state = PauseState.PAUSED_NEW
    try:
        yield
    finally:
        scheduler._pause_state = own


class _HoldsNewRequests:
    """Put before vLLM's scheduler class: each step asks ``kt_gate`` (set on the instance;
    None: vLLM's own scheduling) whether to hold new requests back (``new_requests_held``)."""

    kt_gate: Callable[[SchedulerView], bool] | None = None

    def schedule(self, throttle_prefills: bool = False) -> Any:
        gate = self.kt_gate
        if gate is None or not gate(SchedulerView(self)):
            return super().schedule(throttle_prefills)  # type: ignore[misc]
        with new_requests_held(self):
            return super().schedule(throttle_prefills)  # type: ignore[misc]


@functools.cache
def holding_scheduler_class(async_scheduling: bool) -> type:
    """vLLM 0.32's scheduler class for the engine's mode (``AsyncScheduler`` where it
    schedules asynchronously: a ``Scheduler`` there would turn async scheduling off, as
    ``SchedulerConfig.get_scheduler_cls`` warns), with ``_HoldsNewRequests`` before it."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    base = AsyncScheduler if async_scheduling else Scheduler
    name = "KTHybridAsyncScheduler" if async_scheduling else "KTHybridSyncScheduler"
    return type(name, (_HoldsNewRequests, base), {"__module__": __name__})


# --- what the experts compute -----------------------------------------------------------


def expert_math(layer: RoutedExperts) -> ExpertMath:
    """What each expert of ``layer`` computes, from what vLLM 0.32 keeps on the layer and its
    ``FusedMoEConfig``: ``activation`` (a MoEActivation), ``has_bias``, ``swiglu_limit`` and
    ``swiglu_alpha`` (gpt-oss, DeepSeek-V4), ``swiglu_beta`` (MiniMax-M3),
    ``apply_router_weight_on_input`` (Llama 4)."""
    moe = layer.moe_config
    return ExpertMath(
        activation=moe.activation.value,
        has_bias=bool(moe.has_bias),
        clamp=layer.swiglu_limit,
        alpha=layer.swiglu_alpha,
        beta=layer.swiglu_beta,
        router_weight_on_input=bool(layer.apply_router_weight_on_input),
    )
