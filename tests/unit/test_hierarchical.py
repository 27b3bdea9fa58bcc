"""The cross-host step of hierarchical allreduce: ring and halving-doubling built from sendrecv equal a flat
reduction for every size, dtype and op; the layouts that cannot run hierarchically say why."""

import numpy as np
import pytest

from hvdplus.common.data.halfops import bfloat16_to_float32, float32_to_bfloat16
from hvdplus.common.data.hierarchical import cross_allreduce, hierarchical_groups, p2p_reducescatter, resolve_algorithm
from hvdplus.common.data.layout import balanced_counts
from hvdplus.common.engines.threads import ThreadWorld
from hvdplus.common.engines.waited import Waited
from hvdplus.common.ops import ReduceOp
from hvdplus.common.topology import Topology
from tests.unit.test_announcements import run_ranks

NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


def _inputs(size, count, dtype):
    rng = np.random.default_rng(count * 31 + size)
    bound = 16 if dtype == "bfloat16" else 50  # |partial sums| <= 128 stay exact in bfloat16's 8 bits, any order
    values = [rng.integers(-bound, bound, count).astype(np.float32) for _ in range(size)]
    if dtype == "bfloat16":
        return [float32_to_bfloat16(v) for v in values], values
    return [v.astype(dtype) for v in values], values


@pytest.mark.parametrize("algorithm,sizes", [("ring", [1, 2, 3, 4, 5, 7]), ("halving-doubling", [1, 2, 4, 8])])
@pytest.mark.parametrize("dtype", ["float32", "int64", "float64", "bfloat16"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
def test_cross_allreduce_equals_a_flat_reduction(algorithm, sizes, dtype, op):
    for size in sizes:
        for count in (0, 1, size - 1, size, 7, 1000, 1001):
            if dtype == "bfloat16" and count < size:
                continue  # that falls back to the engine's own call, and the thread engine has no bfloat16 sum
            buffers, values = _inputs(size, max(count, 0), dtype)
            world = ThreadWorld(size)
            ran = run_ranks(
                size,
                lambda rank: cross_allreduce(
                    Waited(world.engines[rank]), "world", rank, size, buffers[rank], dtype, op, algorithm
                ),
            )
            expected = NUMPY_OPS[op].reduce(np.stack(values), axis=0)
            for rank in range(size):
                got = bfloat16_to_float32(buffers[rank]) if dtype == "bfloat16" else buffers[rank]
                np.testing.assert_array_equal(got, expected.astype(got.dtype), err_msg=f"{size} ranks {count}")
            if size > 1 and count >= size:
                assert set(ran) == {algorithm}, ran  # the composed algorithm ran, not the engine's call


def test_balanced_counts_are_balanced_and_complete():
    for total in range(0, 40):
        for parts in range(1, 9):
            counts = balanced_counts(total, parts)
            assert sum(counts) == total and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)


def test_auto_picks_by_host_count_and_size():
    assert resolve_algorithm("auto", 2, 1 << 20) == "halving-doubling"
    assert resolve_algorithm("auto", 3, 1 << 20) == "ring"
    assert resolve_algorithm("auto", 4, 1024) == "engine"
    assert resolve_algorithm("halving-doubling", 3, 1 << 20) == "ring"  # not a power of two
    assert resolve_algorithm("engine", 4, 1 << 20) == "engine"
    assert resolve_algorithm("auto", 2, 1 << 20, "gloo") == "engine"  # Gloo's allreduce beat its sendrecv
    assert resolve_algorithm("ring", 2, 1 << 20, "gloo") == "ring"


@pytest.mark.parametrize(
    "hosts,ranks,reason",
    [
        (("a", "a", "a"), (0, 1, 2), "all its ranks are on one host"),
        (("a", "a", "b"), (0, 1, 2), "different numbers of ranks (a: 2, b: 1)"),
        (("a", "b", "c"), (0, 1, 2), "each host runs one rank"),
        (("a", "a", "b", "b"), (0, 2), "each host runs one rank"),
    ],
)
def test_layouts_that_fall_back_to_flat_say_why(hosts, ranks, reason):
    groups, why = hierarchical_groups(world_engine(), Topology(0, hosts), ranks)
    assert groups is None and reason in why


def world_engine():
    return ThreadWorld(1).engines[0]


@pytest.mark.parametrize("algorithm,size", [("ring", 3), ("ring", 5), ("halving-doubling", 4), ("ring", 4)])
def test_p2p_reducescatter_leaves_each_rank_its_reduced_part_for_uneven_counts(algorithm, size):
    counts = [3, 0, 5, 1, 2][:size]
    buffers, values = _inputs(size, sum(counts), "float32")
    world = ThreadWorld(size)
    run_ranks(
        size,
        lambda rank: p2p_reducescatter(
            Waited(world.engines[rank]), "world", rank, size, buffers[rank], counts, "float32", ReduceOp.SUM, algorithm
        ),
    )
    expected = np.sum(values, axis=0)
    for rank in range(size):
        start = sum(counts[:rank])
        np.testing.assert_array_equal(
            buffers[rank][start : start + counts[rank]], expected[start : start + counts[rank]]
        )
