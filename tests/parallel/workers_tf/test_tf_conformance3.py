"""Horovod conformance, round 3 (TensorFlow): error types in graphs, horovod.tensorflow.util's users (in-place
broadcast, broadcast_object_fn, the TF1 elastic state), broadcast_global_variables, IndexedSlices, alltoall's
argument errors and SyncBatchNormalization.

Each test names the Horovod 0.28.1 source it follows. Every TF test runs eagerly, in a tf.function and in a
tf.compat.v1 Session on a tf.Graph (`execution`). Written to pass at any world size >= 2.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

EXECUTIONS = ["eager", "tf.function", "session"]


@pytest.fixture(params=EXECUTIONS)
def execution(request):
    return request.param


def run(execution, fn, *args):
    """`fn(*args)` eagerly, as a tf.function, or built in a tf.Graph and run by a Session (variables initialized
    first); the results as numpy values (nested lists and tuples kept)."""
    if execution == "session":
        graph = tf.Graph()
        with graph.as_default():
            outputs = fn(*args)
            init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            return session.run(outputs)
    outputs = (fn if execution == "eager" else tf.function(fn))(*args)
    return tf.nest.map_structure(lambda t: t.numpy(), outputs)


def _job_still_works(hvd):
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy().tolist() == [float(hvd.size())]


def _odd(hvd) -> int:
    """0 on rank 0, 1 on the others: what makes one rank disagree with the rest."""
    return min(hvd.rank(), 1)


# ----------------------------------------------------------------------------- 1. mismatches fail FailedPrecondition
# horovod/common/controller.cc builds an ERROR response for a collective the ranks disagree on;
# horovod/common/ops/collective_operations.cc turns it into Status::PreconditionError and horovod/tensorflow/mpi_ops.cc
# ConvertStatus into errors::FailedPrecondition: the same type eagerly and in a graph.
MISMATCHES = {
    "allreduce-shape": (lambda hvd, o, name: hvd.allreduce(tf.ones([2 + o]), name=name), "Mismatched shapes"),
    "allreduce-dtype": (
        lambda hvd, o, name: hvd.allreduce(tf.ones([2], [tf.float32, tf.float64][o]), name=name),
        "Mismatched data types",
    ),
    "allreduce-rank": (lambda hvd, o, name: hvd.allreduce(tf.ones([2] + [1] * o), name=name), "Mismatched shapes"),
    "allgather-shape": (lambda hvd, o, name: hvd.allgather(tf.ones([1, 2 + o]), name=name), "trailing dimensions"),
    "allgather-dtype": (
        lambda hvd, o, name: hvd.allgather(tf.ones([1], [tf.int32, tf.int64][o]), name=name),
        "Mismatched data types",
    ),
    "allgather-rank": (lambda hvd, o, name: hvd.allgather(tf.ones([1, 2] + [1] * o), name=name), "Mismatched"),
    "broadcast-shape": (lambda hvd, o, name: hvd.broadcast(tf.ones([2 + o]), 0, name=name), "Mismatched shapes"),
    "broadcast-dtype": (
        lambda hvd, o, name: hvd.broadcast(tf.ones([2], [tf.float32, tf.int32][o]), 0, name=name),
        "Mismatched data types",
    ),
    "broadcast-root": (lambda hvd, o, name: hvd.broadcast(tf.ones([2]), o, name=name), "Mismatched root ranks"),
    "alltoall-shape": (
        lambda hvd, o, name: hvd.alltoall(tf.ones([hvd.size(), 2 + o]), name=name),
        "trailing dimensions",
    ),
    "alltoall-dtype": (
        lambda hvd, o, name: hvd.alltoall(tf.ones([hvd.size()], [tf.float32, tf.float16][o]), name=name),
        "Mismatched data types",
    ),
    "reducescatter-shape": (
        lambda hvd, o, name: hvd.reducescatter(tf.ones([hvd.size(), 2 + o]), name=name),
        "Mismatched shapes",
    ),
    "reducescatter-dtype": (
        lambda hvd, o, name: hvd.reducescatter(tf.ones([hvd.size()], [tf.float32, tf.float64][o]), name=name),
        "Mismatched data types",
    ),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_mismatch_fails_with_failed_precondition_in_every_execution(hvd, execution, case):
    collective, message = MISMATCHES[case]
    with pytest.raises(tf.errors.FailedPreconditionError, match=message) as raised:
        run(execution, lambda: collective(hvd, _odd(hvd), f"c3.{case}.{execution}"))
    assert not isinstance(raised.value, tf.errors.InvalidArgumentError)
    _job_still_works(hvd)


def test_a_mismatch_in_a_session_fails_the_run_and_the_graph_runs_again(hvd):
    """The failed op is the collective's check, on every rank; no collective that takes the failed one's output
    starts; the same graph runs again once the shapes agree."""
    graph = tf.Graph()
    with graph.as_default():
        rows = tf.compat.v1.placeholder(tf.int32, [])
        first = hvd.allreduce(tf.ones(tf.stack([rows])), op=hvd.Sum, name="c3.session.first")
        second = hvd.allreduce(first * 2.0, op=hvd.Sum, name="c3.session.second")
    with tf.compat.v1.Session(graph=graph) as session:
        with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched shapes") as raised:
            session.run(second, {rows: 2 + _odd(hvd)})
        assert "{{node HorovodCheck}}" in raised.value.message
        n = float(hvd.size())
        assert [r.tolist() for r in session.run([first, second], {rows: 2})] == [[n] * 2, [2 * n * n] * 2]
    _job_still_works(hvd)


# ----------------------------------------------------------------------------- 2. util's users
def test_hvd_util_is_horovods_module(hvd):
    import hvdplus.tensorflow.util

    assert hvd.util is hvdplus.tensorflow.util
    assert hvd.vars_to_refs is hvd.util.vars_to_refs and hvd.refs_to_vars is hvd.util.refs_to_vars


@pytest.mark.parametrize("execution", ["eager", "session"])  # a tf.function: the test below (no new variables)
def test_in_place_broadcast_returns_the_roots_values_and_assigns_them(hvd, execution):
    """horovod/tensorflow/mpi_ops.py broadcast_: the variables take the root's values and the call returns them
    (in a graph, tensors read after the broadcast, so fetching them broadcasts)."""
    root = hvd.size() - 1

    def body():
        variables = [tf.Variable(tf.fill([3], float(hvd.rank()))), tf.Variable(tf.constant(hvd.rank(), tf.int64))]
        values = hvd.broadcast_(variables, root_rank=root, name="c3.inplace")
        with tf.control_dependencies(values):
            return values, [tf.identity(v) for v in variables]

    values, assigned = run(execution, body)
    assert [np.asarray(v).tolist() for v in values] == [[float(root)] * 3, root]
    assert [np.asarray(v).tolist() for v in assigned] == [[float(root)] * 3, root]


def test_in_place_broadcast_of_variables_made_outside_a_tf_function(hvd, mode):
    root = hvd.size() - 1
    variables = [tf.Variable(tf.fill([2], float(hvd.rank())))]
    values = mode(lambda: hvd.broadcast_(variables, root_rank=root))()
    assert [v.numpy().tolist() for v in values] == [[float(root)] * 2] == [v.numpy().tolist() for v in variables]


@pytest.mark.parametrize("inplace", [False, True])
def test_broadcast_variables_in_a_session(hvd, inplace):
    """horovod/tensorflow/functions.py broadcast_variables: an op in graph mode, in place or not."""
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.Variable(tf.fill([2], float(hvd.rank()))), tf.Variable(tf.constant(hvd.rank()))]
        bcast = hvd.broadcast_variables(variables, root_rank=0, inplace=inplace)
        assert isinstance(bcast, tf.Operation)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        session.run(bcast)
        assert [np.asarray(v).tolist() for v in session.run(variables)] == [[0.0, 0.0], 0]


def _payloads(rank: int) -> list:
    return [{"rank": rank}, list(range(rank * 100)), "x" * (rank + 1)]


def test_broadcast_object_fn_in_a_session(hvd):
    """horovod/tensorflow/functions.py broadcast_object_fn: ops built once, fed by placeholders, run each call."""
    root = hvd.size() - 1
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        bcast = hvd.broadcast_object_fn(root_rank=root, session=session, name="c3.objfn")
        ops_after_build = len(graph.get_operations())
        for mine, roots in zip(_payloads(hvd.rank()), _payloads(root)):
            assert bcast(mine) == roots
        assert len(graph.get_operations()) == ops_after_build  # no op added per call
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_object_fn()


def test_tf1_elastic_state_syncs_in_a_session(hvd):
    """horovod/tensorflow/elastic.py TensorFlowState in graph mode: sync runs the broadcast op in the session and
    broadcasts the attributes; restore goes back to the synced values."""
    graph = tf.Graph()
    with graph.as_default():
        weights = tf.Variable(tf.fill([2], float(hvd.rank() + 1)))
        bump = weights.assign_add(tf.ones([2]))
        init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            state = hvd.elastic.TensorFlowState([weights], session=session, epoch=hvd.rank() + 10)
            state.sync()
            assert session.run(weights).tolist() == [1.0, 1.0] and state.epoch == 10
            session.run(bump)
            state.restore()
            assert session.run(weights).tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- 3. broadcast_global_variables
def test_broadcast_global_variables_needs_a_graph(hvd):
    """horovod/tensorflow/__init__.py broadcast_global_variables: RuntimeError in eager mode."""
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)


def test_broadcast_global_variables_returns_the_op_in_a_graph(hvd):
    """... and broadcast_variables(global_variables()) in a graph: one op, resource and reference variables."""
    root = hvd.size() - 1
    graph = tf.Graph()
    with graph.as_default():
        resource = tf.compat.v1.get_variable("w", initializer=tf.fill([2, 2], float(hvd.rank())))
        reference = tf.compat.v1.Variable(tf.fill([3], hvd.rank()), use_resource=False)
        counter = tf.Variable(tf.constant(hvd.rank(), tf.int64))
        bcast = hvd.broadcast_global_variables(root)
        assert isinstance(bcast, tf.Operation)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        assert session.run(bcast) is None
        values = session.run([resource, reference, counter])
        assert [v.tolist() for v in values] == [[[float(root)] * 2] * 2, [root] * 3, root]


# ----------------------------------------------------------------------------- 4. IndexedSlices
def _slices(hvd, dtype):
    """Rank r's slices: rows r and r + 1 of a (size + 1, 2) tensor, holding r + 1 and 2 (r + 1)."""
    r = hvd.rank()
    values = tf.cast([[r + 1, r + 1], [2 * (r + 1), 2 * (r + 1)]], dtype)
    return tf.IndexedSlices(values, tf.constant([r, r + 1], tf.int64), dense_shape=tf.constant([hvd.size() + 1, 2]))


