"""The gradient of every differentiable collective, fetched alone, follows horovod/tensorflow/mpi_ops.py 0.28.1.

A tf.compat.v1 Session runs only what the fetched tensor needs. A gradient that skips its collective on some ranks
(the broadcast gradient once made its non-root ranks' zeros with `tf.zeros_like`, which needs only a static shape)
leaves the other ranks waiting forever. Here each test builds the forward op, fetches only its gradient, in a
tf.compat.v1 graph and in a tf.function, and checks its value against Horovod's gradient rules:

* allreduce (`_allreduce_grad`, `_grouped_allreduce_grad`): the allreduce of the upstream gradient, same op;
* allgather (`_allgather_grad`, `_grouped_allgather_grad`): this rank's rows of the upstream gradient averaged;
* broadcast (`_broadcast_grad`): the upstream gradient averaged on the root, times 0 elsewhere (every rank
  takes part in the average);
* reducescatter (`_reducescatter_grad`): the allgather of the shard gradients, times the set's size for Sum;
* alltoall (`_alltoall_grad`): the alltoall of the upstream gradient, back along the received splits.

The upstream gradient on rank r is r + 1 everywhere, so that a rank's own value, a sum and an average differ.
Written to pass at any world size; broadcast, whose root is a global rank, also on `rest` (every rank but 0), the
others on the global set (their process-set gradients: test_tf_horovod_semantics.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tests.parallel.process_sets import global_ranks, pset, rest  # noqa: F401 (fixtures)

SHAPES = [(2,), (2, 3), (2, 1, 2)]  # ranks 1-3; the first dimension is scaled per rank where an op allows it


def _upstream(hvd, y: tf.Tensor) -> tf.Tensor:
    return tf.fill(tf.shape(y), tf.cast(hvd.rank() + 1, y.dtype))


def _gradient_alone(hvd, how: str, forward: Callable[[tf.Tensor], Any], x: np.ndarray) -> np.ndarray:
    """d forward(x) / dx with upstream r + 1, computed without fetching anything else."""
    if how == "graph":
        graph = tf.Graph()
        with graph.as_default():
            t = tf.constant(x)
            y = forward(t)
            [grad] = tf.gradients(y, [t], [_upstream(hvd, y)])
        with tf.compat.v1.Session(graph=graph) as session:
            return session.run(grad)

    @tf.function
    def step(t):
        with tf.GradientTape() as tape:
            tape.watch(t)
            y = forward(t)
        return tape.gradient(y, t, output_gradients=_upstream(hvd, y))

    return step(tf.constant(x)).numpy()


def _members(hvd, pset):
    members = global_ranks(hvd, pset)
    return members, members.index(hvd.rank()), len(members)


@pytest.fixture(params=["graph", "tf.function"])
def how(request):
    return request.param


@pytest.fixture(params=[np.float32, np.float64], ids=["float32", "float64"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_allreduce_gradient_alone(hvd, how, dtype, op_name):
    pset = hvd.global_process_set
    members, _, n = _members(hvd, pset)
    op = getattr(hvd, op_name)
    reduced = sum(r + 1 for r in members) / (n if op_name == "Average" else 1)
    for shape in SHAPES:
        x = np.full(shape, hvd.rank(), dtype)
        grad = _gradient_alone(hvd, how, lambda t: hvd.allreduce(t, op=op, process_set=pset), x)
        np.testing.assert_allclose(grad, np.full(shape, reduced, dtype))
        # grouped: d/dt of sum(allreduce(t)) + sum(allreduce(2t)), upstream r + 1 on that scalar
        grad = _gradient_alone(
            hvd,
            how,
            lambda t: tf.add_n(
                [tf.reduce_sum(g) for g in hvd.grouped_allreduce([t, t * 2.0], op=op, process_set=pset)]
            ),
            x,
        )
        np.testing.assert_allclose(grad, np.full(shape, 3.0 * reduced, dtype))


def test_allgather_gradient_alone(hvd, how, dtype):
    pset = hvd.global_process_set
    members, me, n = _members(hvd, pset)
    average = sum(r + 1 for r in members) / n
    for shape in SHAPES:
        rows = (me + 1,) + shape[1:]  # uneven first dimensions
        x = np.full(rows, hvd.rank(), dtype)
        grad = _gradient_alone(hvd, how, lambda t: hvd.allgather(t, process_set=pset), x)
        np.testing.assert_allclose(grad, np.full(rows, average, dtype))
        grad = _gradient_alone(
            hvd, how, lambda t: tf.concat(hvd.grouped_allgather([t, t * 3.0], process_set=pset), axis=0), x
        )
        np.testing.assert_allclose(grad, np.full(rows, 4.0 * average, dtype))


def test_broadcast_gradient_alone(hvd, pset, how, dtype):
    """The issue's case: only the gradient is fetched; the root gets the average, the others zeros."""
    if not pset.included():
        return
    members, _, n = _members(hvd, pset)
    average = sum(r + 1 for r in members) / n
    for root in members:
        for shape in SHAPES:
            x = np.full(shape, hvd.rank(), dtype)
            grad = _gradient_alone(hvd, how, lambda t: hvd.broadcast(t, root_rank=root, process_set=pset), x)
            np.testing.assert_allclose(grad, np.full(shape, average if hvd.rank() == root else 0.0, dtype))


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_reducescatter_gradient_alone(hvd, how, dtype, op_name):
    pset = hvd.global_process_set
    members, _, n = _members(hvd, pset)
    scale = n if op_name == "Sum" else 1
    for shape in SHAPES:
        rows = (2 * n + 1,) + shape[1:]  # uneven shards: the first members get one row more
        counts = [rows[0] // n + (1 if i < rows[0] % n else 0) for i in range(n)]
        x = np.full(rows, hvd.rank(), dtype)
        grad = _gradient_alone(hvd, how, lambda t: hvd.reducescatter(t, op=getattr(hvd, op_name), process_set=pset), x)
        expected = np.concatenate(
            [np.full((counts[i],) + shape[1:], (r + 1) * scale, dtype) for i, r in enumerate(members)]
        )
        np.testing.assert_allclose(grad, expected)


def test_alltoall_gradient_alone(hvd, how, dtype):
    pset = hvd.global_process_set
    members, _, n = _members(hvd, pset)
    for shape in SHAPES:
        rows = (2 * n,) + shape[1:]  # two rows to each member
        x = np.full(rows, hvd.rank(), dtype)
        grad = _gradient_alone(hvd, how, lambda t: hvd.alltoall(t, process_set=pset), x)
        # rows 2j, 2j + 1 went to member j, whose upstream gradient (its rank + 1) comes back along them
        expected = np.concatenate([np.full((2,) + shape[1:], r + 1, dtype) for r in members])
        np.testing.assert_allclose(grad, expected)
