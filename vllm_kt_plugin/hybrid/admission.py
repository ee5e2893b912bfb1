"""When kt-hybrid's scheduler (``scheduler.KTHybridScheduler``) holds new prompts back for a
step, so that prompts sent together reach one forward: pure logic, no vLLM.

A forward that streams the whole layer copies every CPU expert to the GPU whatever its size
(docs/split.md), so two such forwards cost two copies where one would do. The gate holds
only while nothing runs, the waiting prompts already make such a forward and the step could
take more (below its token budget and request limit), for at most ``window_s`` after the
oldest waiting prompt arrived: a lone prompt's first token is that late.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vllm_kt_plugin.settings.catalogue import AUTO, Auto


class WaitingQueues(Protocol):
    """What the gate reads of vLLM's scheduler before a step (``vllm_compat.SchedulerView``),
    asked in this order, and only as far as the decision needs."""

    def busy(self) -> int:
        """Requests in the running batch (decodes, prefills under way)."""
        ...

    def paused(self) -> bool:
        """Whether vLLM's own order applies: the engine paused, or waiting requests holding KV
        blocks (vLLM admits those first)."""
        ...

    def queued(self) -> list[tuple[int, float]]:
        """(tokens still to compute, arrival time in ``time.time()``) of each waiting request."""
        ...


@dataclass(frozen=True)
class Gathered:
    """A hold that ended: the prompts the next step takes, their tokens, how long they waited."""

    prompts: int
    tokens: int
    held_s: float
    whole_layer_from: int


@dataclass(frozen=True)
class LayersSeen:
    """What the process that holds the layers says about whole-layer forwards: whether any
    layer stages its CPU experts on the GPU, and the split paths' threshold once probed."""

    stage: bool
    split: bool  # split paths exist (KT_STAGING_MIN_TOKENS=auto, one rank, or a forced share)
    probed: bool  # their costs are probed (from the first forward that took the split)
    split_whole_from: int  # the largest of their thresholds (huge where one never stages it whole)


def whole_layer_from(
    min_tokens: int | Auto, split_share: float | Auto, auto_min_tokens: int, largest_graph: int, seen: LayersSeen | None
) -> int | None:
    """The smallest forward that streams the whole layer, as the scheduler's process can tell;
    None where none does. ``seen``: the layers, where they live in this process (one GPU); else
    (tensor parallelism, vLLM's CPU build: the layers live in worker processes) the settings
    say: ``min_tokens`` (KT_STAGING_MIN_TOKENS; auto streams the whole layer
    from ``auto_min_tokens`` with tensor parallelism and, with the split, from a probed size not
    known here, so that conservative size too), ``split_share`` (a forced split stages a part,
    never the whole layer); never at a CUDA-graph batch size (those replay the CPU path)."""
    if min_tokens == 0:
        return None
    if seen is not None:
        if not seen.stage:
            return None  # auto found no room, or no CUDA: every forward takes the CPU path
        if seen.split:
            if split_share is not AUTO:
                return None
            if seen.probed:
                return seen.split_whole_from
    elif split_share is not AUTO:
        return None
    return max(auto_min_tokens if min_tokens is AUTO else int(min_tokens), largest_graph + 1)


def holds_prompts(
    queues: WaitingQueues,
    window_s: float,
    budget_tokens: int,
    max_requests: int,
    whole_from: Callable[[], int | None],
    now: float,
    held_s: float,
) -> bool:
    """Whether this step admits no new prompt (the rules of the module docstring). ``now``:
    ``time.time()``; ``held_s``: how long this gate has held them already, by its own monotonic
    clock (a wall clock that steps back cannot stretch the wait)."""
    if window_s <= 0 or queues.busy() or queues.paused():
        return False
    waiting = queues.queued()
    tokens = sum(t for t, _ in waiting)
    if not waiting or tokens >= budget_tokens or len(waiting) >= max_requests:
        return False  # nothing to hold, or the step is full: no other prompt could join it
    threshold = whole_from()
    if threshold is None or tokens < threshold:
        return False  # a forward of these tokens takes no whole-layer stream: its cost grows with them
    oldest = min(arrival for _, arrival in waiting)
    return max(now - oldest, held_s) < window_s


class AdmissionGate:
    """The scheduler's gate: ``holds(queues)`` before each step; ``released`` is the hold that
    ended at the last call that admitted prompts after holding them (None otherwise)."""

    def __init__(
        self,
        window_s: float,
        budget_tokens: int,
        max_requests: int,
        whole_from: Callable[[], int | None],
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s, self.budget_tokens, self.max_requests = window_s, budget_tokens, max_requests
        self.whole_from, self.wall, self.clock = whole_from, wall, clock
        self.held_since: float | None = None  # monotonic, from the first step of the current hold
        self.released: Gathered | None = None
        self.holds_count = 0  # holds that ended (for the log: the first at INFO)

    def holds(self, queues: WaitingQueues) -> bool:
        held_s = 0.0 if self.held_since is None else self.clock() - self.held_since
        hold = holds_prompts(
            queues, self.window_s, self.budget_tokens, self.max_requests, self.whole_from, self.wall(), held_s
        )
        self.released = None
        if hold and self.held_since is None:
            self.held_since = self.clock()
        elif not hold and self.held_since is not None:
            self.held_since = None
            waiting = queues.queued()
            if waiting:  # (none: aborted while held)
                self.released = Gathered(len(waiting), sum(t for t, _ in waiting), held_s, self.whole_from() or 0)
                self.holds_count += 1
        return hold
