"""The one-rank engine: its in-place collectives (send None) leave the buffer as it is."""

import numpy as np
import pytest

from hvdplus.common.engines.local import LocalEngine
from hvdplus.common.ops import ReduceOp


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_in_place_allgather_keeps_this_ranks_part(dtype):
    recv = np.arange(4, dtype=dtype)
    LocalEngine().start_allgather(None, recv, [4], "world").wait()  # ZeroOptimizer's gather on a job of one rank
    np.testing.assert_array_equal(recv, np.arange(4, dtype=dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_in_place_reducescatter_keeps_the_input(dtype):
    recv = np.arange(4, dtype=dtype)
    LocalEngine().start_reducescatter(None, recv, [4], np.dtype(dtype).name, ReduceOp.SUM, "world").wait()
    np.testing.assert_array_equal(recv, np.arange(4, dtype=dtype))


def test_out_of_place_collectives_copy_the_input():
    engine, send = LocalEngine(), np.arange(3.0)
    gathered, scattered = np.zeros(3), np.zeros(3)
    engine.start_allgather(send, gathered, [3], "world").wait()
    engine.start_reducescatter(send, scattered, [3], "float64", ReduceOp.SUM, "world").wait()
    np.testing.assert_array_equal(gathered, send)
    np.testing.assert_array_equal(scattered, send)