def _gathered(hvd):
    return [[float(k * (r + 1))] * 2 for r in range(hvd.size()) for k in (1, 2)]


@pytest.mark.parametrize("dtype", [tf.int8, tf.uint8, tf.int32, tf.int64, tf.float32])
def test_indexed_slices_average_of_every_dtype(hvd, execution, dtype):
    """horovod/tensorflow/__init__.py allreduce: values and indices allgathered, Average divides the values by the
    set's size with `/` (integer values become float32 or float64, as TensorFlow's truediv gives)."""

    def body():
        reduced = hvd.allreduce(_slices(hvd, dtype), op=hvd.Average)
        return reduced.values, reduced.indices

    values, indices = run(execution, body)
    expected_dtype = (tf.cast(tf.ones([1], dtype), dtype) / tf.cast(1, dtype)).dtype.as_numpy_dtype
    assert values.dtype == expected_dtype
    np.testing.assert_allclose(values, np.array(_gathered(hvd)) / hvd.size(), rtol=1e-6)
    assert indices.tolist() == [i for r in range(hvd.size()) for i in (r, r + 1)]


def test_grouped_allreduce_of_slices_and_dense_tensors(hvd, execution):
    """horovod/tensorflow/__init__.py grouped_allreduce: IndexedSlices allgathered (and averaged), dense tensors
    allreduced, each result in its input's place."""
    n, r = hvd.size(), hvd.rank()

    def body():
        dense = tf.fill([2], float(r + 1))
        doubles = tf.fill([3], 2.0 * r)
        results = hvd.grouped_allreduce([dense, _slices(hvd, tf.int32), doubles, _slices(hvd, tf.float32)])
        return [results[0], results[1].values, results[2], results[3].values, results[3].indices]

    dense, int_values, doubles, float_values, indices = run(execution, body)
    mean = (n + 1) / 2
    np.testing.assert_allclose(dense, [mean] * 2)
    np.testing.assert_allclose(int_values, np.array(_gathered(hvd)) / n)
    assert int_values.dtype == np.float64
    np.testing.assert_allclose(doubles, [float(n - 1)] * 3)
    np.testing.assert_allclose(float_values, np.array(_gathered(hvd)) / n, rtol=1e-6)
    assert indices.tolist() == [i for rank in range(n) for i in (rank, rank + 1)]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"prescale_factor": 2.0}, "Pre/postscale_factor are not supported with tf.IndexedSlices"),
        ({"postscale_factor": 0.5}, "Pre/postscale_factor are not supported with tf.IndexedSlices"),
        ({"op": "Min"}, "Only Sum and Average ops are supported with tf.IndexedSlices"),
        ({"op": "Adasum"}, "Adasum reduction does not currently support sparse tensors"),
    ],
)
def test_indexed_slices_refuse_scale_factors_and_other_ops(hvd, execution, kwargs, message):
    """horovod/tensorflow/__init__.py allreduce and grouped_allreduce: NotImplementedError, here on every rank
    before anything is submitted."""
    kwargs = {k: getattr(hvd, v) if k == "op" else v for k, v in kwargs.items()}
    for call in (
        lambda: hvd.allreduce(_slices(hvd, tf.float32), **kwargs).values,
        lambda: hvd.grouped_allreduce([tf.ones([2]), _slices(hvd, tf.float32)], **kwargs)[0],
    ):
        with pytest.raises(NotImplementedError, match=message):
            run(execution, call)
    _job_still_works(hvd)


