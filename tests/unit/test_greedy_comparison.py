"""The end-to-end tests' token comparison (kt_testing.engines.assert_same_greedy_tokens): equal
greedy tokens, up to a tie of the reference's own that the other side broke the other way."""

from __future__ import annotations

import pytest
from kt_testing.engines import assert_same_greedy_tokens


def completion(ids: list[int], top2: list[list[float]], top2_ids: list[list[int]]) -> dict:
    return {"ids": ids, "top2": top2, "top2_ids": top2_ids}


WANT = completion([5, 6, 7], [[-1.376, -1.376], [-0.01, -5.0], [-0.2, -3.0]], [[5, 9], [6, 1], [7, 2]])


def test_equal_tokens_pass() -> None:
    assert_same_greedy_tokens([WANT], [WANT])


def test_the_runner_up_of_a_tie_passes_and_ends_the_comparison() -> None:
    broke_tie = completion([9, 3, 3], [[-1.37, -1.40]] * 3, [[9, 5]] * 3)
    assert_same_greedy_tokens([broke_tie], [WANT])


@pytest.mark.parametrize(
    "ids",
    [[5, 1, 7], [8, 6, 7]],  # a confident step (gap 4.99), a token that is not the runner-up
    ids=["no tie", "not the runner-up"],
)
def test_other_differences_fail(ids: list[int]) -> None:
    with pytest.raises(AssertionError, match="parts at step"):
        assert_same_greedy_tokens([completion(ids, WANT["top2"], WANT["top2_ids"])], [WANT])
