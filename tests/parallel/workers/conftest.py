"""Inside each rank of a test job: one hvdplus runtime for the whole session."""

import os

import pytest

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")


@pytest.fixture(scope="session")
def hvd():
    import hvdplus.torch as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()
