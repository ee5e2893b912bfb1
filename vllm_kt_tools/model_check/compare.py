"""Greedy answers of two engines compared: the rules the end-to-end tests and the model
check share (``tests/kt_testing/engines.py`` asserts with them).

An answer (``engines``, ``tests/kt_testing/greedy.py``) holds the greedy token ids, the
top two logprobs and ids of every step, and the reference's tokens as this engine scored
them (teacher forcing: ``forced_ids``, ``forced``). Greedy tokens must be equal, except
at a step where the reference's own top two were tied (within TIE_GAP) and the other
engine took the runner-up with its own top logprob within TIE_GAP of the reference's; past
such a tie the texts part, and the rest is compared by teacher forcing.
"""

from __future__ import annotations

import math
from typing import Any

Answer = dict[str, Any]

# Plain vLLM's own top two within this many nats are a tie that another kernel's rounding may
# break the other way (the tiny Qwen3-MoE's 180-token prompt opens on -1.376 / -1.376: kt-kernel's
# AMX BF16 kernels pick the runner-up, its AVX-512/AVX2 ones and vLLM's CPU kernel the first).
# Past such a tie both engines score the reference's tokens, which must stay within it too.
TIE_GAP = 0.05
# The torch backend computes in float32; in a float32 engine only the order of the sums
# differs from plain vLLM (GPU and CPU experts added apart). Measured on the 2-core dev box
# (AVX-512, `pytest -s tests/engine/test_engine_e2e.py -k float32`): GLM-4.5 4.2e-07, Qwen2-MoE
# 1.0e-06, every token equal. Bound: that, plus a margin of 1e-4 for another machine's
# summation order, far below any missing or misweighted expert (the zero backend: > 1 nat).
FLOAT32_DRIFT_BOUND = 1e-4


def first_difference(got: Answer, want: Answer) -> int | None:
    """The first step where the two greedy completions chose other tokens, or None."""
    return next((step for step, (a, b) in enumerate(zip(got["ids"], want["ids"], strict=True)) if a != b), None)


def _forced(got: Answer, want: Answer) -> tuple[list[float], list[float]]:
    """Both engines' logprobs of ``want``'s tokens (teacher forcing)."""
    assert got["forced_ids"] == want["ids"] == want["forced_ids"], (
        "the compared run scored other tokens than the reference's: pass reference= to the run"
    )
    return got["forced"], want["forced"]


def step_drifts(got: Answer, want: Answer) -> list[float]:
    """|chosen-token logprob difference| at every step of one completion: while the tokens
    agree, of the generated tokens; from the first differing token on, of ``want``'s tokens
    as each engine scored them (teacher forcing), so that a completion that parts is still
    bounded to its end."""
    part = first_difference(got, want)
    agreed = len(got["ids"]) if part is None else part
    drifts = [abs(got["top2"][step][0] - want["top2"][step][0]) for step in range(agreed)]
    if part is not None:
        forced_got, forced_want = _forced(got, want)
        drifts += [abs(a - b) for a, b in zip(forced_got[part:], forced_want[part:], strict=True)]
    return drifts


def logprob_drift(got: list[Answer], want: list[Answer]) -> float:
    """Largest ``step_drifts`` over the completions."""
    return max((d for g, w in zip(got, want, strict=True) for d in step_drifts(g, w)), default=0.0)


def non_finite(answers: list[Answer]) -> int:
    """How many logprobs (top two and forced) are NaN or infinite: a model whose logits are NaN
    answers token 0 everywhere on both sides, and NaN drifts compare below any bound."""
    values = [lp for a in answers for step in a["top2"] for lp in step] + [lp for a in answers for lp in a["forced"]]
    return sum(not math.isfinite(lp) for lp in values)


def differing(got: list[Answer], want: list[Answer]) -> int:
    """How many completions chose other tokens somewhere."""
    return sum(first_difference(g, w) is not None for g, w in zip(got, want, strict=True))


def greedy_mismatch(got: list[Answer], want: list[Answer], bound: float = TIE_GAP) -> str | None:
    """Why ``got``'s greedy tokens are not ``want``'s (the rules above), or None."""
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        step = first_difference(g, w)
        if step is None:
            continue
        a, b = g["ids"][step], w["ids"][step]
        first, second = w["top2"][step]
        same_top = abs(g["top2"][step][0] - first) <= TIE_GAP
        tied = first - second <= TIE_GAP and a == w["top2_ids"][step][1] and same_top
        if not tied:
            return (
                f"completion {index} parts at step {step}: {a} instead of {b} "
                f"(reference top two {w['top2_ids'][step]} at {first:.3f} / {second:.3f})"
            )
        forced_got, forced_want = _forced(g, w)
        for later in range(step, len(w["ids"])):
            if abs(forced_got[later] - forced_want[later]) > bound:
                return (
                    f"completion {index}, past the tie at step {step}: the reference's token {w['ids'][later]} at "
                    f"step {later} scores {forced_got[later]:.4f} against the reference's {forced_want[later]:.4f} "
                    f"(bound {bound})"
                )
    return None
