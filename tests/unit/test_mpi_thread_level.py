"""The MPI engine refuses an MPI initialised below MPI_THREAD_MULTIPLE (hvdplus calls MPI from several threads)."""

from __future__ import annotations

import pytest

from hvdplus.common.engines.mpi import check_thread_levels

NAMES = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED"}


def test_multiple_on_every_rank_passes():
    check_thread_levels([3, 3, 3], 3, NAMES)


def test_a_lower_level_names_the_level_the_ranks_and_the_fix():
    with pytest.raises(RuntimeError) as info:
        check_thread_levels([3, 2, 3, 1], 3, NAMES)
    message = str(info.value)
    assert "needs MPI_THREAD_MULTIPLE" in message
    assert "MPI_THREAD_FUNNELED, MPI_THREAD_SERIALIZED on rank(s) 1, 3" in message
    assert "MPI4PY_RC_THREAD_LEVEL" in message and "HOROVOD_CPU_OPERATIONS=gloo" in message