# ----------------------------------------------------------------------------- 5. alltoall's argument errors
ALLTOALL_ERRORS = {
    "indivisible": (lambda n: (tf.ones([n + 1]), None), "divisible by the number of ranks"),
    "splits-too-large": (lambda n: (tf.ones([n]), [2] * n), r"sum of splits \(\d+\) is greater than"),
    "splits-wrong-length": (lambda n: (tf.ones([n]), [1] * (n + 1)), "one non-negative entry per rank"),
    "splits-negative": (lambda n: (tf.ones([n]), [-1] + [1] * (n - 1)), "one non-negative entry per rank"),
}


@pytest.mark.parametrize("case", sorted(ALLTOALL_ERRORS))
def test_alltoall_argument_errors_are_invalid_argument(hvd, execution, case):
    """horovod/common/operations.cc EnqueueTensorAlltoall: Status::InvalidArgument, which horovod/tensorflow's
    ConvertStatus makes errors::InvalidArgument; raised on every rank before anything is submitted."""
    inputs, message = ALLTOALL_ERRORS[case]

    def body():
        tensor, splits = inputs(hvd.size())
        result = hvd.alltoall(tensor, splits=splits, name=f"c3.alltoall.{case}")
        return result if splits is None else result[0]

    with pytest.raises(tf.errors.InvalidArgumentError, match=message) as raised:
        run(execution, body)
    if execution == "eager":
        assert isinstance(raised.value, ValueError)  # hvdplus's type for bad input, too
    _job_still_works(hvd)


