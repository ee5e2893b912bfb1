"""One layer's CPU experts for staging: ``HostExperts``, in the native method's runtime
format on the host, and the computation of them on the GPU from staged weights.

The host copy lives in a *shadow* of the vLLM layer (``hybrid.shadow``) holding only the
CPU experts, built, loaded and post-processed by vLLM's code, then pinned; in block FP8
with KT_STAGING_FP8_COPY (``fp8_copy``). Where the CPU backend writes its experts in the
layout of vLLM's Triton kernels (kt-kernel's BF16 and FP8) there is no copy: they are
written into a pinned host buffer per use.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.cpu_backends.base import fill_dummy_experts
from vllm_kt_plugin.hybrid.gpu_experts import runs_raw_layout
from vllm_kt_plugin.hybrid.shadow import shadow_layer
from vllm_kt_plugin.hybrid.staging.fp8_copy import fill_dummy_fp8, load_fp8
from vllm_kt_plugin.hybrid.staging.host_memory import layout_nbytes, layout_of, pinned_copies
from vllm_kt_plugin.hybrid.staging.plan import FP8_BLOCK
from vllm_kt_plugin.hybrid.vllm_compat import (
    block_fp8_method,
    can_rebuild_moe_kernel,
    expert_map_set,
    is_block_fp8,
    load_expert_weight,
    parameters_swapped,
    rebuild_moe_kernel,
    set_expert_map,
    use_moe_kernel,
)
from vllm_kt_plugin.planning.placement import route_to_gpu_slots

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

    from vllm_kt_plugin.cpu_backends.base import CPUExperts


class HostExperts:
    """One layer's CPU experts for staging, in the native runtime format: a (pinned) host
    copy, or nothing of their own where the CPU backend writes its experts in that format
    itself (``writer``): they are then written into a staging buffer each time."""

    def __init__(
        self,
        layer: RoutedExperts,
        make_native: Callable[[RoutedExperts], FusedMoEMethodBase],
        cpu_expert_ids: list[int],
        create_args: dict[str, Any],
        pin: bool,
        writer: CPUExperts | None = None,
        moe_backend: str | None = None,
        fp8_copy: bool = False,
    ) -> None:
        """``pin``: page-lock the copy after loading (under CUDA), so copies run async;
        ``moe_backend``: vLLM's MoE backend for the shadow (else the layer's choice);
        ``fp8_copy``: keep the unquantized experts as a block-FP8 copy (module docstring)."""
        num_experts = len(cpu_expert_ids)
        self.fp8_copy = fp8_copy
        if fp8_copy:
            make_native, writer = functools.partial(block_fp8_method, block=FP8_BLOCK), None
        shadow, self.native = shadow_layer(layer, num_experts, make_native, moe_backend)
        # The shadow picks its kernel for its own expert count: the writer's layout must
        # suit that one too.
        self.writer = writer if runs_raw_layout(self.native) else None
        # Quantized kernels hold their scales from setup: one per staging buffer, bound at
        # its first use (``_bind_kernel``).
        self.binds_scales = is_block_fp8(self.native)
        if self.binds_scales and not can_rebuild_moe_kernel(self.native):
            raise RuntimeError(
                f"kt-hybrid staging: this vLLM's {type(self.native).__name__} has no _init_moe_kernel (vLLM "
                "0.32's) to bind staged block-FP8 scales; set KT_STAGING_MIN_TOKENS=0"
            )
        self._kernels: dict[int, tuple[FusedMoEQuantConfig, FusedMoEKernel]] = {}
        self.device = torch.device("meta" if self.writer is not None else "cpu")  # a writer's: shapes only
        with self.device:
            self.native.create_weights(shadow, num_experts=num_experts, **create_args)
        self.pin = pin
        self.shadow = shadow
        self.cpu_expert_ids = cpu_expert_ids
        self.loaded = 0
        self.tensors: dict[str, torch.Tensor] = {}  # the host copy (none with a writer)
        self.layout = layout_of({n: p.data for n, p in shadow.named_parameters(recurse=False)})
        self.expert_map: torch.Tensor | None = None
        self._pinned: set[int] = set()  # data pointers already page-locked (weights can reload)

    def writer_mismatch(self) -> str | None:
        """How the writer's layout differs from the shadow's (kt-kernel writes through raw
        pointers), or None; known from the shadow's created weights, before any load."""
        if self.writer is None:
            return None
        theirs = {name: (tuple(shape), dtype) for name, (shape, dtype) in self.layout.items()}
        ours = self.writer.gpu_layout(len(self.cpu_expert_ids))
        if theirs == ours:
            return None
        return f"the CPU backend writes {ours}, vLLM's {type(self.native).__name__} on the GPU runs {theirs}"

    @property
    def copies(self) -> bool:
        """Whether this layer keeps a host copy (loaded from the checkpoint's tensors)."""
        return self.writer is None

    @property
    def host_nbytes(self) -> int:
        """RAM of the host copy."""
        return layout_nbytes(layout_of(self.tensors))

    @property
    def staged_nbytes(self) -> int:
        """Bytes staged onto the GPU per use."""
        return layout_nbytes(self.layout)

    @property
    def num_experts(self) -> int:
        return len(self.cpu_expert_ids)

    @property
    def rows_are_experts(self) -> bool:
        """Whether every tensor of the runtime format has one row per expert (dim 0), so
        that single experts can be staged (the split); vLLM's Triton and CPU layouts do."""
        return all(shape and shape[0] == self.num_experts for shape, _ in self.layout.values())

    @property
    def expert_nbytes(self) -> int:
        """Bytes staged per expert."""
        return self.staged_nbytes // max(self.num_experts, 1)

    def write(self, views: dict[str, torch.Tensor], rows: list[int] | None = None) -> None:
        """The writer's experts (of CPU-expert ``rows``, all by default) into host ``views``
        of this layout, one after the other."""
        assert self.writer is not None
        ids = self.cpu_expert_ids if rows is None else [self.cpu_expert_ids[r] for r in rows]
        self.writer.write_gpu_layout(ids, views)

    def load(self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, slot: int) -> None:
        """One checkpoint tensor of CPU expert ``slot``, through vLLM's own expert loader
        (quantized into its rows of the FP8 copy, with that)."""
        if self.fp8_copy:
            load_fp8(self.shadow, weight, shard_id, slot)
        else:
            load_expert_weight(self.shadow, param_name, weight, weight_name, shard_id, slot)
        self.loaded += 1

    def finalize(self, dummy: bool, cpu_slot_of: torch.Tensor) -> None:
        """After loading: the native post-processing, then page-locking (again after a
        reload, only what is new). ``cpu_slot_of`` (on the device) routes the layer's
        expert ids: under CUDA as the shadow's expert map, so the kernel skips the picks of
        GPU experts; vLLM's CPU kernels ignore expert maps and get zero-weight picks."""
        if not self.loaded and dummy and self.fp8_copy:
            fill_dummy_fp8(self.shadow)
        elif not self.loaded and dummy and self.copies:
            for param in self.shadow.parameters(recurse=False):
                fill_dummy_experts(param.data)  # not uniform_: ~2 s per layer of AMXINT4's host copy
        with self.device:
            self.native.process_weights_after_loading(self.shadow)
        params = dict(self.shadow.named_parameters(recurse=False))
        self.layout = layout_of({name: param.data for name, param in params.items()})
        if self.copies:
            self._keep_copy(params)
        self.cpu_slot_of = cpu_slot_of
        if cpu_slot_of.device.type == "cuda":
            self.expert_map = cpu_slot_of
            set_expert_map(self.shadow, cpu_slot_of)

    def _keep_copy(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.tensors = {name: param.data.contiguous() for name, param in params.items()}
        if self.pin and any(t.data_ptr() not in self._pinned for t in self.tensors.values()):
            # Into one page-locked block; the shadow's parameters then live there (a
            # weight reload writes into it and finds its tensors already pinned).
            self.tensors = pinned_copies(self.tensors)
            for name, tensor in self.tensors.items():
                params[name].data = tensor
            self._pinned = {t.data_ptr() for t in self.tensors.values()}

    def apply(
        self,
        staged: dict[str, torch.Tensor],
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        slot_of: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The CPU experts' share of the layer output, computed from the staged weights
        (swapped into the shadow for the call; its own host parameters come back after).
        ``slot_of`` (on the device): the experts staged this time, by CPU slot, -1 for the
        others (the split); by default every CPU expert."""
        slot_of = self.cpu_slot_of if slot_of is None else slot_of
        if self.expert_map is None:
            topk_ids, topk_weights = route_to_gpu_slots(topk_ids, topk_weights, slot_of)
        staged_map = expert_map_set(self.shadow, slot_of) if self.expert_map is not None else contextlib.nullcontext()
        with parameters_swapped(self.shadow, staged), staged_map:
            if self.binds_scales:
                self._bind_kernel(staged)
            return self.native.apply(
                layer=self.shadow,
                x=x,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                shared_experts=None,
                shared_experts_input=None,
            )

    def _bind_kernel(self, staged: dict[str, torch.Tensor]) -> None:
        """Point the native method at a kernel built on ``staged``'s scales (the shadow's
        parameters are those now): vLLM's FP8 method builds its kernel from the layer's
        tensors once, at setup (``_init_moe_kernel``, which vLLM also calls to rebuild it for
        weights already in kernel format), so each staging buffer gets its own, kept."""
        key = staged["w13_weight"].data_ptr()
        if key not in self._kernels:
            self._kernels[key] = rebuild_moe_kernel(self.native, self.shadow)
        use_moe_kernel(self.native, self._kernels[key])
