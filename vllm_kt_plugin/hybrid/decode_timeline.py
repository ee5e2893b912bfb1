"""Decode steps, layer by layer: where a step's time goes between kt-kernel's submit, the GPU
experts, the wait for the CPU experts and the rest of the model.

Decode runs in CUDA-graph replays, where no Python runs, so the prefill timeline sees none of
it. Armed at start (``VLLM_KT_DECODE_TIMELINE=1``: before vLLM captures its graphs), each
CPU-experts forward of fewer than ``LARGE_FORWARD_TOKENS`` tokens stamps four points into a
ring of the last steps, on the GPU's clock (``device_clock.DeviceRing``: kernels the graphs
capture) or on the host's (vLLM's CPU build). The bench reads it between measurements.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm_kt_plugin.hybrid.metrics import LARGE_FORWARD_TOKENS

if TYPE_CHECKING:
    from vllm_kt_plugin.hybrid.device_clock import DeviceRing

ARM_VARIABLE = "VLLM_KT_DECODE_TIMELINE"
# before the submit, after it, after the GPU experts, after the sync (the CPU experts' result added)
POINTS = ("start", "submitted", "gpu_done", "synced")
RING_STEPS = 1024  # a bench measurement's decode steps at one batch size fit


class _HostRing:
    """``DeviceRing``'s interface on the host's clock."""

    def __init__(self, layers: list[int]) -> None:
        self.slot_of = {layer: slot for slot, layer in enumerate(sorted(layers))}
        self.first_layer = min(layers)
        self.steps: list[tuple[int, list[list[int]]]] = []

    def stamp(self, layer_idx: int, point: int, tokens: int) -> None:
        now = time.perf_counter_ns()
        if point == 0 and layer_idx == self.first_layer:
            self.steps.append((tokens, [[0] * len(POINTS) for _ in self.slot_of]))
            del self.steps[:-RING_STEPS]
        if self.steps:
            self.steps[-1][1][self.slot_of[layer_idx]][point] = now

    def read(self) -> list[tuple[int, list[list[int]]]]:
        steps, self.steps = self.steps, []
        return steps


class _Marks:
    """One layer forward's points (a ``contracts.StageMarks`` by shape; see ``metrics``)."""

    def __init__(self, ring: DeviceRing | _HostRing, layer_idx: int, tokens: int) -> None:
        self.ring, self.layer_idx, self.tokens = ring, layer_idx, tokens
        ring.stamp(layer_idx, 0, tokens)

    def submitted(self) -> None:
        self.ring.stamp(self.layer_idx, 1, self.tokens)

    def gpu_done(self) -> None:
        self.ring.stamp(self.layer_idx, 2, self.tokens)

    def planned(self, staged: int, picked: int, way: str) -> None:
        pass  # the CPU-experts path stages nothing

    def synced(self) -> None:
        self.ring.stamp(self.layer_idx, 3, self.tokens)


class DecodeTimeline:
    """This process's decode recorder (see the module docstring)."""

    def __init__(self, armed: bool | None = None) -> None:
        self.armed = os.environ.get(ARM_VARIABLE) == "1" if armed is None else armed
        self.layers: list[int] = []
        self.ring: DeviceRing | _HostRing | None = None

    def add_layer(self, layer_idx: int) -> None:
        self.layers.append(layer_idx)

    def marks(self, layer_idx: int, x: torch.Tensor, capturing: bool) -> _Marks | None:
        """Marks for a decode-sized forward; the ring is made at the first forward outside a
        graph capture (vLLM's profiling run), whatever its size: its memory must not come
        from a graph's pool."""
        if self.ring is None:
            if capturing:
                return None
            if x.is_cuda:
                from vllm_kt_plugin.hybrid.device_clock import DeviceRing  # imports Triton: CUDA only

                self.ring = DeviceRing(x.device, self.layers, len(POINTS), RING_STEPS)
            else:
                self.ring = _HostRing(self.layers)
        if x.shape[0] >= LARGE_FORWARD_TOKENS:
            return None
        return _Marks(self.ring, layer_idx, x.shape[0])

    def collect(self) -> list[dict[str, Any]]:
        """The steps recorded since the last read (waits for the device), as ``step_rows``."""
        return step_rows(self.ring.read() if self.ring is not None else [], sorted(self.layers))


def step_rows(steps: list[tuple[int, list[list[int]]]], layers: list[int]) -> list[dict[str, Any]]:
    """Milliseconds per layer: the submit (start -> submitted), the GPU experts (-> gpu_done),
    the wait for the CPU (-> synced), the CPU side from the hand-off to its result (submitted
    -> synced) and the rest of the model up to the next layer's start; per step, its time to
    the next step's start (None for the last) and the part outside the MoE layers' span. A
    step whose points are not in order (a layer that did not run) is left out."""
    rows: list[dict[str, Any]] = []
    for i, (tokens, points) in enumerate(steps):
        flat = [p for layer in points for p in layer]
        if 0 in flat or flat != sorted(flat):
            continue
        following = steps[i + 1][1][0][0] if i + 1 < len(steps) and steps[i + 1][1][0][0] > flat[-1] else None
        layer_rows = []
        for j, (start, submitted, gpu_done, synced) in enumerate(points):
            after = points[j + 1][0] if j + 1 < len(points) else None
            layer_rows.append(
                {
                    "layer": layers[j],
                    "submit_ms": _ms(submitted - start),
                    "gpu_ms": _ms(gpu_done - submitted),
                    "wait_ms": _ms(synced - gpu_done),
                    "cpu_ms": _ms(synced - submitted),
                    "rest_ms": _ms(after - synced) if after is not None else None,
                }
            )
        rows.append(
            {
                "tokens": tokens,
                "step_ms": _ms(following - flat[0]) if following is not None else None,
                "span_ms": _ms(flat[-1] - flat[0]),
                "layers": layer_rows,
            }
        )
    return rows


def _ms(ns: int) -> float:
    return round(ns / 1e6, 4)
