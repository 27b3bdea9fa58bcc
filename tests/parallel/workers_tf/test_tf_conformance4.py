"""Horovod conformance, round 4 (TensorFlow): what Horovod's own TF test files (test_tensorflow.py,
test_tensorflow_process_sets.py, test_tensorflow2_keras.py, test_adasum_tensorflow.py) use beyond rounds 1-3.

Each test names the Horovod 0.28.1 source or test it follows. Written to pass at any world size >= 2.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.parallel.process_sets import global_ranks, pset, rest  # noqa: F401 (fixtures)
from tests.parallel.workers_tf.test_tf_conformance3 import EXECUTIONS


# ----------------------------------------------------------------------------- process_set_included_op
def test_process_set_included_op(hvd, rest, mode):
    """horovod/tensorflow/mpi_ops.py process_set_included_op: 1 on a member of the set, 0 elsewhere
    (Horovod's test_horovod_process_set_included_op)."""
    included = mode(lambda: [hvd.process_set_included_op(), hvd.process_set_included_op(rest.process_set_id)])()
    assert [int(t.numpy()) for t in included] == [1, int(hvd.rank() in rest.ranks)]
    with pytest.raises(ValueError, match="process set 12345 does not exist"):
        hvd.process_set_included_op(12345)


# ----------------------------------------------------------------------------- gradients of another dtype
# Horovod's gradient tests (test_horovod_alltoall_grad_cpu, ..._equal_split_grad_cpu, the process-set ones) pass
# float32 ones as the upstream gradient of float64 outputs; each op's gradient takes them in its output's dtype.
GRADIENT_OPS = {
    "alltoall-splits": lambda hvd, x, ps: hvd.alltoall(x, splits=[1] * ps.size(), process_set=ps)[0],
    "alltoall-even": lambda hvd, x, ps: hvd.alltoall(x, process_set=ps),
    "reducescatter": lambda hvd, x, ps: hvd.reducescatter(x, op=hvd.Average, process_set=ps),
    "allgather": lambda hvd, x, ps: hvd.allgather(x, process_set=ps),
}


def _gradient_of(hvd, op, pset, execution):
    """d(sum of op(x))/dx for a float64 x of one row per member, the upstream gradient float32 ones."""
    x = tf.constant(np.arange(pset.size() * 2, dtype=np.float64).reshape(pset.size(), 2))
    if execution == "session":
        graph = tf.Graph()
        with graph.as_default():
            xg = tf.constant(x.numpy())
            y = op(hvd, xg, pset)
            [grad] = tf.gradients(y, xg, tf.ones(tf.shape(y), tf.float32))
        with tf.compat.v1.Session(graph=graph) as session:
            return grad.dtype, session.run(grad)

    def eager(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = op(hvd, x, pset)
        return tape.gradient(y, x, output_gradients=tf.ones(tf.shape(y), tf.float32))

    grad = (eager if execution == "eager" else tf.function(eager))(x)
    return grad.dtype, grad.numpy()


@pytest.mark.parametrize(
    "kind,execution",
    [("alltoall-splits", execution) for execution in EXECUTIONS]
    + [("alltoall-even", "eager"), ("reducescatter", "eager"), ("reducescatter", "session"), ("allgather", "session")],
)
def test_float64_gradients_with_float32_upstream_gradients(hvd, pset, kind, execution):
    if not pset.included():
        return
    dtype, grad = _gradient_of(hvd, GRADIENT_OPS[kind], pset, execution)
    # alltoall sends each row's gradient back to where the row came from, reducescatter (Average) gathers the shard
    # gradients, allgather averages the gathered gradient and takes this rank's rows: ones everywhere.
    assert dtype == tf.float64
    np.testing.assert_allclose(grad, np.ones([pset.size(), 2]))


# ----------------------------------------------------------------------------- PartialDistributedGradientTape
def test_partial_tape_splits_local_and_global_gradients(hvd, mode):
    """horovod/tensorflow/__init__.py _DistributedGradientTape.get_local_and_global_gradients: (source, gradient)
    pairs of the local sources (scaled by 1/size), then of the others (averaged), in the sources' order
    (Horovod's test_partial_distributed_gradient_tape)."""
    local = tf.Variable([1.0, 2.0])
    shared = tf.Variable([3.0])

    def split():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(local * (hvd.rank() + 1)) + tf.reduce_sum(shared * (hvd.rank() + 1))
        tape = hvd.DistributedGradientTape(tape)
        tape.register_local_source(local)
        local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, [shared, local])
        # the sources themselves, as Python values (a tf.function would return variables as tensors)
        return [(s is local, g) for s, g in local_pairs], [(s is shared, g) for s, g in global_pairs]

    local_pairs, global_pairs = mode(split)()
    assert [is_it for is_it, _ in local_pairs] == [True] and [is_it for is_it, _ in global_pairs] == [True]
    average = sum(r + 1 for r in range(hvd.size())) / hvd.size()
    np.testing.assert_allclose(local_pairs[0][1].numpy(), [(hvd.rank() + 1) / hvd.size()] * 2)
    np.testing.assert_allclose(global_pairs[0][1].numpy(), [average])


# ----------------------------------------------------------------------------- BroadcastGlobalVariablesCallback
@pytest.mark.parametrize("as_list", [True, False])
def test_broadcast_callback_leaves_local_variables_alone(hvd, as_list):
    """horovod/tensorflow/keras/callbacks.py BroadcastGlobalVariablesCallback(local_variables=...): those keep each
    rank's values, the others take the root's (Horovod's test_broadcast_global_variables_callback_with_local_vars)."""
    import hvdplus.keras as hvd_keras

    root = hvd.size() - 1
    constant = keras.initializers.Constant(float(hvd.rank()))
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(3, kernel_initializer=constant, bias_initializer=constant, trainable=False),
            keras.layers.Dense(2, kernel_initializer=constant, bias_initializer=constant, trainable=False),
        ]
    )
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    kernel = model.layers[0].kernel
    callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
        root_rank=root, local_variables=[kernel] if as_list else kernel
    )
    model.fit(np.ones([2, 3]), np.ones([2, 2]), epochs=1, verbose=0, callbacks=[callback])
    for variable in model.variables:
        expected = hvd.rank() if variable is kernel else root
        np.testing.assert_array_equal(np.asarray(variable), np.full(variable.shape, float(expected)))
    with pytest.raises(ValueError, match="tf.Variable or keras.Variable"):
        hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.ones(2)])


# ----------------------------------------------------------------------------- process-set errors
@pytest.mark.parametrize("execution", ["eager", "session"])
def test_process_set_errors_are_horovods_and_raised_as_the_op_is_made(hvd, rest, execution):
    """Horovod's test_horovod_allreduce_process_set_id_error: a rank outside the set gets InvalidArgumentError
    (horovod/common/operations.cc's enqueue), an unregistered id ValueError, eagerly and when a graph is built (so
    the failing op never joins the graph, whose later collectives run after it)."""
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 12345  # as Horovod's test does
    graph = tf.Graph()
    with graph.as_default() if execution == "session" else tf.init_scope():
        if hvd.rank() not in rest.ranks:
            with pytest.raises(tf.errors.InvalidArgumentError, match="not a member of process set"):
                hvd.allreduce(tf.ones([4]), process_set=rest)
        with pytest.raises(ValueError, match="process set 12345 does not exist"):
            hvd.allreduce(tf.ones([4]), process_set=fake)
