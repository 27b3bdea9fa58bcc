"""Inside each rank of a TensorFlow test job: one hvdplus runtime for the whole session."""

import os

import pytest

from tests.parallel.stress import jitter_if_requested, pytest_terminal_summary  # noqa: F401 (a pytest hook)

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
jitter_if_requested()  # a stress job's rank (tests/parallel/stress.py): a random sleep before each submit


@pytest.fixture(scope="session")
def hvd():
    import tensorflow as tf

    import hvdplus.tensorflow as hvd

    # test_tf_jobs.py also runs the graph tests with one inter-op thread (fixed for the process once TF starts)
    tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("TEST_TF_INTER_OP_THREADS", "2")))
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    yield hvd
    hvd.shutdown()


@pytest.fixture(params=["eager", "tf.function"])
def mode(request):
    """Run a test body eagerly and as a tf.function (`mode(fn)(*args)`)."""
    import tensorflow as tf

    return (lambda fn: fn) if request.param == "eager" else (lambda fn: tf.function(fn))
