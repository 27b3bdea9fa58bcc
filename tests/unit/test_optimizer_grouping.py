"""DistributedOptimizer's groups/num_groups plans (Horovod's split and its rules), on plain objects."""

import pytest

from hvdplus.common.plans.grouping import build_groups, split_list


class Param:
    """Stands for a tensor: groups match parameters by identity only."""


def test_split_list_is_contiguous_and_balanced():
    assert split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_list([1, 2], 2) == [[1], [2]]


def test_int_groups_cover_every_parameter_once():
    params = [Param() for _ in range(5)]
    plan = build_groups(params, 2)
    assert [plan[p] for p in params] == [tuple(params[:3])] * 3 + [tuple(params[3:])] * 2
    assert set(build_groups(params, 50).values()) == {(p,) for p in params}  # more groups than parameters
    assert build_groups(params, None) == {}


def test_listed_groups_follow_optimizer_order_and_leave_the_rest_alone():
    a, b, c, d = (Param() for _ in range(4))
    frozen = Param()  # not among the optimizer's hooked parameters: ignored, as Horovod does
    plan = build_groups([a, b, c, d], [[c, a, frozen]])
    assert plan == {a: (a, c), c: (a, c), b: (b,), d: (d,)}


@pytest.mark.parametrize("groups", [0, -1, True, "2", 1.5])
def test_bad_group_counts(groups):
    with pytest.raises(ValueError, match="positive integer or a list of lists"):
        build_groups([Param()], groups)


def test_duplicates_and_flat_lists_are_rejected():
    p = Param()
    with pytest.raises(ValueError, match="only appear once"):
        build_groups([p], [[p], [p]])
    with pytest.raises(ValueError, match="list of lists"):
        build_groups([p], [p])


def test_buckets_follow_ddp():
    """Reverse order, contiguous, one dtype per bucket, capped in bytes (a larger parameter alone), 0 = none."""
    from hvdplus.common.plans.grouping import bucket_indices

    nbytes, kinds = [4, 4, 10, 4, 4, 4], ["f"] * 6
    big = 1 << 30
    assert bucket_indices(nbytes, kinds, 8, big) == [(4, 5), (3,), (2,), (0, 1)]
    assert bucket_indices(nbytes, kinds, 100, big) == [(0, 1, 2, 3, 4, 5)]
    assert bucket_indices(nbytes, ["f", "f", "h", "h", "f", "f"], 100, big) == [(4, 5), (2, 3), (0, 1)]
    assert bucket_indices(nbytes, kinds, 0, big) == []
    assert bucket_indices([], [], 8, big) == []


def test_large_parameters_stay_out_of_buckets():
    """A parameter of alone_bytes or more is in no bucket (reduced alone, in place), and it closes the open bucket
    so that buckets stay contiguous."""
    from hvdplus.common.plans.grouping import bucket_indices

    nbytes, kinds = [4, 4, 10, 4, 4, 4], ["f"] * 6
    assert bucket_indices(nbytes, kinds, 100, 10) == [(3, 4, 5), (0, 1)]
    assert bucket_indices(nbytes, kinds, 8, 10) == [(4, 5), (3,), (0, 1)]
    assert bucket_indices([10, 4, 10], kinds[:3], 100, 10) == [(1,)]
    assert bucket_indices([10, 10], kinds[:2], 100, 10) == []
    assert bucket_indices(nbytes, kinds, 100, None) == [(0, 1, 2, 3, 4, 5)]  # no limit (Gloo): all in buckets


def test_the_first_bucket_closes_early():
    """DDP's first-bucket rule: the first bucket (the last layers' gradients, produced first by backward) closes
    once it holds first_bucket_bytes, with the gradient that reaches that limit in it (DDP's reducer does the
    same), the later ones hold at most bucket_bytes; never more than bucket_bytes; 0 turns the rule off."""
    from hvdplus.common.plans.grouping import bucket_indices

    nbytes, kinds = [4, 4, 4, 4, 4, 4], ["f"] * 6
    assert bucket_indices(nbytes, kinds, 100, None, 8) == [(4, 5), (0, 1, 2, 3)]
    assert bucket_indices(nbytes, kinds, 100, None, 0) == [(0, 1, 2, 3, 4, 5)]
    assert bucket_indices(nbytes, kinds, 8, None, 100) == [(4, 5), (2, 3), (0, 1)]  # capped by bucket_bytes
    assert bucket_indices([4, 4, 10, 4], kinds[:4], 100, None, 8) == [(2, 3), (0, 1)]  # 10 reaches the limit: in it
    # The bench CNN's layout (a 4 MiB linear layer behind the small last one): DDP's first bucket holds both.
    assert bucket_indices([3456, 128, 73728, 256, 4194304, 1024, 10240, 40], ["f"] * 8, 25 << 20, None, 1 << 20) == [
        (4, 5, 6, 7),
        (0, 1, 2, 3),
    ]
    assert bucket_indices([4, 4, 30, 4], kinds[:4], 16, None, 8) == [(3,), (2,), (0, 1)]  # within bucket_bytes
    # a large parameter alone, before any bucket: the first bucket is still the first one filled
    assert bucket_indices([4, 4, 4, 4, 4, 20], kinds, 100, 20, 8) == [(3, 4), (0, 1, 2)]
