"""A layer's GPU experts: the checkpoint's native vLLM method, run on the experts the
placement keeps on the GPU (its "slots"), and what its kernel can take.

Every forward path computes the GPU experts through ``GPUExperts``; staging reads what the
kernel takes once, when the layer is built (``native_kernel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_kt_plugin.hybrid.vllm_compat import (
    expert_map_set,
    fp8_backend_name,
    is_block_fp8,
    is_unfinalized,
    kernel_chosen,
    unquantized_backend_name,
)
from vllm_kt_plugin.planning.placement import route_to_gpu_slots
from vllm_kt_plugin.settings.catalogue import BLOCK_FP8, UNQUANTIZED
from vllm_kt_plugin.settings.errors import KTConfigError

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    from vllm_kt_plugin.planning.placement import ExpertPlacement


# Unquantized backends whose kernels take the weights as they are laid out in the layer
# (plus vLLM's CPU build, for tests); others (AITER, FlashInfer, MoonEP) repack them.
STAGEABLE_BACKENDS = ("TRITON", "BATCHED_TRITON", "CPU")

# Backends (unquantized, and of vLLM's FP8 method) that run the checkpoint's layout unchanged
# (w13 = gate then up), as a CPU backend that writes its experts in the GPU layout
# (kt-kernel's BF16 and FP8) hands them out.
RAW_LAYOUT_BACKENDS = ("TRITON", "BATCHED_TRITON")

# vLLM's MoE backend of block-FP8 shadows: its Triton kernel takes the experts in the
# checkpoint's layout unchanged (vLLM's conversion for it is the identity), which is what
# kt-kernel's FP8 writes; others (DeepGEMM, FlashInfer, Marlin) re-lay weights or scales out
# at setup. (On the H200 vLLM 0.32 picks Triton for the GPU experts too.)
BLOCK_FP8_STAGING_BACKEND = "triton"


def native_is_stageable(native: FusedMoEMethodBase, backends: tuple[str, ...] = STAGEABLE_BACKENDS) -> bool:
    """Whether the native method's kernel reads its weights from the layer at each call
    (and runs one of ``backends``)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return isinstance(native, UnquantizedFusedMoEMethod) and unquantized_backend_name(native) in backends


def runs_raw_layout(native: FusedMoEMethodBase) -> bool:
    """Whether the native method's kernel runs the checkpoint's layout unchanged, as a CPU
    backend that writes its experts hands them out."""
    if is_block_fp8(native):
        return fp8_backend_name(native) in RAW_LAYOUT_BACKENDS
    return native_is_stageable(native, RAW_LAYOUT_BACKENDS)


def kernel_of(native: FusedMoEMethodBase) -> str:
    """The native method and its unquantized backend, for messages."""
    return f"{type(native).__name__} ({unquantized_backend_name(native) or 'quantized'})"


@dataclass(frozen=True)
class NativeKernel:
    """What staging needs of the native method's kernel, read once when the layer is built."""

    name: str  # the method and its backend, for messages
    experts: str  # as the staging plan names them: UNQUANTIZED, BLOCK_FP8, else ``name``
    reads_layer: bool  # unquantized, read from the layer at each call (stageable, movable)
    block_fp8: bool
    raw_layout: bool  # runs the checkpoint's layout unchanged (what kt-kernel writes back)


def native_kernel(native: FusedMoEMethodBase) -> NativeKernel:
    reads_layer, block_fp8 = native_is_stageable(native), is_block_fp8(native)
    name = kernel_of(native)
    experts = UNQUANTIZED if reads_layer else BLOCK_FP8 if block_fp8 else name
    return NativeKernel(name, experts, reads_layer, block_fp8, runs_raw_layout(native))


class GPUExperts:
    """The native method on the layer's GPU experts: expert ids become GPU slots
    (``gpu_slot_of``, -1 for CPU experts), picks of CPU experts weigh nothing."""

    def __init__(self, layer_name: str, native: FusedMoEMethodBase, placement: ExpertPlacement) -> None:
        self.layer_name = layer_name
        self.native = native
        self.placement = placement
        self.gpu_slot_of = placement.gpu_slot_of()  # on the device after loading (``to``)

    @property
    def count(self) -> int:
        return self.placement.num_gpu_experts

    def to(self, device: torch.device) -> None:
        self.gpu_slot_of = self.gpu_slot_of.to(device)

    def refuse_monolithic(self) -> None:
        """A monolithic kernel routes inside itself and cannot leave experts to the CPU.
        Checked when built and again after loading (fp8 picks its kernel only then)."""
        if kernel_chosen(self.native) and self.native.is_monolithic:
            raise KTConfigError(
                "--moe-backend",
                type(self.native).__name__,
                "vLLM chose a monolithic MoE kernel (routing inside the kernel), which cannot leave experts to the CPU",
                "a modular backend, e.g. --moe-backend triton",
            )

    def apply(
        self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """The GPU experts' share of the layer output (None without GPU experts)."""
        if not self.count:
            return None
        slot_ids, slot_weights = route_to_gpu_slots(topk_ids, topk_weights, self.gpu_slot_of)
        return self.apply_native(layer, x, slot_weights, slot_ids)

    def apply_skipping_cpu_experts(
        self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``apply`` for vLLM's Triton kernels (unquantized and block-FP8), which drop the
        picks an expert map sends to -1 before any GEMM: thousands of CPU-expert picks of a
        prefill then cost nothing, where zero weights would pile them onto GPU slot 0."""
        with expert_map_set(layer, self.gpu_slot_of):
            return self.apply_native(layer, x, topk_weights, topk_ids)

    def apply_native(
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
        if is_unfinalized(out):
            raise RuntimeError(
                f"{self.layer_name}: the native MoE kernel deferred its finalize; kt-hybrid needs its output"
            )
        return out
