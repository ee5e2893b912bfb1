"""The end-to-end tests' token comparison (kt_testing.engines): equal greedy tokens, up to a
tie of the reference's own that the other side broke the other way; past it, both engines'
logprobs of the reference's tokens (teacher forcing) within the bound, to the end."""

from __future__ import annotations

import pytest
from kt_testing.engines import TIE_GAP, assert_same_greedy_tokens, differing, logprob_drift, step_drifts


def completion(ids: list[int], top2: list[list[float]], top2_ids: list[list[int]], forced: list[float]) -> dict:
    """One completion as kt_testing.greedy returns it; ``forced``: its engine's logprobs of
    WANT's tokens."""
    return {"ids": ids, "top2": top2, "top2_ids": top2_ids, "forced_ids": WANT_IDS, "forced": forced}


WANT_IDS = [5, 6, 7]
WANT = completion(
    WANT_IDS, [[-1.376, -1.376], [-0.01, -5.0], [-0.2, -3.0]], [[5, 9], [6, 1], [7, 2]], [-1.376, -0.01, -0.2]
)


def broke_tie(forced: list[float]) -> dict:
    """Took the tie's runner-up (9) at step 0, then went its own way."""
    return completion([9, 3, 3], [[-1.37, -1.40]] * 3, [[9, 5]] * 3, forced)


def test_equal_tokens_pass() -> None:
    assert_same_greedy_tokens([WANT], [WANT])
    assert differing([WANT], [WANT]) == 0 and logprob_drift([WANT], [WANT]) == 0


def test_the_runner_up_of_a_tie_passes_while_the_reference_scores_the_same() -> None:
    got = broke_tie([-1.38, -0.02, -0.21])
    assert_same_greedy_tokens([got], [WANT])
    assert differing([got], [WANT]) == 1
    assert step_drifts(got, WANT) == pytest.approx([0.004, 0.01, 0.01])  # all three steps, by teacher forcing


def test_a_real_difference_after_a_tie_fails() -> None:
    """The tie at step 0 is fine, but at step 2 the engine gives the reference's token a
    logprob 0.3 lower: a difference that `break` at the tie used to hide."""
    got = broke_tie([-1.38, -0.02, -0.5])
    with pytest.raises(AssertionError, match="past the tie at step 0: the reference's token 7 at step 2"):
        assert_same_greedy_tokens([got], [WANT])
    assert logprob_drift([got], [WANT]) == pytest.approx(0.3)


def test_the_bound_past_a_tie_is_the_callers() -> None:
    got = broke_tie([-1.38, -0.02, -0.5])
    assert_same_greedy_tokens([got], [WANT], bound=0.31)
    assert TIE_GAP < 0.3


@pytest.mark.parametrize(
    "ids",
    [[5, 1, 7], [8, 6, 7]],  # a confident step (gap 4.99), a token that is not the runner-up
    ids=["no tie", "not the runner-up"],
)
def test_other_differences_fail(ids: list[int]) -> None:
    got = completion(ids, WANT["top2"], WANT["top2_ids"], WANT["forced"])
    with pytest.raises(AssertionError, match="parts at step"):
        assert_same_greedy_tokens([got], [WANT])


def test_a_run_that_scored_other_tokens_is_refused() -> None:
    """Past a difference the forced logprobs must be of the reference's tokens."""
    got = {**broke_tie([-1.38, -0.02, -0.21]), "forced_ids": [9, 3, 3]}
    with pytest.raises(AssertionError, match="pass reference="):
        logprob_drift([got], [WANT])
