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

With KT_GPU_PREFILL_FP8_COPY=1 the host copy of unquantized experts (AMXINT4, AMXINT8 and
BF16 CPU experts of a BF16 checkpoint) is block-FP8 instead: each checkpoint tensor is
quantized as it loads, 128 x 128 blocks with float32 scales (the format of kt-kernel's FP8
and of DeepSeek-V3's checkpoints), into a block-FP8 shadow run by vLLM's own FP8 MoE
method (Triton under CUDA). Half the bytes cross PCIe and sit in RAM; the GPU computes
those experts with FP8 weights (docs/split.md states the measured accuracy).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.cpu_backends.base import DUMMY_HIGH, fill_dummy_experts
from vllm_kt_plugin.hybrid.gpu_experts import runs_raw_layout
from vllm_kt_plugin.hybrid.shadow import shadow_layer
from vllm_kt_plugin.hybrid.timeline import ON_DEMAND, PREFETCH, Timeline
from vllm_kt_plugin.hybrid.vllm_compat import (
    DOWN_SHARD,
    GATE_SHARD,
    UP_SHARD,
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


FP8_BLOCK = 128  # rows and columns of one block of a block-FP8 copy (kt-kernel's and DeepSeek's)


def quantize_block_fp8(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, cols] matrix as float8_e4m3fn and float32 scales per ``block`` x ``block``
    (vLLM's ``weight_scale_inv``: weight ~ fp8 * scale), each block scaled to its largest
    magnitude. Partial blocks at the edges are scaled by their own part."""
    rows, cols = weight.shape
    brows, bcols = -(-rows // block), -(-cols // block)
    padded = torch.zeros(brows * block, bcols * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(brows, block, bcols, block)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale = (blocks.abs().amax(dim=(1, 3)) / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)
    scaled = (blocks / scale[:, None, :, None]).clamp(-fp8_max, fp8_max).view(brows * block, bcols * block)
    return scaled[:rows, :cols].to(torch.float8_e4m3fn), scale


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
            self._load_fp8(weight, shard_id, slot)
        else:
            load_expert_weight(self.shadow, param_name, weight, weight_name, shard_id, slot)
        self.loaded += 1

    def _load_fp8(self, weight: torch.Tensor, shard_id: str, slot: int) -> None:
        """A gate (w1), up (w3) or down (w2) matrix of one expert, whole (one tensor-parallel
        rank), quantized into the FP8 copy: w13 holds gate then up, each of its own blocks."""
        q, scale = quantize_block_fp8(weight)
        target = "w2" if shard_id == DOWN_SHARD else "w13"
        rows = getattr(self.shadow, f"{target}_weight").data[slot]
        scales = getattr(self.shadow, f"{target}_weight_scale_inv").data[slot]
        half = {GATE_SHARD: 0, UP_SHARD: 1}.get(shard_id, 0)
        n, b = q.shape[0], scale.shape[0]
        if rows.shape[-1] != q.shape[1] or rows.shape[0] not in (n, 2 * n):
            raise ValueError(f"kt-hybrid FP8 copy: {shard_id} of shape {tuple(weight.shape)} does not fit {rows.shape}")
        rows[half * n : (half + 1) * n].copy_(q)
        scales[half * b : (half + 1) * b].copy_(scale)

    def _fill_dummy_fp8(self) -> None:
        """load_format=dummy: random FP8 weights with scales that put them in vLLM's dummy
        range (values do not change the kernels' speed)."""
        for name, param in self.shadow.named_parameters(recurse=False):
            if name.endswith("_scale_inv"):
                param.data.fill_(DUMMY_HIGH / 448)
            elif param.dtype == torch.float8_e4m3fn:
                base = torch.empty(param.shape[1:], dtype=torch.float32).uniform_(-448, 448)
                param.data[0::2] = base.to(param.dtype)
                param.data[1::2] = (-base).to(param.dtype)

    def finalize(self, dummy: bool, cpu_slot_of: torch.Tensor) -> None:
        """After loading: the native post-processing, then page-locking (again after a
        reload, only what is new). ``cpu_slot_of`` (on the device) routes the layer's
        expert ids: under CUDA as the shadow's expert map, so the kernel skips the picks of
        GPU experts; vLLM's CPU kernels ignore expert maps and get zero-weight picks."""
        if not self.loaded and dummy and self.fp8_copy:
            self._fill_dummy_fp8()
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


class StagingBuffers:
    """Two device buffers shared by every layer: one is computed from while the next
    layer's weights are copied into the other (copy stream, events) under CUDA; on the
    CPU platform the copy is a plain synchronous one. Layers whose experts a CPU backend
    writes (no host copy) are written into one of two host buffers first.

    Experts are staged by row (the split stages some of a layer's CPU experts, each into
    its own CPU-expert row): each buffer remembers which rows of its owner it holds, so a
    prefetched part is not copied again and a whole layer is one copy per tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.numel: dict[str, tuple[int, torch.dtype]] = {}  # per weight: the largest layer's
        self.slots: list[dict[str, torch.Tensor]] = []
        self.host_slots: list[dict[str, torch.Tensor]] = []  # for written layers, made on first use
        self.owner: list[HostExperts | None] = [None, None]
        self.rows: list[set[int]] = [set(), set()]  # rows of the owner each buffer holds
        self.rows_copied = 0  # expert rows copied in so far, for tests and the bench
        self.fresh = [0, 0]  # rows copied into each buffer since its forward last asked (the split's model)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.free = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.uses = 0  # layers computed through the buffers, for tests and the log
        self.last = 1
        self.timeline: Timeline | None = None  # told of every copy (the bench's per-forward timeline)

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
        # Zeros, not empty: a row no pick reaches may still be read with weight 0 by
        # kernels that ignore expert maps (vLLM's CPU ones); it must hold no NaN.
        self.slots = [
            {name: torch.zeros(n, dtype=dtype, device=self.device) for name, (n, dtype) in self.numel.items()}
            for _ in range(2)
        ]

    def _views(self, index: int, host: HostExperts) -> dict[str, torch.Tensor]:
        return _shaped(self.slots[index], host.layout)

    def _written(self, index: int, host: HostExperts, rows: list[int]) -> dict[str, torch.Tensor]:
        """``host``'s experts of ``rows``, written by its CPU backend into host buffer
        ``index`` (its first ``len(rows)`` rows) once the copy that last read that buffer
        is done."""
        if not self.host_slots:
            flat = {name: (torch.Size([n]), dtype) for name, (n, dtype) in self.numel.items()}
            self.host_slots = [pinned_empty(flat) if self.cuda else _empty(flat) for _ in range(2)]
        if self.cuda:
            self.ready[index].synchronize()  # the last copy out of this host buffer
        layout = {name: (torch.Size([len(rows), *shape[1:]]), dtype) for name, (shape, dtype) in host.layout.items()}
        views = _shaped(self.host_slots[index], layout)
        host.write(views, rows)
        return views

    def _copy_in(self, index: int, host: HostExperts, rows: list[int] | None = None, kind: str = ON_DEMAND) -> None:
        """Copy ``host``'s experts of ``rows`` (all by default) into buffer ``index``,
        each into its own row; rows it already holds for ``host`` are not copied again
        (``kind``: a prefetch or a copy on demand, for the timeline)."""
        if not self.slots:
            self._allocate()
        if self.owner[index] is not host:
            self.owner[index] = host
            self.rows[index] = set()
            self.fresh[index] = 0
        every = rows is None
        wanted = range(host.num_experts) if rows is None else rows
        missing = sorted(r for r in set(wanted) if r not in self.rows[index])
        if not missing:
            return
        views = self._views(index, host)
        if host.copies:
            source = host.tensors
            pairs = [(r, r) for r in missing]  # (source row, buffer row)
        else:
            source = self._written(index, host, missing)
            pairs = list(enumerate(missing))
        runs = [(0, 0, host.num_experts)] if every and not self.rows[index] and host.copies else _runs(pairs)
        self.rows[index].update(missing)
        self.rows_copied += len(missing)
        self.fresh[index] += len(missing)
        timeline = self.timeline if self.timeline is not None and self.timeline.enabled else None
        if not self.cuda:
            copy = timeline.copy_started(host, len(missing), kind, None) if timeline else None
            _copy_runs(views, source, runs, non_blocking=False)
            if timeline:
                timeline.copy_done(copy, None)
            return
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.free[index])  # the layer computing from it is done
            copy = timeline.copy_started(host, len(missing), kind, self.stream) if timeline else None
            _copy_runs(views, source, runs, non_blocking=True)
            if timeline:
                timeline.copy_done(copy, self.stream)
            self.ready[index].record(self.stream)

    def _slot_of(self, host: HostExperts) -> int | None:
        return next((i for i, owner in enumerate(self.owner) if owner is host), None)

    def resident(self, host: HostExperts) -> set[int]:
        """The rows of ``host`` a buffer holds or is copying in (prefetched)."""
        index = self._slot_of(host)
        return set(self.rows[index]) if index is not None else set()

    def take_prefetched(self, host: HostExperts) -> int:
        """Rows copied in for ``host`` since its forward last asked (its prefetch): copy-stream
        time spent whether or not this forward uses them. Counted once: the next ask starts
        from zero."""
        index = self._slot_of(host)
        if index is None:
            return 0
        fresh, self.fresh[index] = self.fresh[index], 0
        return fresh

    def acquire(self, host: HostExperts, rows: list[int] | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """``host``'s weights (of ``rows``, by default all) on the device, copied now
        unless prefetched."""
        index = self.start(host, rows)
        return index, self.wait(index, host)

    def start(self, host: HostExperts, rows: list[int] | None = None) -> int:
        """Start copying what ``acquire`` needs (the split queues GPU work before it
        waits); returns the buffer's index."""
        index = self._slot_of(host)
        if index is None:
            index = 1 - self.last
        self._copy_in(index, host, rows)
        return index

    def wait(self, index: int, host: HostExperts) -> dict[str, torch.Tensor]:
        """Work queued on the current stream from now on sees buffer ``index`` copied."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.ready[index])
        self.fresh[index] = 0  # its copies on demand: the forward's plan counted them
        self.uses += 1
        self.last = index
        return self._views(index, host)

    def prefetch(self, host: HostExperts, busy: int, rows: list[int] | None = None) -> None:
        """Start copying ``host`` (its ``rows``, by default all) into the buffer that slot
        ``busy``'s layer does not use (a written layer is written first, which blocks this
        thread meanwhile)."""
        index = self._slot_of(host)
        if index is None or index == 1 - busy:
            self._copy_in(1 - busy, host, rows, PREFETCH)

    def release(self, index: int) -> None:
        if self.cuda:
            self.free[index].record(torch.cuda.current_stream())

    def describe(self) -> str:
        return f"{self.nbytes / GIB:.2f} GiB of GPU staging buffers (2 x the largest layer's CPU experts)"


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source row, buffer row) pairs, ascending, as runs (source start, buffer start,
    length) of consecutive rows: one copy per run and tensor."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _copy_runs(
    views: dict[str, torch.Tensor],
    source: dict[str, torch.Tensor],
    runs: list[tuple[int, int, int]],
    non_blocking: bool,
) -> None:
    for name, tensor in source.items():
        for src, dst, n in runs:
            views[name][dst : dst + n].copy_(tensor[src : src + n], non_blocking=non_blocking)


def _empty(layout: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}


def _shaped(
    flat: dict[str, torch.Tensor], layout: dict[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, torch.Tensor]:
    """Views of the start of flat buffers in ``layout``'s shapes."""
    return {name: flat[name][: math.prod(shape)].view(shape) for name, (shape, _) in layout.items()}
