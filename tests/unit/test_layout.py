"""Fused-buffer layouts (common/data/layout.py): rank-major packing for reduce-scatter and allgather."""

import numpy as np

from hvdplus.common.data.layout import Layout


def test_rank_major_pack_and_unpack_round_trip():
    counts = [[2, 1, 0], [0, 3, 1], [1, 1, 1]]
    tensors = [np.arange(sum(row), dtype=np.float32) + 10 * t for t, row in enumerate(counts)]
    layout = Layout(counts)
    assert layout.rank_totals == [3, 5, 2] and layout.total == 10
    buffer = np.empty(layout.total, dtype=np.float32)
    layout.pack(tensors, buffer)
    # rank 0's parts of every tensor, then rank 1's, then rank 2's
    assert buffer.tolist() == [10 * 0 + 0, 10 * 0 + 1, 20 + 0, 0 + 2, 10 + 0, 10 + 1, 10 + 2, 20 + 1, 10 + 3, 20 + 2]
    assert layout.block(buffer, 1).tolist() == [2, 10, 11, 12, 21]
    out = [np.zeros_like(t) for t in tensors]
    layout.unpack(buffer, out)
    assert all(np.array_equal(a, b) for a, b in zip(out, tensors))


def test_end_to_end_is_the_allreduce_layout():
    layout = Layout.end_to_end([2, 3])
    buffer = np.empty(5)
    layout.pack([np.ones(2), np.zeros(3)], buffer)
    assert buffer.tolist() == [1, 1, 0, 0, 0]
    a, b = np.empty(2), np.empty(3)
    layout.unpack(np.arange(5.0), [a, b])
    assert a.tolist() == [0, 1] and b.tolist() == [2, 3, 4]
