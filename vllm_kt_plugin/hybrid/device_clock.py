"""A clock on the GPU's own timeline, for KT_METRICS_INTERVAL inside CUDA graphs.

A graph replay runs no Python, so each hybrid layer enqueues three one-thread Triton kernels
that read ``%globaltimer`` and add the intervals to sums in device memory, per layer and
captured batch size; the last layer of a forward copies them to pinned host memory, where
the reporting thread reads them with no CUDA call (CUDA forbids some while vLLM captures).
Imported under CUDA only (Triton).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FIELDS = 4  # per layer and batch size, in this order: ClockSums
SIZES = 32  # batch sizes kept apart per layer: the first SIZES - 1 seen, the rest together
MIXED_SIZES = 0  # the batch-size key of the shared slot


class ClockSums(NamedTuple):
    gpu_ns: int  # before the submit -> after the GPU experts
    wait_ns: int  # after the GPU experts -> after the sync
    forwards: int
    tokens: int  # the padded batch inside graphs


@triton.jit
def _tick(stamps, sums, stamp_slot, sum_slot, tokens, phase: tl.constexpr):
    """phase 0: stamp; 1: add the time since the stamp to gpu_ns; 2: to wait_ns, and count
    the forward and its tokens. Every phase stamps again."""
    now = tl.extra.cuda.globaltimer()
    if phase != 0:
        base = sum_slot * 4
        field = base + phase - 1
        tl.store(sums + field, tl.load(sums + field) + (now - tl.load(stamps + stamp_slot)))
        if phase == 2:
            tl.store(sums + base + 2, tl.load(sums + base + 2) + 1)
            tl.store(sums + base + 3, tl.load(sums + base + 3) + tokens)
    tl.store(stamps + stamp_slot, now)


class DeviceClock:
    """Interval sums per layer and batch size on one CUDA device, mirrored to pinned host
    memory (all allocated at once: captured graphs keep the addresses)."""

    def __init__(self, device: torch.device, layers: list[int]) -> None:
        self.slot_of = {layer: slot for slot, layer in enumerate(sorted(layers))}
        self.size_slot: dict[int, int] = {}  # batch size -> its slot, in the order first seen
        self.last_layer = max(layers)
        self.stamps = torch.zeros(len(layers), dtype=torch.int64, device=device)
        self.sums = torch.zeros(len(layers) * SIZES * FIELDS, dtype=torch.int64, device=device)
        self.mirror = torch.zeros(len(layers) * SIZES * FIELDS, dtype=torch.int64, pin_memory=self.stamps.is_cuda)

    def _sum_slot(self, layer_idx: int, tokens: int) -> int:
        if tokens not in self.size_slot and len(self.size_slot) < SIZES - 1:
            self.size_slot[tokens] = len(self.size_slot)
        return self.slot_of[layer_idx] * SIZES + self.size_slot.get(tokens, SIZES - 1)

    def _tick(self, layer_idx: int, phase: int, tokens: int) -> None:
        stamp, sums = self.slot_of[layer_idx], self._sum_slot(layer_idx, tokens)
        _tick[(1,)](self.stamps, self.sums, stamp, sums, tokens, phase=phase, num_warps=1)

    def before_submit(self, layer_idx: int, tokens: int) -> None:
        self._tick(layer_idx, 0, tokens)

    def after_gpu_experts(self, layer_idx: int, tokens: int) -> None:
        self._tick(layer_idx, 1, tokens)

    def after_sync(self, layer_idx: int, tokens: int) -> None:
        self._tick(layer_idx, 2, tokens)
        if layer_idx == self.last_layer:
            self.mirror.copy_(self.sums, non_blocking=True)

    def read(self) -> dict[tuple[int, int], ClockSums]:
        """The sums as last copied, by (layer, batch size) — MIXED_SIZES for the shared slot —
        where a forward was counted (reads host memory only)."""
        values = self.mirror.tolist()
        seen = list(self.size_slot.items())  # one C call: the forward thread may add a size meanwhile
        sizes = {**{slot: size for size, slot in seen}, SIZES - 1: MIXED_SIZES}
        found = {}
        for layer, layer_slot in self.slot_of.items():
            for size_slot, size in sizes.items():
                start = (layer_slot * SIZES + size_slot) * FIELDS
                sums = ClockSums(*values[start : start + FIELDS])
                if sums.forwards:
                    found[(layer, size)] = sums
        return found


@triton.jit
def _ring_stamp(ring, counter, sizes, row, offset, tokens, ring_steps, opens: tl.constexpr):
    """Write the GPU's clock into the current step's row of ``ring`` at ``offset``; the first
    point of a step (``opens``) moves to the next row first and records the batch size."""
    now = tl.extra.cuda.globaltimer()
    step = tl.load(counter)
    if opens:
        step += 1
        tl.store(counter, step)
        tl.store(sizes + step % ring_steps, tokens)
    tl.store(ring + (step % ring_steps) * row + offset, now)


class DeviceRing:
    """The last ``ring_steps`` steps' points (ns on the GPU's clock), per layer and point,
    written by one-thread kernels that CUDA graphs capture like any other (so replays record
    themselves); read between measurements (``read`` synchronizes)."""

    def __init__(self, device: torch.device, layers: list[int], points: int, ring_steps: int) -> None:
        self.slot_of = {layer: slot for slot, layer in enumerate(sorted(layers))}
        self.first_layer = min(layers)
        self.points, self.ring_steps = points, ring_steps
        self.row = len(layers) * points
        self.ring = torch.zeros(ring_steps * self.row, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.sizes = torch.zeros(ring_steps, dtype=torch.int64, device=device)
        self.read_upto = 0

    def stamp(self, layer_idx: int, point: int, tokens: int) -> None:
        offset = self.slot_of[layer_idx] * self.points + point
        opens = point == 0 and layer_idx == self.first_layer
        args = (self.ring, self.counter, self.sizes, self.row, offset, tokens, self.ring_steps)
        _ring_stamp[(1,)](*args, opens=opens, num_warps=1)

    def read(self) -> list[tuple[int, list[list[int]]]]:
        """The steps written since the last read (at most ``ring_steps``, oldest first): each
        its batch size and, per layer in decoder order, its points."""
        torch.cuda.synchronize(self.ring.device)
        last = int(self.counter.item())
        ring, sizes = self.ring.view(self.ring_steps, -1).tolist(), self.sizes.tolist()
        first = max(self.read_upto + 1, last - self.ring_steps + 1)
        self.read_upto = last
        steps = []
        for step in range(first, last + 1):
            row = ring[step % self.ring_steps]
            points = [row[i : i + self.points] for i in range(0, self.row, self.points)]
            steps.append((sizes[step % self.ring_steps], points))
        return steps
