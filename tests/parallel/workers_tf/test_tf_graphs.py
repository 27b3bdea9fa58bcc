"""Graphs with many independent collectives run without deadlock, whatever TF's thread count (see _graph.py).

A tf.compat.v1 Session runs ready ops in any order on its inter-op threads; before the submit/wait split,
30 independent allgathers in one `session.run` hung every rank. tests/parallel/test_tf_jobs.py also runs
this module with one inter-op thread for the whole process (tf.function and eager use that pool).
Written to pass at any world size."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

DTYPES = [tf.float32, tf.int32, tf.float64, tf.int64, tf.uint8, tf.float16]


def session_config(threads: int | None) -> tf.compat.v1.ConfigProto | None:
    """One inter-op thread of the session's own, or TF's default pool."""
    if threads is None:
        return None
    return tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads, use_per_session_threads=True)


def gathered(hvd, i: int) -> list[list[float]]:
    """What allgather of rank r's `[r + 1, 2]` rows filled with r + i gives."""
    return [[r + i] * 2 for r in range(hvd.size()) for _ in range(r + 1)]


@pytest.mark.parametrize("threads", [None, 1], ids=["default-threads", "one-thread"])
def test_one_session_run_of_many_independent_collectives(hvd, threads):
    graph = tf.Graph()
    with graph.as_default():
        outputs = [
            hvd.allgather(tf.fill([hvd.rank() + 1, 2], tf.cast(hvd.rank() + i, dtype)))
            for i, dtype in enumerate(DTYPES * 5)
        ]
        outputs += [hvd.allreduce(tf.fill([3], float(i)), op=hvd.Sum) for i in range(5)]
        outputs += [hvd.broadcast(tf.fill([2], hvd.rank()), root_rank=i % hvd.size()) for i in range(5)]
    with tf.compat.v1.Session(graph=graph, config=session_config(threads)) as session:
        for _ in range(3):
            results = session.run(outputs)
            for i, result in enumerate(results[:30]):
                assert result.tolist() == gathered(hvd, i), (i, result)
            assert [r.tolist() for r in results[30:35]] == [[float(i * hvd.size())] * 3 for i in range(5)]
            assert [r.tolist() for r in results[35:]] == [[i % hvd.size()] * 2 for i in range(5)]
        # a subset alone (the chain also runs the collectives created before it, on every rank alike)
        assert session.run(outputs[7]).tolist() == gathered(hvd, 7)


def test_tf1_training_graph_with_placeholders_and_a_broadcast_fetched_alone(hvd):
    """The TF1 idiom: build the training step (gradients allreduced), then `bcast`; run bcast alone (no feed:
    it does not pull in the step's collectives), then train steps fed through placeholders."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2])
        weights = tf.Variable(tf.fill([2, 1], float(hvd.rank())))
        loss = tf.reduce_sum(tf.matmul(x, weights))
        grads = [hvd.allreduce(g) for g in tf.gradients(loss, [weights])]
        step = weights.assign_sub(0.5 * grads[0])
        bcast = hvd.broadcast_global_variables(0)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph, config=session_config(1)) as session:
        session.run(init)
        session.run(bcast)
        assert session.run(weights).tolist() == [[0.0], [0.0]]
        for _ in range(2):
            session.run(step, feed_dict={x: np.full([1, 2], hvd.rank() + 1.0, np.float32)})
        mean_input = (hvd.size() + 1) / 2  # the averaged gradient of sum(x @ w) is the mean input row
        np.testing.assert_allclose(session.run(weights), [[-mean_input], [-mean_input]])


def test_tf_function_with_many_independent_collectives(hvd):
    """tf.function runs stateful ops in creation order (automatic control dependencies)."""

    @tf.function
    def many():
        return [
            hvd.allgather(tf.fill([hvd.rank() + 1, 2], tf.cast(hvd.rank() + i, dtype)))
            for i, dtype in enumerate(DTYPES * 5)
        ]

    for _ in range(2):
        assert [r.numpy().tolist() for r in many()] == [gathered(hvd, i) for i in range(30)]


def test_backward_function_of_a_tf_function_with_many_collectives(hvd):
    """An outer tape differentiating a tf.function: TF builds the backward function without automatic control
    dependencies, so its ten independent gradient allreduces need the chain (this hung before it)."""
    forward = tf.function(lambda t: [hvd.allreduce(t * float(i)) for i in range(10)])
    x = tf.ones([2, 3])
    for _ in range(2):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.add_n([tf.reduce_sum(y) for y in forward(x)])
        np.testing.assert_allclose(tape.gradient(loss, x).numpy(), np.full([2, 3], 45.0))  # the sum of the i
