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
