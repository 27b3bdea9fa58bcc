"""Process-set fixtures shared by the worker suites that check Horovod's semantics (torch and TensorFlow).

`rest` is every rank but 0 (at 2 ranks the one-member set {1}; at 3 ranks {1, 2}), so that a set's index and
a global rank differ; `pset` runs a test on the global set and on `rest`. Import both into a test module.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def rest(hvd: Any) -> Any:
    """Every rank but 0 (Horovod's process sets need registering on every rank): the set of those ranks if one is
    registered already (a pipeline's stage set at 2 ranks, when tests run in another order), else one added here
    and removed after the module."""
    from hvdplus.common.basics import registered_process_set

    ranks = list(range(1, hvd.size()))
    found = registered_process_set(ranks)
    process_set = found or hvd.add_process_set(ranks)
    yield process_set
    hvd.barrier()
    if found is None:
        hvd.remove_process_set(process_set)


@pytest.fixture(params=["global", "rest"])
def pset(request: Any, hvd: Any, rest: Any) -> Any:
    return hvd.global_process_set if request.param == "global" else rest


def global_ranks(hvd: Any, process_set: Any) -> list[int]:
    """The global ranks of `process_set`."""
    return list(range(hvd.size())) if process_set is hvd.global_process_set else process_set.ranks
