"""The core's flat reduce-scatter and allgather (what ZeroOptimizer builds on): explicit per-rank counts, outputs
supplied by the caller, in place, fused, and mismatches as errors on every rank. On the global set and on a set
that excludes rank 0.

Written to pass at any world size; run by tests/parallel/test_jobs.py on 2 and 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest

from hvdplus.common import collectives as core
from hvdplus.common.basics import runtime
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.ops import OpKind, ReduceOp
from tests.parallel.process_sets import global_ranks, pset, rest  # noqa: F401 (fixtures)


def member_input(rank: int, n: int, offset: float = 0.0) -> np.ndarray:
    return np.arange(n, dtype=np.float32) * (rank + 1) + offset


def uneven_counts(members: int, total: int) -> list[int]:
    """Counts adding up to `total`, with a zero for the first member when there are several (a rank that owns
    nothing of this buffer)."""
    counts = [total // members] * members
    if members > 1:
        counts[0] = 0
    counts[-1] = total - sum(counts[:-1])
    return counts


def test_reducescatter_with_counts_into_a_given_output_and_in_place(hvd, pset):
    ranks = global_ranks(hvd, pset)
    if hvd.rank() not in ranks:
        return
    me = ranks.index(hvd.rank())
    counts = uneven_counts(len(ranks), 11)
    total = sum(member_input(r, 11) for r in ranks)
    start = sum(counts[:me])
    out = np.full(counts[me], -1, dtype=np.float32)
    core.submit_reducescatter(
        member_input(hvd.rank(), 11),
        "float32",
        "flat.rs.out",
        ReduceOp.SUM,
        process_set=pset,
        counts=counts,
        output=out,
    ).wait()
    np.testing.assert_allclose(out, total[start : start + counts[me]])
    buffer = member_input(hvd.rank(), 11)
    result = core.submit_reducescatter(
        buffer,
        "float32",
        "flat.rs.inplace",
        ReduceOp.AVERAGE,
        process_set=pset,
        counts=counts,
        output=buffer[start : start + counts[me]],
    ).wait()
    assert result.size == 0 or np.shares_memory(result, buffer)
    np.testing.assert_allclose(
        buffer[start : start + counts[me]], total[start : start + counts[me]] / len(ranks), rtol=1e-6
    )


def test_allgather_with_counts_into_a_given_output_and_in_place(hvd, pset):
    ranks = global_ranks(hvd, pset)
    if hvd.rank() not in ranks:
        return
    me = ranks.index(hvd.rank())
    counts = uneven_counts(len(ranks), 9)
    expected = np.concatenate([member_input(r, counts[i]) for i, r in enumerate(ranks)])
    out = np.zeros(9, dtype=np.float32)
    core.submit_allgather(
        member_input(hvd.rank(), counts[me]), "float32", "flat.ag.out", process_set=pset, counts=counts, output=out
    ).wait()
    np.testing.assert_array_equal(out, expected)
    buffer = np.zeros(9, dtype=np.float32)
    start = sum(counts[:me])
    buffer[start : start + counts[me]] = member_input(hvd.rank(), counts[me])
    core.submit_allgather(
        buffer[start : start + counts[me]], "float32", "flat.ag.inplace", process_set=pset, counts=counts, output=buffer
    ).wait()
    np.testing.assert_array_equal(buffer, expected)


def test_many_small_reducescatters_and_allgathers_fuse(hvd):
    """A burst of small requests is packed rank-major into one engine call (the largest batch shows it)."""
    n, me = hvd.size(), hvd.rank()
    counts = [3 + r for r in range(n)]
    size = sum(counts)
    handles = [
        core.submit_reducescatter(
            member_input(me, size, float(i)), "float32", f"fuse.rs.{i}", ReduceOp.SUM, counts=counts
        )
        for i in range(60)
    ]
    start = sum(counts[:me])
    for i, handle in enumerate(handles):
        total = sum(member_input(r, size, float(i)) for r in range(n))
        np.testing.assert_allclose(handle.wait(), total[start : start + counts[me]])
    gathers = [core.submit_allgather(member_input(me, me + 1, float(i)), "float32", f"fuse.ag.{i}") for i in range(60)]
    for i, handle in enumerate(gathers):
        np.testing.assert_array_equal(
            handle.wait(), np.concatenate([member_input(r, r + 1, float(i)) for r in range(n)])
        )
    largest = runtime().coordinator.counters.largest_batch
    assert largest.get(OpKind.REDUCESCATTER, 0) >= 2 and largest.get(OpKind.ALLGATHER, 0) >= 2, largest


def test_counts_that_differ_between_ranks_raise_on_every_rank(hvd):
    n, me = hvd.size(), hvd.rank()
    counts = [4] * n
    counts[0] += me  # the same total, split differently on every rank but rank 0
    counts[-1] -= me
    buffer = np.ones(sum(counts), dtype=np.float32)
    with pytest.raises(CollectiveMismatchError, match="per-rank counts"):
        core.submit_reducescatter(buffer, "float32", "flat.rs.bad", ReduceOp.SUM, counts=counts).wait()
    wrong = np.ones(2 + (1 if me == n - 1 else 0), dtype=np.float32)  # the last rank sends one element too many
    with pytest.raises(CollectiveMismatchError, match=rf"rank {n - 1} sent 3 elements"):
        core.submit_allgather(wrong, "float32", "flat.ag.bad", counts=[2] * n).wait()


def test_bad_counts_and_outputs_are_refused_before_anything_is_sent(hvd):
    n = hvd.size()
    with pytest.raises(ValueError, match="one non-negative count per rank"):
        core.submit_reducescatter(np.ones(4, dtype=np.float32), "float32", "x", ReduceOp.SUM, counts=[4] * (n + 1))
    with pytest.raises(ValueError, match="add up"):
        core.submit_reducescatter(np.ones(4, dtype=np.float32), "float32", "x", ReduceOp.SUM, counts=[5] * n)
    with pytest.raises(ValueError, match="needs counts"):
        core.submit_allgather(np.ones(4, dtype=np.float32), "float32", "x", output=np.ones(4 * n, dtype=np.float32))
    with pytest.raises(ValueError, match="must hold"):
        core.submit_allgather(np.ones(1, dtype=np.float32), "float32", "x", counts=[1] * n, output=np.ones(n + 1))


def test_a_cached_collective_on_a_set_without_rank_0_runs_again(hvd, rest):
    """The second use of a name is a response-cache hit; ranks outside the set must not hold it back (they
    once never raised its bit, and the members waited until the stale-entry eviction)."""
    if not rest.included():
        return
    for _ in range(3):
        x = np.ones(4, dtype=np.float32)
        core.submit_allreduce(x, x, "float32", "cached.on.rest", ReduceOp.SUM, process_set=rest).wait()
        assert x.tolist() == [float(len(rest.ranks))] * 4
