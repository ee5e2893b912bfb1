"""Large prefill batches on the GPU (KT_GPU_PREFILL_MIN_TOKENS).

In a batch of thousands of tokens nearly every expert is picked many times, so the CPU's
compute, not its memory bandwidth, bounds the CPU experts; the GPU has far more. Then the
layer computes its CPU experts on the GPU too, with a second instance of the native
method, their weights copied from host memory into one of two GPU buffers shared by all
layers. While one layer computes from one buffer, the next layer's weights stream into
the other on a copy stream, so PCIe time hides behind compute wherever compute is longer.

The host copy is the native method's own runtime format: each layer gets a *shadow* of
its vLLM layer (``hybrid.shadow``) holding only the CPU experts, on the CPU, built, loaded
and post-processed by vLLM's code (the checkpoint tensors reach it through the same expert weight loader as
the GPU experts), then pinned. Where the CPU backend writes its experts in the layout of
vLLM's Triton kernels itself (kt-kernel's BF16 and FP8), there is no host copy: they are
written into one of two pinned host buffers per use. Unquantized experts and block-FP8 ones
(the latter only as kt-kernel's FP8 writes them) are staged; block-FP8 shadows run vLLM's
Triton kernel, whose layout is the checkpoint's.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.cpu_backends.base import fill_dummy_experts
from vllm_kt_plugin.hybrid.gpu_experts import runs_raw_layout
from vllm_kt_plugin.hybrid.shadow import shadow_layer
from vllm_kt_plugin.hybrid.vllm_compat import (
    can_rebuild_moe_kernel,
    is_block_fp8,
    parameters_swapped,
    rebuild_moe_kernel,
    set_expert_map,
    use_moe_kernel,
)
from vllm_kt_plugin.planning.placement import route_to_gpu_slots
from vllm_kt_plugin.settings.catalogue import GIB, LOGGER_NAME

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

    from vllm_kt_plugin.cpu_backends.base import CPUExperts

logger = logging.getLogger(LOGGER_NAME)


def pin_in_place(tensor: torch.Tensor) -> None:
    """Page-lock a tensor's own memory (cudaHostRegister), so copies from it run async.
    Not ``pin_memory()``: PyTorch's caching host allocator rounds every pinned block up to
    a power of two, which would turn a layer's 0.6 + 0.3 GB of experts into 1 + 0.5 GB, on
    every layer. A refusal is fatal: it leaves CUDA's sticky last error set, which the
    next CUDA call would raise far from here."""
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    code = int(getattr(error, "value", error))
    if code != 0:
        raise RuntimeError(
            f"kt-hybrid GPU prefill: CUDA could not page-lock {tensor.numel() * tensor.element_size() / GIB:.2f} GiB "
            f"for the CPU experts' host copy (cudaHostRegister error {code}); check `ulimit -l` and the RAM check "
            "of `vllm-kt doctor`, or set KT_GPU_PREFILL_MIN_TOKENS=0"
        )


def pinned_empty(layout: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Tensors of ``layout`` in one page-locked block of whole pages that no other
    allocation shares (CUDA refuses to register a page twice; small tensors from the heap
    share pages), registered once."""
    nbytes = {name: math.prod(shape) * dtype.itemsize for name, (shape, dtype) in layout.items()}
    sizes = {name: -(-n // _PAGE) * _PAGE for name, n in nbytes.items()}
    raw = torch.empty(sum(sizes.values()) + 2 * _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE
    block = raw[start : start + sum(sizes.values())]
    pin_in_place(block)
    views, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        views[name] = block[offset : offset + nbytes[name]].view(dtype).view(shape)
        offset += sizes[name]
    return views


def pinned_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` in one page-locked block (see ``pinned_empty``)."""
    copies = pinned_empty(layout_of(tensors))
    for name, tensor in tensors.items():
        copies[name].copy_(tensor)
    return copies


def layout_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (t.shape, t.dtype) for name, t in tensors.items()}


def layout_nbytes(layout: dict[str, tuple[torch.Size, torch.dtype]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


_PAGE = mmap.PAGESIZE


class HostExperts:
    """One layer's CPU experts for GPU prefill, in the native runtime format: a (pinned)
    host copy, or nothing of their own where the CPU backend writes its experts in that
    format itself (``writer``): they are then written into a staging buffer each time."""

    def __init__(
        self,
        layer: RoutedExperts,
        make_native: Callable[[RoutedExperts], FusedMoEMethodBase],
        cpu_expert_ids: list[int],
        create_args: dict[str, Any],
        pin: bool,
        writer: CPUExperts | None = None,
        moe_backend: str | None = None,
    ) -> None:
        """``pin``: page-lock the copy after loading (under CUDA), so copies run async;
        ``moe_backend``: vLLM's MoE backend for the shadow (else the layer's choice)."""
        num_experts = len(cpu_expert_ids)
        shadow, self.native = shadow_layer(layer, num_experts, make_native, moe_backend)
        # The shadow picks its kernel for its own expert count: the writer's layout must
        # suit that one too.
        self.writer = writer if runs_raw_layout(self.native) else None
        # Quantized kernels hold their scales from setup: one per staging buffer, bound at
        # its first use (``_bind_kernel``).
        self.binds_scales = is_block_fp8(self.native)
        if self.binds_scales and not can_rebuild_moe_kernel(self.native):
            raise RuntimeError(
                f"kt-hybrid GPU prefill: this vLLM's {type(self.native).__name__} has no _init_moe_kernel (vLLM "
                "0.32's) to bind staged block-FP8 scales; set KT_GPU_PREFILL_MIN_TOKENS=0"
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

    def write(self, views: dict[str, torch.Tensor]) -> None:
        """The writer's experts into host ``views`` of this layout."""
        assert self.writer is not None
        self.writer.write_gpu_layout(self.cpu_expert_ids, views)

    def load(self, param_name: str, weight: torch.Tensor, weight_name: str, shard_id: str, slot: int) -> None:
        """One checkpoint tensor of CPU expert ``slot``, through vLLM's own expert loader."""
        self.shadow.weight_loader(getattr(self.shadow, param_name), weight, weight_name, shard_id, slot)
        self.loaded += 1

    def finalize(self, dummy: bool, cpu_slot_of: torch.Tensor) -> None:
        """After loading: the native post-processing, then page-locking (again after a
        reload, only what is new). ``cpu_slot_of`` (on the device) routes the layer's
        expert ids: under CUDA as the shadow's expert map, so the kernel skips the picks of
        GPU experts; vLLM's CPU kernels ignore expert maps and get zero-weight picks."""
        if not self.loaded and dummy and self.copies:
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
        self, staged: dict[str, torch.Tensor], x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The CPU experts' share of the layer output, computed from the staged weights
        (swapped into the shadow for the call; its own host parameters come back after)."""
        if self.expert_map is None:
            topk_ids, topk_weights = route_to_gpu_slots(topk_ids, topk_weights, self.cpu_slot_of)
        with parameters_swapped(self.shadow, staged):
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


class StagingBuffers:
    """Two device buffers shared by every layer: one is computed from while the next
    layer's weights are copied into the other (copy stream, events) under CUDA; on the
    CPU platform the copy is a plain synchronous one. Layers whose experts a CPU backend
    writes (no host copy) are written into one of two host buffers first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.numel: dict[str, tuple[int, torch.dtype]] = {}  # per weight: the largest layer's
        self.slots: list[dict[str, torch.Tensor]] = []
        self.host_slots: list[dict[str, torch.Tensor]] = []  # for written layers, made on first use
        self.owner: list[HostExperts | None] = [None, None]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.free = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.uses = 0  # layers computed through the buffers, for tests and the log
        self.last = 1

    def reserve(self, host: HostExperts) -> None:
        """Grow the planned buffers to hold ``host`` (before the first use). Flat, so
        layers of any shape fit."""
        for name, (shape, dtype) in host.layout.items():
            numel, _ = self.numel.get(name, (0, dtype))
            self.numel[name] = (max(numel, math.prod(shape)), dtype)

    @property
    def nbytes(self) -> int:
        return 2 * sum(n * d.itemsize for n, d in self.numel.values())

    def _allocate(self) -> None:
        self.slots = [
            {name: torch.empty(n, dtype=dtype, device=self.device) for name, (n, dtype) in self.numel.items()}
            for _ in range(2)
        ]

    def _views(self, index: int, host: HostExperts) -> dict[str, torch.Tensor]:
        return _shaped(self.slots[index], host.layout)

    def _written(self, index: int, host: HostExperts) -> dict[str, torch.Tensor]:
        """``host``'s experts, written by its CPU backend into host buffer ``index`` once
        the copy that last read that buffer is done."""
        if not self.host_slots:
            flat = {name: (torch.Size([n]), dtype) for name, (n, dtype) in self.numel.items()}
            self.host_slots = [pinned_empty(flat) if self.cuda else _empty(flat) for _ in range(2)]
        if self.cuda:
            self.ready[index].synchronize()  # the last copy out of this host buffer
        views = _shaped(self.host_slots[index], host.layout)
        host.write(views)
        return views

    def _copy_in(self, index: int, host: HostExperts) -> None:
        if not self.slots:
            self._allocate()
        self.owner[index] = host
        views = self._views(index, host)
        source = host.tensors if host.copies else self._written(index, host)
        if not self.cuda:
            for name, tensor in source.items():
                views[name].copy_(tensor)
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.free[index])  # the layer computing from it is done
            for name, tensor in source.items():
                views[name].copy_(tensor, non_blocking=True)
            self.ready[index].record(self.stream)

    def _slot_of(self, host: HostExperts) -> int | None:
        return next((i for i, owner in enumerate(self.owner) if owner is host), None)

    def acquire(self, host: HostExperts) -> tuple[int, dict[str, torch.Tensor]]:
        """``host``'s weights on the device, copied now unless prefetched."""
        index = self._slot_of(host)
        if index is None:
            index = 1 - self.last
            self._copy_in(index, host)
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.ready[index])
        self.uses += 1
        self.last = index
        return index, self._views(index, host)

    def prefetch(self, host: HostExperts, busy: int) -> None:
        """Start copying ``host`` into the buffer that slot ``busy``'s layer does not use
        (a written layer is written first, which blocks this thread meanwhile)."""
        if self._slot_of(host) is None:
            self._copy_in(1 - busy, host)

    def release(self, index: int) -> None:
        if self.cuda:
            self.free[index].record(torch.cuda.current_stream())

    def describe(self) -> str:
        return f"{self.nbytes / GIB:.2f} GiB of GPU staging buffers (2 x the largest layer's CPU experts)"


def _empty(layout: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}


def _shaped(
    flat: dict[str, torch.Tensor], layout: dict[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, torch.Tensor]:
    """Views of the start of flat buffers in ``layout``'s shapes."""
    return {name: flat[name][: math.prod(shape)].view(shape) for name, (shape, _) in layout.items()}
