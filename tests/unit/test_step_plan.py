"""The planned path's agreements (common/plans/step_plan.py): what the summed words say, at sizes that need several
words of rank bits."""

from __future__ import annotations

import numpy as np
import pytest

from hvdplus.common.plans.step_plan import (
    Decision,
    Guard,
    agreement_words,
    consistency_words,
    decide,
    plan_digest,
    read_consistency,
    read_guard,
)


def test_digest_is_stable_and_tells_plans_apart():
    one = plan_digest([[0, 1], "AVERAGE", 1.0, 0.5, None, [(2, 1, 0)], ("fc.weight", (8, 4), "torch.float32")])
    assert one == plan_digest([[0, 1], "AVERAGE", 1.0, 0.5, None, [(2, 1, 0)], ("fc.weight", (8, 4), "torch.float32")])
    assert one != plan_digest([[0, 1], "AVERAGE", 1.0, 0.5, None, [(2, 1, 0)], ("fc.weight", (4, 8), "torch.float32")])
    assert 0 <= one < 2**40


@pytest.mark.parametrize(
    "ranks, expected",
    [
        ([(True, 5), (True, 5), (True, 5)], Decision.FREEZE),
        ([(True, 5), (False, 5)], Decision.NEVER),
        ([(True, 5), (True, 6)], Decision.NEVER),
        ([(True, 5), None, (False, 5)], Decision.RETRY),  # None: a rank in join() contributes zeros
    ],
)
def test_freeze_needs_every_rank_eligible_with_one_digest(ranks, expected):
    words = [agreement_words(*rank) if rank else np.zeros(3, dtype=np.int64) for rank in ranks]
    assert decide(np.minimum.reduce(words), 5) is expected


def test_guard_sums_tell_training_joined_and_differing_steps():
    assert read_guard(2.0) is Guard.TRAINING and read_guard(0.0) is Guard.EVERYONE_JOINED
    assert read_guard(float("nan")) is Guard.DIFFERS and read_guard(1.0 + float("nan")) is Guard.DIFFERS


@pytest.mark.parametrize("size", [2, 3, 130])
def test_consistency_names_joined_and_differing_ranks(size):
    digest = plan_digest(["plan"])
    joined, differing = {1}, {size - 1, 64 % size}
    words = [
        consistency_words(r, size, digest, training=r not in joined, differs=r in differing and r not in joined)
        for r in range(size)
    ]
    result = read_consistency(np.sum(words, axis=0), size, digest)
    assert result.training == tuple(r for r in range(size) if r not in joined)
    assert result.differing == tuple(sorted(differing - joined))
    assert result.digests_agree and result.differing and result.training


def test_a_digest_that_differs_is_caught_and_everyone_joined_is_seen():
    words = [consistency_words(0, 2, 7, True, False), consistency_words(1, 2, 8, True, False)]
    assert not read_consistency(np.sum(words, axis=0), 2, 7).digests_agree
    idle = [consistency_words(r, 3, 7, False, False) for r in range(3)]
    assert read_consistency(np.sum(idle, axis=0), 3, 7).training == ()
