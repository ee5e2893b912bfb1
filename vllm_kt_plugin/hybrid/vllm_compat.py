"""Every place kt-hybrid reaches into vLLM beyond its public interfaces, in one module
(as ``cpu_backends/kt_kernel/compat.py`` does for kt-kernel).

Each function says which behaviour of vLLM 0.32.0 it relies on. ``TOUCHES`` lists the
attributes read or written here; ``tests/unit/test_vllm_compat.py`` checks each one on the
installed vLLM, so that an upgrade that renames one fails there, loudly, and not in the
middle of a forward.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

logger = logging.getLogger(LOGGER_NAME)

VLLM_VERSION = "0.32.0"  # the version whose behaviour every touch below was read from


@dataclass(frozen=True)
class Touch:
    """One attribute of vLLM that kt-hybrid relies on: ``owner`` (``module`` or
    ``module:Class``), the attribute, whether it lives on the owner itself or on instances
    of the class, and what we rely on."""

    owner: str
    attribute: str
    on: str  # "owner" or "instance"
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