def test_alltoall_refuses_float_splits_by_their_dtype(hvd, execution):
    """Horovod's op takes int32 splits, so float ones fail by their dtype on every rank, even where their values
    would do (rank 0's here): judged by the values, rank 0 would submit while the others raised, and the ranks
    would fall out of step (issue 43, item 7, found with torch's alltoall). As with Horovod's op: InvalidArgument
    eagerly, TypeError when the graph is built."""
    splits = [1.0] * hvd.size() if hvd.rank() == 0 else [float("nan")] * hvd.size()
    expected = tf.errors.InvalidArgumentError if execution == "eager" else TypeError
    with pytest.raises(expected, match="alltoall splits must be integers"):
        run(execution, lambda: hvd.alltoall(tf.ones([hvd.size()]), splits=splits, name="c3.alltoall.float")[0])
    _job_still_works(hvd)


def test_alltoall_sends_only_the_rows_the_splits_cover(hvd, execution):
    """EnqueueTensorAlltoall accepts splits summing to less than the first dimension: the rows after them are not
    sent; the gradient of those rows is 0."""
    n, r = hvd.size(), hvd.rank()

    def body():
        x = tf.reshape(tf.range(n + 2, dtype=tf.float32) + 100.0 * r, [n + 2, 1])
        with tf.GradientTape() as tape:
            tape.watch(x)
            output, received = hvd.alltoall(x, splits=[1] * n, name="c3.alltoall.short")
            loss = tf.reduce_sum(output * 2.0)
        return output, received, tape.gradient(loss, x)

    output, received, grad = run(execution, body)
    assert output.ravel().tolist() == [100.0 * src + r for src in range(n)]
    assert received.tolist() == [1] * n
    assert grad.ravel().tolist() == [2.0] * n + [0.0, 0.0]


