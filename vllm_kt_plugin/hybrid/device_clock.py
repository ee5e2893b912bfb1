"""A clock on the GPU's own timeline, for KT_METRICS_INTERVAL inside CUDA graphs.

A CUDA-graph replay runs no Python, so host clocks and CUDA events recorded from Python
see nothing of decode at vLLM's default settings. Instead each hybrid layer enqueues three
one-thread Triton kernels on its stream — before the submit, after the GPU experts, after
the sync — that read NVIDIA's ``%globaltimer`` (ns) and add the intervals to per-layer sums
in device memory. Kernels are captured like any other, so replays time themselves. The last
hybrid layer of a forward copies the sums into pinned host memory (one small D2H copy, also
captured), where a reporting thread reads them without any CUDA call (CUDA forbids some
calls from other threads while vLLM captures graphs). Imported under CUDA only (Triton).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FIELDS = 4  # per layer, in this order: ClockSums


class ClockSums(NamedTuple):
    gpu_ns: int  # before the submit -> after the GPU experts
    wait_ns: int  # after the GPU experts -> after the sync
    forwards: int
    tokens: int  # the padded batch inside graphs


@triton.jit
def _tick(stamps, sums, slot, tokens, phase: tl.constexpr):
    """phase 0: stamp; 1: add the time since the stamp to gpu_ns; 2: to wait_ns, and count
    the forward and its tokens. Every phase stamps again."""
    now = tl.extra.cuda.globaltimer()
    if phase != 0:
        base = slot * 4
        field = base + phase - 1
        tl.store(sums + field, tl.load(sums + field) + (now - tl.load(stamps + slot)))
        if phase == 2:
            tl.store(sums + base + 2, tl.load(sums + base + 2) + 1)
            tl.store(sums + base + 3, tl.load(sums + base + 3) + tokens)
    tl.store(stamps + slot, now)


class DeviceClock:
    """Per-layer interval sums on one CUDA device, mirrored to pinned host memory."""

    def __init__(self, device: torch.device, layers: list[int]) -> None:
        self.slot_of = {layer: slot for slot, layer in enumerate(sorted(layers))}
        self.last_layer = max(layers)
        self.stamps = torch.zeros(len(layers), dtype=torch.int64, device=device)
        self.sums = torch.zeros(len(layers) * FIELDS, dtype=torch.int64, device=device)
        self.mirror = torch.zeros(len(layers) * FIELDS, dtype=torch.int64, pin_memory=self.stamps.is_cuda)

    def _tick(self, layer_idx: int, phase: int, tokens: int) -> None:
        _tick[(1,)](self.stamps, self.sums, self.slot_of[layer_idx], tokens, phase=phase, num_warps=1)

    def before_submit(self, layer_idx: int, tokens: int) -> None:
        self._tick(layer_idx, 0, tokens)

    def after_gpu_experts(self, layer_idx: int, tokens: int) -> None:
        self._tick(layer_idx, 1, tokens)

    def after_sync(self, layer_idx: int, tokens: int) -> None:
        self._tick(layer_idx, 2, tokens)
        if layer_idx == self.last_layer:
            self.mirror.copy_(self.sums, non_blocking=True)

    def read(self) -> dict[int, ClockSums]:
        """The sums as last copied, per layer (reads host memory only)."""
        values = self.mirror.tolist()
        return {layer: ClockSums(*values[slot * FIELDS : (slot + 1) * FIELDS]) for layer, slot in self.slot_of.items()}
