"""When kt-hybrid's scheduler holds new prompts back (``hybrid/admission.py``): pure logic, a
fake clock and fake queues. The real vLLM schedulers it wraps: ``test_scheduler.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_kt_plugin.hybrid.admission import AdmissionGate, Gathered, LayersSeen, whole_layer_from
from vllm_kt_plugin.settings.catalogue import AUTO, Auto

WINDOW_S, BUDGET, MAX_REQUESTS, WHOLE_FROM = 0.03, 16384, 16, 710


@dataclass
class Queues:
    """vLLM's queues as the gate reads them (``admission.WaitingQueues``)."""

    running: int = 0
    held_back: bool = False
    prompts: list[tuple[int, float]] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)

    def busy(self) -> int:
        self.asked.append("busy")
        return self.running

    def paused(self) -> bool:
        self.asked.append("paused")
        return self.held_back

    def queued(self) -> list[tuple[int, float]]:
        self.asked.append("queued")
        return list(self.prompts)


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def gate(wall: Clock, clock: Clock | None = None, whole_from: int | None = WHOLE_FROM, window_s: float = WINDOW_S):
    return AdmissionGate(window_s, BUDGET, MAX_REQUESTS, lambda: whole_from, wall=wall, clock=clock or Clock(0.0))


def test_prompts_sent_together_are_held_until_the_window_from_the_oldest_closes() -> None:
    """The 2026-12-06 sitting's 8 x 1,024: vLLM's idle engine took the first prompt alone.
    Held from its arrival, the other seven join it; then one step takes all eight."""
    wall, mono = Clock(1000.0), Clock(5.0)
    g = gate(wall, mono)
    queues = Queues(prompts=[(1024, 1000.0)])
    assert g.holds(queues) and g.released is None
    for i in range(1, 8):
        wall.now, mono.now = 1000.0 + 0.002 * i, 5.0 + 0.002 * i
        queues.prompts.append((1024, wall.now))
        assert g.holds(queues)
    wall.now, mono.now = 1000.0 + WINDOW_S + 0.001, 5.0 + WINDOW_S + 0.001  # the oldest's window has closed
    assert not g.holds(queues)
    assert g.released == Gathered(8, 8 * 1024, pytest.approx(WINDOW_S + 0.001), WHOLE_FROM)
    assert g.holds_count == 1
    assert not g.holds(queues) and g.released is None  # said once


def test_a_lone_prompt_is_late_by_at_most_the_window() -> None:
    """The window runs from the prompt's arrival in the front end, not from when the engine
    core first saw it: its first token is late by no more than the window."""
    wall = Clock(1000.0 + WINDOW_S * 0.9)  # the engine core sees it 27 ms after it arrived
    g = gate(wall)
    queues = Queues(prompts=[(2048, 1000.0)])
    assert g.holds(queues)
    wall.now = 1000.0 + WINDOW_S + 0.001
    assert not g.holds(queues)


def test_a_wall_clock_that_steps_back_cannot_stretch_the_wait() -> None:
    wall, mono = Clock(1000.0), Clock(0.0)
    g = gate(wall, mono)
    queues = Queues(prompts=[(1024, 1000.0)])
    assert g.holds(queues)
    wall.now, mono.now = 900.0, WINDOW_S + 0.001  # NTP stepped the wall clock back 100 s
    assert not g.holds(queues)


@pytest.mark.parametrize(
    "queues,why",
    [
        (Queues(running=1, prompts=[(1024, 1000.0)]), "a decode runs: never delayed"),
        (Queues(held_back=True, prompts=[(1024, 1000.0)]), "paused, or KV-holding requests first: vLLM's order"),
        (Queues(), "nothing waits"),
        (Queues(prompts=[(WHOLE_FROM - 1, 1000.0)]), "below the whole layer: the CPU path grows with tokens"),
        (Queues(prompts=[(8192, 1000.0), (8192, 1000.0)]), "the step's token budget is full"),
        (Queues(prompts=[(100, 1000.0)] * MAX_REQUESTS), "the step's request limit is full"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_no_hold_where_it_cannot_pay(queues: Queues, why: str) -> None:
    assert not gate(Clock(1000.0)).holds(queues), why


def test_no_hold_without_a_whole_layer_stream_or_with_the_window_off() -> None:
    queues = Queues(prompts=[(4096, 1000.0)])
    assert not gate(Clock(1000.0), whole_from=None).holds(queues)
    assert not gate(Clock(1000.0), window_s=0.0).holds(queues)
    assert gate(Clock(1000.0)).holds(queues)  # the same prompts, held with both


def test_a_running_batch_is_read_before_the_waiting_queue() -> None:
    """Decode steps pay one look at the running batch, not a walk over the waiting queue."""
    queues = Queues(running=16, prompts=[(1024, 1000.0)] * 500)
    gate(Clock(1000.0)).holds(queues)
    assert queues.asked == ["busy"]


def test_prompts_aborted_while_held_report_no_gather() -> None:
    wall = Clock(1000.0)
    g = gate(wall)
    queues = Queues(prompts=[(1024, 1000.0)])
    assert g.holds(queues)
    queues.prompts.clear()
    assert not g.holds(queues) and g.released is None and g.holds_count == 0


SEEN_SPLIT = LayersSeen(stage=True, split=True, probed=True, split_whole_from=710)


@pytest.mark.parametrize(
    "min_tokens,share,graph,seen,want",
    [
        # the layers live in a worker process (tensor parallelism, vLLM's CPU build): the settings say
        (0, AUTO, 0, None, None),  # staging off
        (16, AUTO, 0, None, 16),  # KT_STAGING_MIN_TOKENS=16, no CUDA graphs (the CPU build)
        (16, AUTO, 512, None, 513),  # graph batches replay the CPU path
        (AUTO, AUTO, 512, None, 2048),  # auto: the whole layer's break-even, the conservative size
        (16, 0.5, 0, None, None),  # a forced split stages a part, never the whole layer
        # the layers live here (one GPU): they say
        (AUTO, AUTO, 512, SEEN_SPLIT, 710),  # the split's probed size
        (AUTO, AUTO, 512, LayersSeen(True, True, False, 1 << 62), 2048),  # not probed yet: conservative
        (AUTO, AUTO, 512, LayersSeen(True, True, True, 1 << 62), 1 << 62),  # probed: the whole layer never pays
        (AUTO, 0.5, 512, LayersSeen(True, True, False, 1 << 62), None),  # the forced split
        (AUTO, AUTO, 512, LayersSeen(False, False, False, 0), None),  # auto found no room: no layer stages
        (1024, AUTO, 512, LayersSeen(True, False, False, 0), 1024),  # KT_STAGING_MIN_TOKENS=1024
    ],
)
def test_whole_layer_threshold(
    min_tokens: int | Auto, share: float | Auto, graph: int, seen: LayersSeen | None, want: int | None
) -> None:
    assert whole_layer_from(min_tokens, share, 2048, graph, seen) == want
