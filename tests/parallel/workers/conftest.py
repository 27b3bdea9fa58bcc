"""Inside each rank of a test job: one hvdplus runtime for the whole session."""

import os

import pytest

from tests.parallel.stress import jitter_if_requested, pytest_terminal_summary  # noqa: F401 (a pytest hook)

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
jitter_if_requested()  # a stress job's rank (tests/parallel/stress.py): a random sleep before each submit


@pytest.fixture(scope="session")
def hvd():
    import hvdplus.torch as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_process_sets_left(hvd, request):
    """After a test module, remove the process sets it left registered (a Pipeline keeps its sets for the job), so
    that a later module may register the same ranks: one set per list of ranks, as in Horovod. Collective, so only
    while no test has failed (a failed rank stops with -x while its peers may still run a test)."""
    from hvdplus.common.basics import registered_process_set, runtime

    before = set(runtime().coordinator.process_set_ids())
    yield
    if request.session.testsfailed:
        return
    coordinator = runtime().coordinator
    for set_id in sorted(set(coordinator.process_set_ids()) - before):
        ranks = coordinator.process_set_ranks(set_id)
        left = registered_process_set(ranks) if ranks is not None else None
        if left is not None:
            hvd.remove_process_set(left)
