"""ZeRO partition plans (common/plans/sharding.py): every element has one owner, ranks differ by at most one element."""

import random

import pytest

from hvdplus.common.plans.sharding import balanced_bounds, bucket_ranges, counts_within, partition


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_every_element_has_exactly_one_owner_and_ranks_differ_by_at_most_one(size):
    rng = random.Random(size)
    numels = [rng.randint(1, 50) for _ in range(30)]
    kinds = [rng.choice(["float32", "float16"]) for _ in numels]
    for plan in partition(numels, kinds, size):
        owners = {}
        for rank in range(size):
            start, end = plan.shard(rank)
            for piece in plan.pieces(start, end):
                for element in range(piece.start, piece.start + piece.length):
                    assert (piece.param, element) not in owners
                    owners[(piece.param, element)] = rank
        assert len(owners) == sum(numels[i] for i in plan.params) == plan.total
        assert all(kinds[i] == plan.kind for i in plan.params)
        assert max(plan.counts) - min(plan.counts) <= 1


def test_one_partition_per_dtype_in_order_of_first_appearance():
    plans = partition([4, 2, 3, 5], ["f32", "f16", "f32", "f16"], 2)
    assert [(p.kind, p.params, p.offsets, p.total) for p in plans] == [
        ("f32", (0, 2), (0, 4), 7),
        ("f16", (1, 3), (0, 2), 7),
    ]
    assert plans[0].bounds == (0, 4, 7)


def test_a_parameter_may_span_ranks():
    (plan,) = partition([10], ["f32"], 3)
    assert plan.bounds == (0, 4, 7, 10)
    assert [(p.param, p.start, p.length, p.offset) for p in plan.pieces(*plan.shard(1))] == [(0, 4, 3, 4)]


def test_more_ranks_than_elements_leave_some_ranks_empty():
    assert balanced_bounds(2, 3) == (0, 1, 2, 2)
    with pytest.raises(ValueError, match="positive"):
        balanced_bounds(2, 0)


def test_counts_within_a_range():
    bounds = (0, 4, 7, 10)
    assert counts_within(bounds, 0, 10) == [4, 3, 3]
    assert counts_within(bounds, 3, 5) == [1, 1, 0]
    assert counts_within(bounds, 8, 9) == [0, 0, 1]


def test_buckets_are_whole_parameters_in_reverse_order():
    (plan,) = partition([4, 4, 4, 20, 4], ["f32"] * 5, 2)
    buckets = bucket_ranges(plan, element_bytes=4, bucket_bytes=32)
    assert buckets == [(32, 36, (4,)), (12, 32, (3,)), (4, 12, (1, 2)), (0, 4, (0,))]
    covered = sorted((start, end) for start, end, _ in buckets)
    assert covered[0][0] == 0 and covered[-1][1] == plan.total
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert len(bucket_ranges(plan, 4, 0)) == 5


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="one entry per parameter"):
        partition([1, 2], ["f32"], 2)
