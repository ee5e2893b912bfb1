"""The two staging buffers on the device that every layer shares (``StagingBuffers``).

While one layer computes its staged CPU experts from one buffer, the next layer's experts
stream into the other on a copy stream, so PCIe time hides behind compute wherever
compute is longer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from vllm_kt_plugin.hybrid.staging.host_memory import pinned_empty
from vllm_kt_plugin.hybrid.timeline import ON_DEMAND, PREFETCH, Timeline
from vllm_kt_plugin.settings.catalogue import GIB

if TYPE_CHECKING:
    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts


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

    def write_out(self, index: int, host: HostExperts, rows: list[int]) -> dict[str, torch.Tensor]:
        """``host``'s experts of ``rows``, written by its CPU backend into host buffer
        ``index`` (its first ``len(rows)`` rows) once the copy that last read that buffer
        is done (``copy_in`` does this for a layer without a host copy; the split's probe
        times it alone)."""
        if not self.host_slots:
            flat = {name: (torch.Size([n]), dtype) for name, (n, dtype) in self.numel.items()}
            self.host_slots = [pinned_empty(flat) if self.cuda else _empty(flat) for _ in range(2)]
        if self.cuda:
            self.ready[index].synchronize()  # the last copy out of this host buffer
        layout = {name: (torch.Size([len(rows), *shape[1:]]), dtype) for name, (shape, dtype) in host.layout.items()}
        views = _shaped(self.host_slots[index], layout)
        host.write(views, rows)
        return views

    def forget(self, index: int) -> None:
        """Buffer ``index`` holds nothing a later copy may keep: the next ``copy_in`` copies
        every row it is asked for (the split's probe times whole copies this way)."""
        self.owner[index] = None

    def copy_in(self, index: int, host: HostExperts, rows: list[int] | None = None, kind: str = ON_DEMAND) -> None:
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
            source = self.write_out(index, host, missing)
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
        self.copy_in(index, host, rows)
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
            self.copy_in(1 - busy, host, rows, PREFETCH)

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
