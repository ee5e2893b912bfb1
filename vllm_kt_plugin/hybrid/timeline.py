"""A per-forward timeline of large forwards for ``vllm-kt bench``: where a prefill's time goes,
layer by layer, and how vLLM cut the prompts into steps (a tok/s figure says how long, not
why: the copy stream, the GPU and kt-kernel's threads run at once).

Off by default (a forward reads one attribute). Per layer: ``start`` (routed), ``gpu_done``,
``synced``, and every copy into a staging buffer, on CUDA events or the host's clock; so GPU
= gpu_done - start, wait = synced - gpu_done, CPU = synced - start (an upper bound), copy =
the copies' busy time. Captured CUDA-graph batches are not seen. docs/benchmarks.md has more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_STEPS = 256  # steps kept between two reads: a bench run's prefills are a few dozen
PREFETCH, ON_DEMAND = "prefetch", "on demand"


class _Clock:
    """CUDA events on ``device`` (timing enabled), or the host's clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event

    def ms(self, ref: Any, point: Any) -> float:
        """Milliseconds from ``ref`` to ``point`` (both recorded and, under CUDA, complete)."""
        if not self.cuda:
            return (point - ref) * 1e3
        return float(ref.elapsed_time(point))


@dataclass
class _Layer:
    layer: int
    path: str
    start: Any
    host_start: float
    gpu_done: Any = None
    synced: Any = None
    host_s: float = 0.0
    staged: int | None = None  # the split's plan, where the path planned one
    picked: int | None = None


@dataclass
class _Copy:
    host: object
    rows: int
    kind: str
    start: Any
    end: Any = None


@dataclass
class _Step:
    label: str
    tokens: int
    host_start_s: float
    clock: _Clock
    layers: list[_Layer] = field(default_factory=list)
    copies: list[_Copy] = field(default_factory=list)


class _LayerMarks:
    """One recorded layer forward (a ``contracts.StageMarks``; this module sits below the
    contracts, as ``metrics`` does, and its observer hands these to the path)."""

    def __init__(self, step: _Step, record: _Layer) -> None:
        self.step, self.record = step, record

    def submitted(self) -> None:
        pass  # on CUDA the submit only queues; its host time is in the layer's host_ms

    def gpu_done(self) -> None:
        self.record.gpu_done = self.step.clock.mark()

    def planned(self, staged: int, picked: int, way: str) -> None:
        self.record.staged, self.record.picked, self.record.path = staged, picked, way

    def synced(self) -> None:
        self.record.synced = self.step.clock.mark()
        if self.record.gpu_done is None:  # a path with no GPU side
            self.record.gpu_done = self.record.synced
        self.record.host_s = time.perf_counter() - self.record.host_start
        self.step.layers.append(self.record)


class Timeline:
    """This process's recorder of large forwards (see the module docstring)."""

    def __init__(self) -> None:
        self.enabled = False
        self.min_tokens = 0
        self.label = ""
        self.first_layer: int | None = None
        self.steps: list[_Step] = []
        self._since = time.perf_counter()
        self._hosts: dict[int, int] = {}  # id(host copy) -> its layer, for the copies

    def add_layer(self, layer_idx: int) -> None:
        """A layer with CPU experts: the first of them opens each step."""
        self.first_layer = layer_idx if self.first_layer is None else min(self.first_layer, layer_idx)

    def name_host(self, host: object, layer_idx: int) -> None:
        self._hosts[id(host)] = layer_idx

    def enable(self, label: str, min_tokens: int) -> None:
        """Record forwards of at least ``min_tokens`` tokens from now on, under ``label``
        (a new label per measurement: the bench's steps then say which they were)."""
        self.label, self.min_tokens, self.enabled = label, min_tokens, True
        if not self.steps:
            self._since = time.perf_counter()

    def disable(self) -> None:
        self.enabled = False

    # --- recording ------------------------------------------------------------------------

    def layer_marks(self, layer_idx: int, tokens: int, path: str, device: torch.device) -> _LayerMarks | None:
        """Marks for one layer forward, or None once ``MAX_STEPS`` steps wait to be read."""
        step = self.steps[-1] if self.steps else None
        if layer_idx == self.first_layer or step is None or step.tokens != tokens:
            if len(self.steps) >= MAX_STEPS:
                return None
            step = _Step(self.label, tokens, time.perf_counter() - self._since, _Clock(device))
            self.steps.append(step)
        record = _Layer(layer_idx, path, step.clock.mark(), time.perf_counter())
        return _LayerMarks(step, record)

    def copy_started(self, host: object, rows: int, kind: str, stream: torch.cuda.Stream | None) -> _Copy | None:
        """A copy into a staging buffer begins (on ``stream``, the copy stream under CUDA)."""
        if not self.enabled or not self.steps:
            return None
        step = self.steps[-1]
        copy = _Copy(host, rows, kind, step.clock.mark(stream))
        step.copies.append(copy)
        return copy

    def copy_done(self, copy: _Copy | None, stream: torch.cuda.Stream | None) -> None:
        if copy is not None:
            copy.end = self.steps[-1].clock.mark(stream)

    # --- reading --------------------------------------------------------------------------

    def collect(self) -> list[dict[str, Any]]:
        """The steps recorded since the last read, in milliseconds from each step's first
        layer start, and forget them (waits for the device: call between measurements)."""
        steps, self.steps = self.steps, []
        if any(s.clock.cuda for s in steps):
            torch.cuda.synchronize()
        return [self._step_record(s) for s in steps if s.layers]

    def _step_record(self, step: _Step) -> dict[str, Any]:
        clock, ref = step.clock, step.layers[0].start
        copies = [c for c in step.copies if c.end is not None]
        copy_ms: dict[int, float] = {}
        listed = []
        for c in copies:
            target = self._hosts.get(id(c.host), -1)
            ms = clock.ms(c.start, c.end)
            copy_ms[target] = copy_ms.get(target, 0.0) + ms
            listed.append(
                {"layer": target, "rows": c.rows, "kind": c.kind, "start_ms": _r(clock.ms(ref, c.start)), "ms": _r(ms)}
            )
        layers = []
        for rec in step.layers:
            row: dict[str, Any] = {
                "layer": rec.layer,
                "path": rec.path,
                "start_ms": _r(clock.ms(ref, rec.start)),
                "gpu_ms": _r(clock.ms(rec.start, rec.gpu_done)),
                "wait_ms": _r(clock.ms(rec.gpu_done, rec.synced)),
                "cpu_ms": _r(clock.ms(rec.start, rec.synced)),
                "copy_ms": _r(copy_ms.get(rec.layer, 0.0)),
                "host_ms": _r(rec.host_s * 1e3),
            }
            if rec.staged is not None:
                row.update(staged=rec.staged, picked=rec.picked)
            layers.append(row)
        last = step.layers[-1]
        return {
            "label": step.label,
            "tokens": step.tokens,
            "host_start_s": round(step.host_start_s, 4),
            "span_ms": _r(clock.ms(ref, last.synced)),
            "host_ms": _r((last.host_start + last.host_s - step.layers[0].host_start) * 1e3),
            "layers": layers,
            "copies": listed,
        }


def _r(ms: float) -> float:
    return round(ms, 3)