# ----------------------------------------------------------------------------- 6. SyncBatchNormalization
def test_sync_batch_normalization_accepts_keras2s_fused_false(hvd):
    """horovod/tensorflow/sync_batch_norm.py: fused=False is accepted (Keras 3 has no fused kernel to turn off);
    fused=True or None raise ValueError."""
    layer = hvd.SyncBatchNormalization(fused=False, momentum=0.5)
    assert isinstance(layer, keras.layers.BatchNormalization) and layer.momentum == 0.5
    for fused in (True, None):
        with pytest.raises(ValueError, match="does not support fused=True"):
            hvd.SyncBatchNormalization(fused=fused)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_sync_batch_normalization_uses_every_ranks_batch(hvd, compiled):
    """In training each rank normalizes with the mean and variance of all ranks' batches together (equal batch
    sizes): the same output as one process normalizing the concatenated batch, and the same moving statistics."""
    n, r = hvd.size(), hvd.rank()
    rng = np.random.default_rng(7)
    batches = [rng.normal(loc=rank, scale=rank + 1.0, size=(4, 3)).astype(np.float32) for rank in range(n)]
    layer = hvd.SyncBatchNormalization(fused=False, momentum=0.0, epsilon=1e-3)
    call = tf.function(lambda x: layer(x, training=True)) if compiled else (lambda x: layer(x, training=True))
    output = call(tf.constant(batches[r])).numpy()
    everything = np.concatenate(batches)
    mean, variance = everything.mean(axis=0), everything.var(axis=0)
    np.testing.assert_allclose(output, (batches[r] - mean) / np.sqrt(variance + 1e-3), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.moving_variance.numpy(), variance, rtol=1e-4, atol=1e-4)
