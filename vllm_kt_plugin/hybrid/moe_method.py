"""The MoE method of ``kt-hybrid``: what vLLM sees of a layer whose routed experts are
split between the checkpoint's native method (the GPU experts) and a CPU backend.

vLLM builds it, loads its weights and calls ``apply``; each forward then reads as route ->
pick a path (``paths``: the staging path its plan chose, then ``cpu_path``) -> run it, with
observers told (``contracts``; ``observers``, ``dynamic_experts``). What the layers of a
process share, the layer reaches through its context (``contracts.ProcessState``); vLLM
internals, through ``vllm_compat``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.library import Library
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_kt_plugin.cpu_backends.base import CPUExperts, LayerSpec
from vllm_kt_plugin.hybrid.backend_choice import backend_for
from vllm_kt_plugin.hybrid.contracts import NO_MARKS, Forward, ForwardObserver, LayerParts, StageMarks, combined
from vllm_kt_plugin.hybrid.dynamic_experts import DynamicExperts
from vllm_kt_plugin.hybrid.gpu_experts import GPUExperts, kernel_of, native_is_stageable
from vllm_kt_plugin.hybrid.loaded_experts import LoadedExperts, rows_in_slot_order
from vllm_kt_plugin.hybrid.observers import RecordsDecode, RecordsRouting, RecordsTimeline, TimesLayer
from vllm_kt_plugin.hybrid.paths import build_paths
from vllm_kt_plugin.hybrid.vllm_compat import (
    ask_for_amx_tiles,
    expert_math,
    fused_shared_experts,
    layer_index,
    lora_enabled,
    native_moe_quant_config,
    native_view,
    prefill_context_parallel_size,
    route_stack_copies,
    routed_experts_of,
    set_local_num_experts,
    stack_copies_released,
    wrap_expert_weight_loaders,
)
from vllm_kt_plugin.planning.placement import ExpertPlacement
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME
from vllm_kt_plugin.settings.errors import KTConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    from vllm_kt_plugin.hybrid.contracts import LayerContext

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once


def _hybrid_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    layer = routed_experts_of(layer_name)
    return layer.quant_method.forward_hybrid(x, topk_weights, topk_ids, layer)


def _hybrid_moe_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty_like(x)


# ``torch.ops.vllm_kt.hybrid_moe``: the hybrid forward as one opaque op, so that
# torch.compile (which traces the MoE layer on vLLM's CPU platform) neither traces into
# kt-kernel nor drops the CPU side effects. Registered once per process, on import, as
# vLLM registers its own moe_forward; the op lives as long as its library object.
_LIBRARY = Library("vllm_kt", "FRAGMENT")
direct_register_custom_op("hybrid_moe", _hybrid_moe, fake_impl=_hybrid_moe_fake, target_lib=_LIBRARY)


def check_layer_supported(layer: RoutedExperts, moe: FusedMoEConfig) -> None:
    """What kt-hybrid cannot do with any CPU backend, refused at startup (what the experts
    compute is each backend's to say: ``backend_choice``)."""
    name = layer.layer_name
    problems = []
    parallel: FusedMoEParallelConfig = moe.moe_parallel_config
    if parallel.use_ep or parallel.enable_eplb:
        problems.append("expert parallelism / EPLB is enabled; kt-hybrid places experts itself")
    if parallel.dp_size > 1 or prefill_context_parallel_size(parallel) > 1:
        problems.append("data or prefill-context parallelism is enabled, which kt-hybrid does not support")
    if lora_enabled(moe):
        problems.append("LoRA is enabled, which kt-hybrid does not support on MoE layers")
    if fused_shared_experts(layer):
        problems.append("shared experts are fused into the routed experts (ROCm AITER)")
    if problems:
        raise KTConfigError(
            "--quantization",
            "kt-hybrid",
            f"cannot run {name}: " + "; ".join(problems),
            "a model and settings whose MoE layers kt-kernel and the expert split support",
        )


def cuda_graph_batch_sizes(vllm_config: VllmConfig) -> tuple[int, ...]:
    """Batch sizes vLLM will capture CUDA graphs for (none on CPU or when eager)."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    compilation = vllm_config.compilation_config
    if (
        not current_platform.is_cuda_alike()
        or vllm_config.model_config.enforce_eager
        or compilation.cudagraph_mode in (None, CUDAGraphMode.NONE)
    ):
        return ()
    return tuple(sorted(compilation.cudagraph_capture_sizes or ()))


def _layer_spec(layer: RoutedExperts, prefix: str, placement: ExpertPlacement, chunk: int) -> LayerSpec:
    vllm_config = get_current_vllm_config()
    model_config = vllm_config.model_config
    moe = layer.moe_config
    return LayerSpec(
        layer_name=prefix,
        layer_idx=layer_index(prefix),
        num_experts=layer.global_num_experts,
        top_k=moe.experts_per_token,
        hidden_size=moe.hidden_dim,
        intermediate_size=moe.intermediate_size,
        placement=placement,
        chunked_prefill_size=chunk,
        model=model_config.model,
        revision=model_config.revision,
        download_dir=vllm_config.load_config.download_dir,
        load_format=str(vllm_config.load_config.load_format),
        cuda_graph_batch_sizes=cuda_graph_batch_sizes(vllm_config),
        math=expert_math(layer),
    )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class KTHybridMoEMethod(FusedMoEMethodBase):
    """Splits one layer's routed experts between ``native`` (GPU) and ``cpu``."""

    def __init__(self, layer: RoutedExperts, prefix: str, context: LayerContext) -> None:
        moe = layer.moe_config
        super().__init__(moe)
        check_layer_supported(layer, moe)
        # This process will forward the layer: AMX tiles first, or vLLM's CPU kernels die of
        # SIGILL with --enforce-eager on AMX CPUs (vllm_compat.ask_for_amx_tiles says why).
        ask_for_amx_tiles()
        settings = context.settings
        vllm_config = get_current_vllm_config()
        chunk = settings.resolve_chunked_prefill_size(vllm_config.scheduler_config.max_num_batched_tokens)

        self.layer_name = prefix
        self.layer_idx = layer_index(prefix)
        self.settings = settings
        self.context = context
        self.placement = context.plan.placement_for(self.layer_idx, layer.global_num_experts)

        # The native method must see a layer that holds only the GPU experts.
        set_local_num_experts(layer, self.placement.num_gpu_experts)
        self.native = context.make_native(layer, prefix)
        self.gpu = GPUExperts(prefix, self.native, self.placement)
        self.gpu.refuse_monolithic()
        self.requires_device_loading = self.native.requires_device_loading
        self.uses_meta_device = self.native.uses_meta_device
        self.supports_pre_processed_weights = self.native.supports_pre_processed_weights

        # With tensor parallelism, rank 0 computes the CPU experts; vLLM's all-reduce of
        # the MoE output adds them for every rank.
        if settings.dynamic_gpu_experts and moe.tp_size > 1:
            raise KTConfigError(
                "KT_DYNAMIC_GPU_EXPERTS",
                str(settings.dynamic_gpu_experts),
                f"tensor parallelism splits the GPU experts over {moe.tp_size} ranks; only rank 0 holds the CPU "
                "experts that would move",
                "0 with --tensor-parallel-size > 1",
            )
        self.cpu: CPUExperts | None = None
        if self.placement.num_cpu_experts and moe.tp_rank == 0:
            spec = _layer_spec(layer, prefix, self.placement, chunk)
            backend = backend_for(prefix, spec.math, context.backend, settings, context.checkpoint)
            if spec.cuda_graph_batch_sizes and not backend.supports_cuda_graphs:
                raise KTConfigError(
                    "KT_BACKEND",
                    backend.name,
                    "this backend cannot run inside CUDA graphs",
                    "--enforce-eager, or KT_BACKEND=kt_kernel",
                )
            self.cpu = backend(spec, settings)
        if self.placement.num_cpu_experts and moe.tp_size > 1:
            logger.info_once(
                "kt-hybrid: tensor-parallel rank %d of %d %s",
                moe.tp_rank,
                moe.tp_size,
                "computes the CPU experts for all ranks" if self.cpu else "leaves the CPU experts to rank 0",
                scope="process",
            )

        if settings.dynamic_gpu_experts and self.cpu is not None and not native_is_stageable(self.native):
            raise KTConfigError(
                "KT_DYNAMIC_GPU_EXPERTS",
                str(settings.dynamic_gpu_experts),
                "experts move into GPU slots of unquantized experts run by vLLM's Triton (or CPU) MoE kernels; "
                f"this layer's GPU experts run {kernel_of(self.native)}",
                "0 for this checkpoint",
            )
        self.parts = LayerParts(
            layer_name=prefix,
            layer_idx=self.layer_idx,
            moe=moe,
            placement=self.placement,
            gpu=self.gpu,
            cpu=self.cpu,
            context=context,
            cuda_graph_batch_sizes=cuda_graph_batch_sizes(vllm_config),
            make_shadow_native=functools.partial(_native_for_shadow, context.make_native, prefix),
        )
        self.paths = build_paths(self.parts)
        self.observers: list[ForwardObserver] = [
            RecordsRouting(context.process.recorder, self.layer_idx, self.placement)
        ]
        metrics = context.process.metrics(settings.metrics_interval_s)
        if metrics is not None and self.cpu is not None:
            self.observers.append(TimesLayer(metrics, self.layer_idx))
        if self.cpu is not None:
            self.observers.append(RecordsTimeline(context.process.timeline, self.layer_idx))
            if context.process.decode_timeline.armed:
                self.observers.append(RecordsDecode(context.process.decode_timeline, self.layer_idx))
        self.dynamic: DynamicExperts | None = None  # built after loading with KT_DYNAMIC_GPU_EXPERTS
        self.loaded_cpu_experts: LoadedExperts | None = None  # for a backend that takes them so
        self._create_args: dict[str, Any] = {}
        context.process.add_layer(self)
        logger.info_once(
            "kt-hybrid: each MoE layer keeps %s; GPU side: %s, CPU side: %s",
            self.placement.describe(),
            type(self.native).__name__,
            self.cpu.describe()
            if self.cpu is not None
            else f"{settings.backend} {settings.method} with {settings.cpuinfer_threads} threads",
        )

    # --- weights -----------------------------------------------------------------------

    def maybe_roundup_sizes(
        self,
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: FusedMoEParallelConfig,
    ) -> tuple[int, int]:
        return self.native.maybe_roundup_sizes(
            hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config
        )

    def create_weights(
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        assert num_experts == self.placement.num_gpu_experts, (num_experts, self.placement)
        self._create_args = dict(
            hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            params_dtype=params_dtype,
            **extra_weight_attrs,
        )
        existing = {name for name, _ in layer.named_parameters(recurse=False)}
        with native_view(layer, self.native):
            self.native.create_weights(layer, num_experts=num_experts, **self._create_args)
        for path in self.paths:
            path.create_weights(layer, dict(self._create_args))
        if self.cpu is not None and self.cpu.takes_loaded_experts:
            self.loaded_cpu_experts = LoadedExperts(
                layer, self.placement.num_cpu_experts, self.parts.make_shadow_native, dict(self._create_args)
            )
        # Wrap the loaders the native method installed (it may have wrapped vLLM's own,
        # e.g. moe_wna16), so expert ids are translated before any of them runs.
        new = {name for name, _ in layer.named_parameters(recurse=False)} - existing
        wrap_expert_weight_loaders(layer, new, functools.partial(self._expert_weight_loader, layer))
        route_stack_copies(layer, new, layer.global_num_experts, functools.partial(self._copy_expert_stack, layer))

    def _copy_expert_stack(self, layer: RoutedExperts, param_name: str, stack: torch.Tensor) -> None:
        """A model's copy of the whole layer's stack ``param_name`` (one row per expert, in
        the parameter's layout; vllm_compat.route_stack_copies): the GPU experts' rows into
        their slots, the CPU experts' to the backend that takes loaded experts."""
        getattr(layer, param_name).data.copy_(rows_in_slot_order(stack, self.gpu.gpu_slot_of))
        if self.cpu is None:
            return
        if self.loaded_cpu_experts is None:
            raise NotImplementedError(
                f"kt-hybrid: this model copies {self.layer_name}'s {param_name} past vLLM's expert loader; "
                f"only a CPU backend that takes vLLM's loaded experts (torch) can take them, not {self.cpu.name}"
            )
        self.loaded_cpu_experts.copy_rows(param_name, rows_in_slot_order(stack, self.placement.cpu_slot_of()))

    def _expert_weight_loader(
        self, layer: RoutedExperts, native_loader: Callable[..., Any], param_name: str
    ) -> Callable[..., Any]:
        """Checkpoint tensors of GPU experts go to the native loader under their GPU slot;
        those of CPU experts go to the CPU backend and never reach the device (and to the
        paths that keep CPU experts of their own, e.g. staging's host copy, in their
        CPU-expert slot)."""
        slots = self.gpu.gpu_slot_of.tolist()
        cpu_slots = self.placement.cpu_slot_of().tolist()
        cpu = self.cpu
        paths = self.paths
        native = self.native
        loaded_cpu_experts = self.loaded_cpu_experts

        def weight_loader(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool | None:
            if loaded_weight.dim() == 3 and loaded_weight.shape[0] == len(slots):
                # One tensor for every expert: route each expert's row on its own.
                for eid, row in enumerate(loaded_weight.unbind()):
                    weight_loader(param, row, weight_name, shard_id, eid, return_success)
                return True if return_success else None
            slot = slots[expert_id]
            if cpu is not None and (slot < 0 or cpu.wants_all_experts):
                cpu.load_checkpoint_tensor(expert_id, shard_id, loaded_weight)
            if slot < 0:
                if loaded_cpu_experts is not None:
                    loaded_cpu_experts.load(param_name, loaded_weight, weight_name, shard_id, cpu_slots[expert_id])
                for path in paths:
                    path.load_cpu_expert(param_name, loaded_weight, weight_name, shard_id, cpu_slots[expert_id])
                return True if return_success else None
            with native_view(layer, native):
                return native_loader(param, loaded_weight, weight_name, shard_id, slot, return_success)

        return weight_loader

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        stack_copies_released(layer)
        if self.placement.num_gpu_experts:
            with native_view(layer, self.native):
                self.native.process_weights_after_loading(layer)
            self.gpu.refuse_monolithic()
        self.gpu.to(self.moe.device)
        if self.cpu is not None:
            if self.loaded_cpu_experts is not None and self.loaded_cpu_experts.loaded:
                self.cpu.load_loaded_experts(self.loaded_cpu_experts.tensors())
            self.cpu.finalize_weights(self._deferral())
        for path in self.paths:
            path.after_loading(layer)
        if self.settings.dynamic_gpu_experts and self.cpu is not None and self.placement.num_gpu_experts:
            self.observers = [o for o in self.observers if o is not self.dynamic]  # a reload builds it again
            self.dynamic = DynamicExperts(
                self.layer_name,
                self.placement,
                self.gpu.gpu_slot_of,
                self.cpu,
                self.parts.make_shadow_native,
                self._create_args,
                self.settings.dynamic_gpu_experts,
                self.context.process.swap_log,
            )
            self.observers.insert(0, self.dynamic)  # its refresh moves experts before anyone reads the placement
            logger.info_once(
                "kt-hybrid: dynamic GPU experts: every %d-th forward outside CUDA graphs, each layer's most-picked "
                "CPU experts swap with its least-picked GPU experts",
                self.settings.dynamic_gpu_experts,
            )

    def _deferral(self) -> int:
        """KT_MAX_DEFERRED_EXPERTS_PER_TOKEN, where the next decoder layer is a kt-hybrid
        layer of this process that will add the deferred experts; else 0 (e.g. on the
        last MoE layer), so that no expert output is ever dropped."""
        adds = self.context.process.adds_deferred_experts(self.layer_idx)
        return self.settings.max_deferred_experts_per_token if adds else 0

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig | None:
        if not self.placement.num_gpu_experts:
            return FusedMoEQuantConfig.make()
        return native_moe_quant_config(self.native, layer)  # type: ignore[no-any-return]

    # --- forward -------------------------------------------------------------------------

    def apply(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: SharedExperts | None,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        # Shared experts are left to vLLM's runner: this method reports no internal
        # overlap (moe_kernel is None), so the runner computes them itself.
        if torch.compiler.is_compiling():
            return torch.ops.vllm_kt.hybrid_moe(x, topk_weights, topk_ids, self.layer_name)
        return self.forward_hybrid(x, topk_weights, topk_ids, layer)

    def forward_hybrid(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: RoutedExperts
    ) -> torch.Tensor:
        """Route -> pick the first path that takes the forward -> run it, observers told."""
        forward = Forward(layer, x, topk_weights, topk_ids, _capturing())
        for observer in self.observers:
            observer.routed(forward)
        path = next(p for p in self.paths if p.takes(forward))
        return path.run(forward, self._marks(forward, path.name))

    def _marks(self, forward: Forward, path: str) -> StageMarks:
        return combined([m for o in self.observers if (m := o.path_taken(forward, path)) is not NO_MARKS])


def _native_for_shadow(
    make_native: Callable[[RoutedExperts, str], FusedMoEMethodBase], prefix: str, shadow: RoutedExperts
) -> FusedMoEMethodBase:
    return make_native(shadow, prefix)
