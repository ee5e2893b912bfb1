"""The MoE method of ``kt-hybrid``: the native method computes the GPU experts, a CPU
backend the others, and the layer returns their sum.

Per forward: submit the CPU experts -> run the native GPU experts -> sync and add. On
CUDA, kt-kernel orders its copies and work on the current stream, so the GPU experts
queued between submit and sync overlap the CPU work; on the CPU platform the same order
runs with a synchronous submit/sync.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.moe_output import UnfinalizedMoEOutput

from vllm_kt_plugin.cpu_backends.base import CPUExperts, LayerSpec
from vllm_kt_plugin.hybrid.dynamic_experts import DynamicExperts
from vllm_kt_plugin.hybrid.gpu_prefill import (
    BLOCK_FP8_STAGING_BACKEND,
    HostExperts,
    StagingBuffers,
    is_block_fp8,
    native_is_stageable,
    runs_raw_layout,
)
from vllm_kt_plugin.hybrid.metrics import CPU_PATH, GPU_PREFILL_PATH, HybridMetrics
from vllm_kt_plugin.hybrid.routing_recorder import RECORDER
from vllm_kt_plugin.planning.gpu_budget import NO_CUDA_DEVICE
from vllm_kt_plugin.planning.placement import ExpertPlacement, route_to_gpu_slots
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

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts

    from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig

logger = init_logger(LOGGER_NAME)  # vLLM's logger, for info_once

# kt-hybrid layers of this process by name, for the custom op below.
_LAYERS: dict[str, KTHybridMoEMethod] = {}


def _hybrid_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    return _LAYERS[layer_name].forward_hybrid(x, topk_weights, topk_ids)


def _hybrid_moe_fake(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str
) -> torch.Tensor:
    return torch.empty_like(x)


@functools.cache
def _register_hybrid_moe_op() -> Any:
    """``torch.ops.vllm_kt.hybrid_moe``: the hybrid forward as one opaque op, so that
    torch.compile (which traces the MoE layer on vLLM's CPU platform) neither traces into
    kt-kernel nor drops the CPU side effects."""
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    library = Library("vllm_kt", "FRAGMENT")
    direct_register_custom_op("hybrid_moe", _hybrid_moe, fake_impl=_hybrid_moe_fake, target_lib=library)
    return library  # the op lives as long as this object: functools.cache keeps it


@functools.cache
def staging_buffers(device: torch.device) -> StagingBuffers:
    """The two GPU-prefill buffers of this process, shared by its layers."""
    return StagingBuffers(device)


@functools.cache
def hybrid_metrics(interval_s: float) -> HybridMetrics | None:
    """One collector per process, shared by its layers (None when KT_METRICS_INTERVAL=0)."""
    return HybridMetrics(interval_s) if interval_s > 0 else None


def check_layer_supported(layer: RoutedExperts, moe: FusedMoEConfig) -> None:
    """What kt-kernel (and the split itself) cannot do, refused at startup."""
    name = layer.layer_name
    problems = []
    if moe.activation != MoEActivation.SILU:
        problems.append(f"its experts use {moe.activation.value}; kt-kernel computes SiLU-gated experts only")
    if moe.has_bias:
        problems.append("its experts have biases, which kt-kernel does not support")
    if layer.swiglu_limit is not None or layer.swiglu_alpha is not None:
        problems.append("its experts use a clamped/scaled SwiGLU, which kt-hybrid does not support")
    if layer.apply_router_weight_on_input:
        problems.append("it applies router weights on the input, which kt-hybrid does not support")
    parallel: FusedMoEParallelConfig = moe.moe_parallel_config
    if parallel.use_ep or parallel.enable_eplb:
        problems.append("expert parallelism / EPLB is enabled; kt-hybrid places experts itself")
    if parallel.dp_size > 1 or parallel.pcp_size > 1:
        problems.append("data or prefill-context parallelism is enabled, which kt-hybrid does not support")
    if moe.is_lora_enabled:
        problems.append("LoRA is enabled, which kt-hybrid does not support on MoE layers")
    if layer.expert_map_manager.num_fused_shared_experts:
        problems.append("shared experts are fused into the routed experts (ROCm AITER)")
    if problems:
        raise KTConfigError(
            "--quantization",
            "kt-hybrid",
            f"cannot run {name}: " + "; ".join(problems),
            "a model and settings whose MoE layers kt-kernel and the expert split support",
        )


def _cuda_graph_batch_sizes(vllm_config: VllmConfig) -> tuple[int, ...]:
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


@contextlib.contextmanager
def _expert_map(layer: RoutedExperts, expert_map: torch.Tensor) -> Iterator[None]:
    """``layer.expert_map`` (read by vLLM's kernels at each call) is ``expert_map`` for
    the duration."""
    own = layer._buffers.get("_expert_map")
    layer._buffers["_expert_map"] = expert_map
    try:
        yield
    finally:
        layer._buffers["_expert_map"] = own


def _auto_gpu_prefill_min_tokens(staging_refusal: str | None, quant_config: KTHybridConfig, break_even: int) -> int:
    """KT_GPU_PREFILL_MIN_TOKENS=auto: ``break_even`` where the layer's CPU experts can be
    staged and the model and host leave room (planning decides); else 0, saying why once."""
    refusal = quant_config.layer_plan.gpu_prefill_refusal or staging_refusal
    if refusal is not None:
        if refusal != NO_CUDA_DEVICE:
            logger.info_once("kt-hybrid: GPU prefill (KT_GPU_PREFILL_MIN_TOKENS=auto) off: %s", refusal)
        return 0
    return break_even


def _kernel_of(native: FusedMoEMethodBase) -> str:
    """The native method and its unquantized backend, for messages."""
    return f"{type(native).__name__} ({getattr(native, 'unquantized_backend', 'quantized')})"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def layer_idx_of(prefix: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(prefix)


def _layer_spec(layer: RoutedExperts, prefix: str, placement: ExpertPlacement, chunk: int) -> LayerSpec:
    vllm_config = get_current_vllm_config()
    model_config = vllm_config.model_config
    moe = layer.moe_config
    return LayerSpec(
        layer_name=prefix,
        layer_idx=layer_idx_of(prefix),
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
        cuda_graph_batch_sizes=_cuda_graph_batch_sizes(vllm_config),
    )


class KTHybridMoEMethod(FusedMoEMethodBase):
    """Splits one layer's routed experts between ``native`` (GPU) and ``cpu``."""

    def __init__(self, layer: RoutedExperts, prefix: str, quant_config: KTHybridConfig) -> None:
        moe = layer.moe_config
        super().__init__(moe)
        check_layer_supported(layer, moe)
        settings = quant_config.process_settings
        vllm_config = get_current_vllm_config()
        chunk = settings.resolve_chunked_prefill_size(vllm_config.scheduler_config.max_num_batched_tokens)

        self.layer_name = prefix
        self.layer_idx = layer_idx_of(prefix)
        self.placement = quant_config.layer_plan.placement_for(self.layer_idx, layer.global_num_experts)
        self.gpu_slot_of = self.placement.gpu_slot_of()
        self.hidden_size = moe.hidden_dim

        # The native method must see a layer that holds only the GPU experts: it sizes
        # its weights by moe_config.num_local_experts and post-processes them by
        # layer.local_num_experts. vLLM has computed neither yet when it asks for the
        # method, so they are set here, before the native method is built.
        moe.num_local_experts = self.placement.num_gpu_experts
        layer.local_num_experts = self.placement.num_gpu_experts
        self.native = quant_config.native_moe_method(layer, prefix)
        self._refuse_monolithic()
        self.requires_device_loading = self.native.requires_device_loading
        self.uses_meta_device = self.native.uses_meta_device
        self.supports_pre_processed_weights = self.native.supports_pre_processed_weights

        # With tensor parallelism, rank 0 computes the CPU experts; vLLM's all-reduce of
        # the MoE output adds them for every rank.
        self.settings = settings
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
            if spec.cuda_graph_batch_sizes and not quant_config.backend.supports_cuda_graphs:
                raise KTConfigError(
                    "KT_BACKEND",
                    settings.backend,
                    "this backend cannot run inside CUDA graphs",
                    "--enforce-eager, or KT_BACKEND=kt_kernel",
                )
            self.cpu = quant_config.backend(spec, settings)
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
                f"this layer's GPU experts run {_kernel_of(self.native)}",
                "0 for this checkpoint",
            )
        self.prefill_min_tokens = self._gpu_prefill_min_tokens(vllm_config, quant_config)
        self.host: HostExperts | None = None  # built in create_weights when GPU prefill is on
        self.dynamic: DynamicExperts | None = None  # built after loading with KT_DYNAMIC_GPU_EXPERTS
        self._create_args: dict[str, Any] = {}
        self._make_shadow_method = functools.partial(self._native_for_shadow, quant_config, prefix)
        self._next_host: HostExperts | None = None

        self.metrics = hybrid_metrics(settings.metrics_interval_s)
        if self.metrics is not None and self.cpu is not None:
            self.metrics.add_layer(self.layer_idx)
        self._layer = weakref.ref(layer)
        _LAYERS[prefix] = self
        _register_hybrid_moe_op()
        logger.info_once(
            "kt-hybrid: each MoE layer keeps %s; GPU side: %s, CPU side: %s %s with %d threads",
            self.placement.describe(),
            type(self.native).__name__,
            settings.backend,
            settings.method,
            settings.cpuinfer_threads,
        )

    @staticmethod
    def _native_for_shadow(quant_config: KTHybridConfig, prefix: str, shadow: RoutedExperts) -> FusedMoEMethodBase:
        return quant_config.native_moe_method(shadow, prefix)

    def _gpu_prefill_min_tokens(self, vllm_config: VllmConfig, quant_config: KTHybridConfig) -> int:
        """KT_GPU_PREFILL_MIN_TOKENS for this layer: 0 where it cannot apply; never at or
        below a CUDA-graph batch size (captured batches replay the CPU path)."""
        threshold = self.settings.gpu_prefill_min_tokens
        if threshold == 0 or not self.placement.num_cpu_experts:
            return 0
        if threshold is None and self.settings.dynamic_gpu_experts:
            logger.info_once(
                "kt-hybrid: GPU prefill (KT_GPU_PREFILL_MIN_TOKENS=auto) off: KT_DYNAMIC_GPU_EXPERTS moves experts, "
                "GPU prefill stages a fixed set"
            )
            return 0
        refusal = self._staging_refusal()
        if threshold is None:
            break_even = GPU_PREFILL_AUTO_MIN_TOKENS_FP8 if is_block_fp8(self.native) else GPU_PREFILL_AUTO_MIN_TOKENS
            threshold = _auto_gpu_prefill_min_tokens(refusal, quant_config, break_even)
            if not threshold:
                return 0
        elif refusal is not None:
            raise KTConfigError("KT_GPU_PREFILL_MIN_TOKENS", str(threshold), refusal, "0 (off) for this checkpoint")
        graphs = _cuda_graph_batch_sizes(vllm_config)
        if graphs and threshold <= graphs[-1]:
            logger.info_once(
                "kt-hybrid: KT_GPU_PREFILL_MIN_TOKENS=%d raised to %d: batches up to %d tokens replay CUDA graphs",
                threshold,
                graphs[-1] + 1,
                graphs[-1],
            )
            threshold = graphs[-1] + 1
        return threshold

    def _staging_refusal(self) -> str | None:
        """Why GPU prefill cannot stage this layer's CPU experts, or None: it stages
        unquantized experts run by vLLM's Triton (or CPU) kernels, and block-FP8 experts as
        kt-kernel's FP8 writes them back (no tensor parallelism: it writes whole experts)."""
        if native_is_stageable(self.native):
            return None
        if not is_block_fp8(self.native):
            return (
                "GPU prefill stages unquantized experts run by vLLM's Triton (or CPU) MoE kernels and block-FP8 "
                f"ones; this checkpoint's GPU method is {_kernel_of(self.native)}"
            )
        rule = "GPU prefill stages block-FP8 experts as kt-kernel's FP8 writes them back, under CUDA, whole"
        if self.settings.method != "FP8":
            return f"{rule}: KT_METHOD=FP8 (this checkpoint's default), not {self.settings.method}"
        if self.moe.tp_size > 1:
            return f"{rule}: one tensor-parallel rank, not --tensor-parallel-size {self.moe.tp_size}"
        if self.moe.device.type != "cuda":
            return f"{rule}: a CUDA device, not {self.moe.device.type}"
        if self.cpu is not None and not self.cpu.writes_gpu_layout:
            return f"{rule}: KT_BACKEND={self.settings.backend} (this build) cannot write its FP8 experts back"
        return None

    def _refuse_monolithic(self) -> None:
        # FusedMoEMethodBase.is_monolithic fails while a method has not picked its
        # kernel yet (e.g. fp8 before loading); we then check again after loading.
        native = self.native
        chosen = native.moe_kernel is not None or getattr(native, "experts_cls", None) is not None
        if chosen and native.is_monolithic:
            raise KTConfigError(
                "--moe-backend",
                type(self.native).__name__,
                "vLLM chose a monolithic MoE kernel (routing inside the kernel), which cannot leave experts to the CPU",
                "a modular backend, e.g. --moe-backend triton",
            )

    @contextlib.contextmanager
    def _native_view(self, layer: RoutedExperts) -> Iterator[None]:
        """Let ``layer.quant_method`` be the native method for the duration: vLLM's expert
        weight loader special-cases methods by class name (compressed-tensors, ModelOpt)
        and reads attributes such as ``weight_scale_refine`` from it. Set through
        ``object.__setattr__``: the native method may be an nn.Module (a CustomOp), and
        nn.Module's setattr would register it as a child and refuse our method back."""
        own = layer.__dict__["quant_method"]
        object.__setattr__(layer, "quant_method", self.native)
        try:
            yield
        finally:
            object.__setattr__(layer, "quant_method", own)

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
        existing = set(layer._parameters)
        with self._native_view(layer):
            self.native.create_weights(
                layer,
                num_experts=num_experts,
                hidden_size=hidden_size,
                intermediate_size_per_partition=intermediate_size_per_partition,
                params_dtype=params_dtype,
                **extra_weight_attrs,
            )
        if self.prefill_min_tokens:
            cuda = self.moe.device.type == "cuda"
            self.host = HostExperts(
                layer,
                self._make_shadow_method,
                self.placement.cpu_expert_ids(),
                dict(
                    hidden_size=hidden_size,
                    intermediate_size_per_partition=intermediate_size_per_partition,
                    params_dtype=params_dtype,
                    **extra_weight_attrs,
                ),
                pin=cuda,
                writer=self._gpu_layout_writer(cuda, params_dtype),
                moe_backend=BLOCK_FP8_STAGING_BACKEND if cuda and is_block_fp8(self.native) else None,
            )
            mismatch = self.host.writer_mismatch()
            if mismatch is not None:  # e.g. biased experts, or other block scales: before any load
                threshold = self.settings.gpu_prefill_min_tokens
                raise KTConfigError(
                    "KT_GPU_PREFILL_MIN_TOKENS", "auto" if threshold is None else str(threshold), mismatch, "0 (off)"
                )
        # Wrap the loaders the native method installed (it may have wrapped vLLM's own,
        # e.g. moe_wna16), so expert ids are translated before any of them runs.
        for name, param in layer.named_parameters(recurse=False):
            loader = getattr(param, "weight_loader", None)
            if name not in existing and loader is not None:
                param.weight_loader = self._expert_weight_loader(layer, loader, name)

    def _gpu_layout_writer(self, cuda: bool, params_dtype: torch.dtype) -> CPUExperts | None:
        """The CPU backend, where it can write its experts in the native kernel's layout
        (then GPU prefill keeps no host copy): under CUDA (vLLM's CPU kernels repack
        theirs), whole experts (no tensor parallelism), in the checkpoint's format (BF16
        for unquantized checkpoints, FP8 for block-FP8 ones)."""
        fits = cuda and self.moe.tp_size == 1
        writes = self.cpu is not None and self.cpu.writes_gpu_layout
        written = KT_GPU_LAYOUT_WRITERS.get(self.settings.method or "")
        if is_block_fp8(self.native):  # the shadow then runs Triton (see HostExperts)
            same_format = written == BLOCK_FP8
        else:
            same_format = written == UNQUANTIZED and params_dtype == torch.bfloat16 and runs_raw_layout(self.native)
        return self.cpu if fits and writes and same_format else None

    def _expert_weight_loader(
        self, layer: RoutedExperts, native_loader: Callable[..., Any], param_name: str
    ) -> Callable[..., Any]:
        """Checkpoint tensors of GPU experts go to the native loader under their GPU slot;
        those of CPU experts go to the CPU backend and never reach the device (with GPU
        prefill, also to the layer's host copy, in its CPU-expert slot)."""
        slots = self.gpu_slot_of.tolist()
        cpu_slots = self.placement.cpu_slot_of().tolist()
        cpu = self.cpu
        host = self.host

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
                if host is not None and host.copies:
                    host.load(param_name, loaded_weight, weight_name, shard_id, cpu_slots[expert_id])
                return True if return_success else None
            with self._native_view(layer):
                return native_loader(param, loaded_weight, weight_name, shard_id, slot, return_success)

        weight_loader.supports_moe_loading = True  # type: ignore[attr-defined]
        return weight_loader

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if self.placement.num_gpu_experts:
            with self._native_view(layer):
                self.native.process_weights_after_loading(layer)
            self._refuse_monolithic()
        self.gpu_slot_of = self.gpu_slot_of.to(self.moe.device)
        if self.cpu is not None:
            self.cpu.finalize_weights(self._deferral())
        if self.host is not None:
            self._finalize_host()
        if self.settings.dynamic_gpu_experts and self.cpu is not None and self.placement.num_gpu_experts:
            self.dynamic = DynamicExperts(
                self.layer_name,
                self.placement,
                self.gpu_slot_of,
                self.cpu,
                self._make_shadow_method,
                self._create_args,
                self.settings.dynamic_gpu_experts,
            )
            logger.info_once(
                "kt-hybrid: dynamic GPU experts: every %d-th forward outside CUDA graphs, each layer's most-picked "
                "CPU experts swap with its least-picked GPU experts",
                self.settings.dynamic_gpu_experts,
            )

    def _finalize_host(self) -> None:
        assert self.host is not None
        load_format = str(get_current_vllm_config().load_config.load_format)
        self.host.finalize(load_format == "dummy", self.placement.cpu_slot_of().to(self.moe.device))
        self.staging = staging_buffers(self.moe.device)
        self.staging.reserve(self.host)
        if self.host.copies:
            hosts = [m.host for m in _LAYERS.values() if m.host is not None]
            memory = "pinned host" if self.moe.device.type == "cuda" else "host"
            copy_gib = sum(h.host_nbytes for h in hosts) / GIB
            source = f"the CPU experts' copy takes {copy_gib:.2f} GiB of {memory} memory ({len(hosts)} layers)"
        else:
            source = f"{self.settings.method} CPU experts written by {self.settings.backend} (no host copy)"
        logger.info_once(
            "kt-hybrid: GPU prefill for forwards of >= %d tokens: %s, %s",
            self.prefill_min_tokens,
            source,
            self.staging.describe(),
        )

    def _deferral(self) -> int:
        """KT_MAX_DEFERRED_EXPERTS_PER_TOKEN, where the next decoder layer is a kt-hybrid
        layer of this process that will add the deferred experts; else 0 (e.g. on the
        last MoE layer), so that no expert output is ever dropped."""
        next_is_hybrid = any(m.cpu is not None and m.layer_idx == self.layer_idx + 1 for m in _LAYERS.values())
        return self.settings.max_deferred_experts_per_token if next_is_hybrid else 0

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig | None:
        if not self.placement.num_gpu_experts:
            return FusedMoEQuantConfig.make()
        if self.native.moe_quant_config is None:
            self.native.moe_quant_config = self.native.get_fused_moe_quant_config(layer)
        return self.native.moe_quant_config

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
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        layer: RoutedExperts | None = None,
    ) -> torch.Tensor:
        layer = layer if layer is not None else self._layer()
        assert layer is not None, f"{self.layer_name} was garbage-collected"
        capturing = _capturing()
        if self.dynamic is not None:
            if not capturing:
                self.dynamic.maybe_refresh(layer)  # before this forward's work is queued
            self.dynamic.observe(topk_ids)
        if RECORDER.enabled:
            RECORDER.record(self.layer_idx, topk_ids, self.placement.gpu_mask)
        staged = self.host is not None and x.shape[0] >= self.prefill_min_tokens and not capturing
        metrics = self.metrics if self.cpu is not None else None
        if metrics is not None and not capturing:
            metrics.large_forward(self.layer_idx, x.shape[0], GPU_PREFILL_PATH if staged else CPU_PATH)
        if staged:
            return self._forward_on_gpu(layer, x, topk_weights, topk_ids)
        probe = metrics.probe(self.layer_idx, x) if metrics is not None else None
        # Some GPU kernels pad the hidden size; the CPU experts see the model's own.
        x_cpu = x[..., : self.hidden_size] if x.shape[-1] != self.hidden_size else x
        if self.cpu is not None:
            self.cpu.submit(x_cpu, topk_ids, topk_weights)
        if probe is not None:
            probe.submitted()
        out = self._gpu_experts(layer, x, topk_weights, topk_ids)
        if self.cpu is None:
            return out if out is not None else torch.zeros_like(x)
        if probe is not None:
            probe.gpu_done()
        cpu_out = self.cpu.sync(x_cpu).to(x.dtype)
        if cpu_out.shape[-1] != x.shape[-1]:
            cpu_out = F.pad(cpu_out, (0, x.shape[-1] - cpu_out.shape[-1]))
        result = cpu_out.clone() if out is None else out + cpu_out
        if probe is not None:
            probe.synced()
        return result

    def _forward_on_gpu(
        self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Every routed expert on the GPU: the GPU experts as always, the CPU experts from
        the staging buffer, while the next layer's CPU experts are copied in."""
        assert self.host is not None
        if self.staging.cuda and self.placement.num_gpu_experts and runs_raw_layout(self.native):
            # vLLM's Triton kernels (unquantized and block-FP8: the staged shadows run them
            # so) drop the picks an expert map sends to -1 before any GEMM: thousands of
            # CPU-expert picks then cost nothing here, where zero weights would pile them
            # all onto GPU slot 0 (as they still do for other kernels, whose expert maps we
            # have not checked).
            with _expert_map(layer, self.gpu_slot_of):
                out = self._native_apply(layer, x, topk_weights, topk_ids)
        else:
            out = self._gpu_experts(layer, x, topk_weights, topk_ids)
        index, staged = self.staging.acquire(self.host)
        cpu_out = self.host.apply(staged, x, topk_weights, topk_ids)
        self.staging.release(index)
        # After this layer's work is queued: a written next layer blocks this thread.
        if self._next_host is None:
            self._next_host = self._following_host()
        if self._next_host is not self.host:
            self.staging.prefetch(self._next_host, busy=index)
        logger.info_once(
            "kt-hybrid: GPU prefill ran: a forward of >= %d tokens computed the CPU experts on the GPU",
            self.prefill_min_tokens,
        )
        return cpu_out if out is None else out + cpu_out

    def _following_host(self) -> HostExperts:
        """The host copy of the next layer that has one (wrapping to the first), to prefetch."""
        hosts = sorted((m.layer_idx, id(m), m.host) for m in _LAYERS.values() if m.host is not None)
        later = [h for idx, _, h in hosts if idx > self.layer_idx]
        return later[0] if later else hosts[0][2]

    def _gpu_experts(
        self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor | None:
        if not self.placement.num_gpu_experts:
            return None
        slot_ids, slot_weights = route_to_gpu_slots(topk_ids, topk_weights, self.gpu_slot_of)
        return self._native_apply(layer, x, slot_weights, slot_ids)

    def _native_apply(
        self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out = self.native.apply(
            layer=layer,
            x=x,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            shared_experts=None,
            shared_experts_input=None,
        )
        if isinstance(out, UnfinalizedMoEOutput):
            raise RuntimeError(
                f"{self.layer_name}: the native MoE kernel deferred its finalize; kt-hybrid needs its output"
            )
        return out
