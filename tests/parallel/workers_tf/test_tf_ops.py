"""Every hvdplus.tensorflow collective, eagerly and inside tf.function: values, static shapes and gradients.

Written to pass at any world size; run by tests/parallel/test_tf_jobs.py on 2 and 3 ranks.
Eager collectives are numbered by the core in call order; graph ones are named after their graph ops."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from hvdplus.common.exceptions import CollectiveMismatchError


def rank_tensor(hvd, shape=(2, 3), dtype=tf.float32):
    """A tensor whose values depend on the rank: base + rank."""
    base = tf.reshape(tf.range(int(np.prod(shape)), dtype=tf.float32), shape)
    return tf.cast(base + hvd.rank(), dtype)


def expected_sum(hvd, shape=(2, 3)):
    base = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    return base * hvd.size() + sum(range(hvd.size()))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32, tf.int64, tf.float16, tf.bfloat16])
def test_allreduce_dtypes_and_ops(hvd, mode, dtype):
    x = rank_tensor(hvd, dtype=dtype)
    out = mode(lambda t: (hvd.allreduce(t, op=hvd.Sum), hvd.allreduce(t, op=hvd.Max), hvd.allreduce(t, op=hvd.Min)))(x)
    total, high, low = (o.numpy().astype(np.float64) for o in out)
    np.testing.assert_allclose(total, expected_sum(hvd))
    np.testing.assert_allclose(high, rank_tensor(hvd, dtype=tf.float64).numpy() - hvd.rank() + hvd.size() - 1)
    np.testing.assert_allclose(low, rank_tensor(hvd, dtype=tf.float64).numpy() - hvd.rank())
    assert all(o.dtype == dtype and o.shape == (2, 3) for o in out)


def test_allreduce_average_scaling_and_compression(hvd, mode):
    x = rank_tensor(hvd)
    fn = mode(
        lambda t: (
            hvd.allreduce(t),
            hvd.allreduce(t, average=False, prescale_factor=2.0, postscale_factor=0.5),
            hvd.allreduce(t, compression=hvd.Compression.fp16),
        )
    )
    average, scaled_sum, compressed = fn(x)
    np.testing.assert_allclose(average.numpy(), expected_sum(hvd) / hvd.size(), rtol=1e-6)
    np.testing.assert_allclose(scaled_sum.numpy(), expected_sum(hvd), rtol=1e-6)
    assert compressed.dtype == tf.float32  # decompressed back; small integers are exact in fp16
    np.testing.assert_allclose(compressed.numpy(), expected_sum(hvd) / hvd.size(), rtol=1e-3)


def test_fp16_compression_really_rounds_to_half_precision(hvd, mode):
    # 1 + 2**-12 is exact in float32 but rounds to 1.0 in float16 (10-bit mantissa): a no-op codec keeps it.
    x = tf.fill([4], 1.0 + 2.0**-12)
    plain, compressed = mode(
        lambda t: (hvd.allreduce(t, op=hvd.Sum), hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16))
    )(x)
    np.testing.assert_array_equal(plain.numpy(), np.full(4, hvd.size() * (1.0 + 2.0**-12), np.float32))
    np.testing.assert_array_equal(compressed.numpy(), np.full(4, float(hvd.size()), np.float32))


def test_static_shapes_inside_tf_function(hvd):
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def fn(t):
        gathered = hvd.allgather(t)
        reduced = hvd.allreduce(t)
        assert reduced.shape.as_list() == [None, 3] and gathered.shape.as_list() == [None, 3]
        return reduced, gathered, hvd.broadcast(t, 0)

    fixed = tf.function(
        lambda t: (hvd.allreduce(t), hvd.allgather(t), hvd.broadcast(t, 0), hvd.reducescatter(t), hvd.alltoall(t))
    )
    graph = fixed.get_concrete_function(tf.TensorSpec([hvd.size() * 2, 3], tf.float32)).structured_outputs
    assert [o.shape.as_list() for o in graph] == [
        [hvd.size() * 2, 3],
        [None, 3],
        [hvd.size() * 2, 3],
        [None, 3],
        [None, 3],
    ]
    reduced, gathered, _ = fn(rank_tensor(hvd))
    assert reduced.shape == (2, 3) and gathered.shape == (2 * hvd.size(), 3)


def test_grouped_allreduce_with_indexed_slices(hvd, mode):
    dense = rank_tensor(hvd)
    sparse = tf.IndexedSlices(tf.fill([1, 3], float(hvd.rank() + 1)), tf.constant([hvd.rank()]), tf.constant([5, 3]))
    dense_out, sparse_out = mode(lambda d: hvd.grouped_allreduce([d, sparse], op=hvd.Average))(dense)
    np.testing.assert_allclose(dense_out.numpy(), expected_sum(hvd) / hvd.size(), rtol=1e-6)
    assert isinstance(sparse_out, tf.IndexedSlices)
    assert sparse_out.indices.numpy().tolist() == list(range(hvd.size()))
    np.testing.assert_allclose(sparse_out.values.numpy()[:, 0], (np.arange(hvd.size()) + 1) / hvd.size())
    dense_sum = tf.convert_to_tensor(hvd.allreduce(sparse, op=hvd.Sum))
    np.testing.assert_allclose(dense_sum.numpy()[: hvd.size(), 0], np.arange(hvd.size()) + 1)


def test_allgather_uneven_and_grouped(hvd, mode):
    first = tf.fill([hvd.rank() + 1, 2], hvd.rank())
    second = tf.ones([1], tf.float64) * hvd.rank()
    gathered, (a, b) = mode(lambda x, y: (hvd.allgather(x), hvd.grouped_allgather([x, y])))(first, second)
    rows = [r for r in range(hvd.size()) for _ in range(r + 1)]
    assert gathered.numpy()[:, 0].tolist() == rows and a.numpy()[:, 1].tolist() == rows
    assert b.numpy().tolist() == list(range(hvd.size()))


def test_broadcast_from_every_root(hvd, mode):
    for root in range(hvd.size()):
        out = mode(lambda t: hvd.broadcast(t, root_rank=root))(rank_tensor(hvd, dtype=tf.int64))
        assert out.numpy().tolist() == (rank_tensor(hvd, dtype=tf.int64).numpy() - hvd.rank() + root).tolist()


def test_alltoall_even_and_with_splits(hvd, mode):
    even = tf.fill([hvd.size(), 2], hvd.rank())
    splits = [r + 1 for r in range(hvd.size())]  # rank r receives r + 1 rows from every rank
    uneven = tf.fill([sum(splits), 1], float(hvd.rank()))
    out, (received, received_splits) = mode(lambda e, u: (hvd.alltoall(e), hvd.alltoall(u, splits=splits)))(
        even, uneven
    )
    assert out.numpy()[:, 0].tolist() == list(range(hvd.size()))
    assert received.numpy()[:, 0].tolist() == [r for r in range(hvd.size()) for _ in range(hvd.rank() + 1)]
    assert received_splits.numpy().tolist() == [hvd.rank() + 1] * hvd.size()


def test_reducescatter_and_grouped(hvd, mode):
    rows = 2 * hvd.size() + 1  # uneven: the first rank gets the extra row (Horovod's split)
    x = tf.ones([rows, 2]) * (hvd.rank() + 1)
    shard, (grouped,) = mode(lambda t: (hvd.reducescatter(t, op=hvd.Sum), hvd.grouped_reducescatter([t])))(x)
    mine = 3 if hvd.rank() == 0 else 2
    assert shard.shape == (mine, 2) and grouped.shape == (mine, 2)
    np.testing.assert_allclose(shard.numpy(), hvd.size() * (hvd.size() + 1) / 2)
    np.testing.assert_allclose(grouped.numpy(), (hvd.size() + 1) / 2)


def gradient(fn, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return tape.gradient(y, x)


def test_gradients_of_allreduce_allgather_broadcast(hvd, mode):
    n, r = hvd.size(), hvd.rank()
    x = tf.ones([2, 2]) * (r + 1)
    weights = tf.constant([[1.0, 2.0]]) * (r + 1)  # a rank-dependent loss makes the reductions visible
    grads = mode(
        lambda t: (
            gradient(lambda v: tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum) * weights), t),
            gradient(lambda v: tf.reduce_sum(hvd.allreduce(v) * weights), t),
            gradient(lambda v: tf.reduce_sum(hvd.allgather(v) * weights), t),
            gradient(lambda v: tf.reduce_sum(hvd.broadcast(v, 0) * weights), t),
        )
    )(x)
    weight_sum = np.array([[1.0, 2.0]]) * n * (n + 1) / 2  # sum over ranks of their weights
    np.testing.assert_allclose(grads[0].numpy(), np.broadcast_to(weight_sum, (2, 2)))
    np.testing.assert_allclose(grads[1].numpy(), np.broadcast_to(weight_sum / n, (2, 2)), rtol=1e-6)
    # Horovod 0.28.1's _allgather_grad and _broadcast_grad average the output gradient over the ranks
    np.testing.assert_allclose(grads[2].numpy(), np.broadcast_to(weight_sum / n, (2, 2)), rtol=1e-6)
    np.testing.assert_allclose(grads[3].numpy(), np.broadcast_to(weight_sum / n * (r == 0), (2, 2)), rtol=1e-6)


def test_gradients_of_alltoall_and_reducescatter(hvd, mode):
    x = tf.ones([hvd.size() * 2, 1])
    weights = tf.range(hvd.size() * 2, dtype=tf.float32)[:, None]
    grads = mode(
        lambda t: (
            gradient(lambda v: tf.reduce_sum(hvd.alltoall(v) * weights), t),
            gradient(lambda v: tf.reduce_sum(hvd.reducescatter(v, op=hvd.Sum)), t),
        )
    )(x)
    # input row i of rank r lands on rank i // 2 at output row 2r + i % 2, whose weight is its gradient
    expected = [[2 * hvd.rank() + i % 2] for i in range(hvd.size() * 2)]
    np.testing.assert_allclose(grads[0].numpy(), expected)
    np.testing.assert_allclose(grads[1].numpy(), np.full([hvd.size() * 2, 1], hvd.size()))  # Horovod: Sum scales by n


def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient(hvd, mode):
    n, r = hvd.size(), hvd.rank()
    x = tf.ones([r + 1, 2])  # uneven rows: rank q contributes q + 1 rows
    total_rows = n * (n + 1) // 2
    weights = tf.range(1, total_rows + 1, dtype=tf.float32)[:, None] * (r + 1)  # row- and rank-dependent
    grad = mode(lambda t: gradient(lambda v: tf.reduce_sum(hvd.allgather(v) * weights), t))(x)
    offset = r * (r + 1) // 2  # this rank's first row in the gathered tensor
    rank_weight_mean = (n + 1) / 2
    expected = [[rank_weight_mean * (offset + i + 1)] * 2 for i in range(r + 1)]
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-6)


def test_reducescatter_average_gradient_gathers_the_shard_gradients_in_rank_order(hvd, mode):
    n, r = hvd.size(), hvd.rank()
    x = tf.ones([2 * n, 1])
    shard_weights = tf.constant([[1.0], [2.0]]) * (r + 1)  # each rank's two rows of the result
    grad = mode(lambda t: gradient(lambda v: tf.reduce_sum(hvd.reducescatter(v) * shard_weights), t))(x)
    expected = [[(q + 1) * (i + 1)] for q in range(n) for i in range(2)]  # Horovod: Average is not scaled
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-6)


def test_gradient_of_a_nonlinear_reducescatter_is_refused(hvd):
    x = tf.ones([2 * hvd.size(), 1])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(hvd.reducescatter(x, op=hvd.Max))
    with pytest.raises(NotImplementedError, match="gradient of reducescatter is defined for Average and Sum"):
        tape.gradient(y, x)


def test_variables_objects_and_rank_ops(hvd, mode):
    variables = [tf.Variable(tf.ones([3]) * hvd.rank()), tf.Variable(hvd.rank(), dtype=tf.int64)]

    def assign_from_last_rank():
        hvd.broadcast_variables(variables, root_rank=hvd.size() - 1)

    mode(assign_from_last_rank)()
    assert variables[0].numpy().tolist() == [hvd.size() - 1] * 3 and int(variables[1].numpy()) == hvd.size() - 1
    variables[1].assign(hvd.rank() + 5)
    values = hvd.broadcast_(variables, root_rank=0)  # Horovod returns the new values (tensors)
    assert [v.numpy().tolist() for v in values] == [v.numpy().tolist() for v in variables]
    assert int(variables[1].numpy()) == 5 == int(values[1])
    assert hvd.broadcast_object({"rank": hvd.rank()}, root_rank=1) == {"rank": 1}
    assert hvd.allgather_object(hvd.rank() * 10) == [r * 10 for r in range(hvd.size())]
    assert int(hvd.size_op()) == hvd.size() and int(hvd.rank_op()) == hvd.rank()
    assert int(hvd.local_size_op()) == hvd.local_size() and int(hvd.local_rank_op()) == hvd.local_rank()
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_process_set_collectives(hvd, mode):
    odd = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 1])
    try:
        assert int(hvd.size_op(odd.process_set_id)) == odd.size()
        if odd.included():
            out = mode(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=odd))(tf.ones([2]))
            assert out.numpy().tolist() == [float(odd.size())] * 2
    finally:
        hvd.remove_process_set(odd)


def test_join_and_barrier(hvd, mode):
    def join_after_barrier():
        hvd.barrier()
        return hvd.join()

    assert int(mode(join_after_barrier)()) in range(hvd.size())


def test_mismatched_shapes_raise_on_every_rank(hvd):
    bad = tf.ones([2 + min(hvd.rank(), 1)])
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched shapes"):
        hvd.allreduce(bad, name="tf.shape.mismatch.eager")
    with pytest.raises(tf.errors.OpError, match=r"Mismatched shapes"):
        tf.function(lambda t: hvd.allreduce(t, name="tf.shape.mismatch.graph"))(bad)
    with pytest.raises(tf.errors.OpError, match=r"trailing dimensions"):
        tf.function(lambda t: hvd.allgather(t, name="tf.allgather.mismatch"))(tf.ones([1, 2 + min(hvd.rank(), 1)]))
    assert hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist() == [float(hvd.size())] * 2


def test_grouped_calls_with_different_numbers_of_tensors_raise(hvd):
    """Rank r groups 2 + r % 2 tensors: a mismatch error naming the counts on every rank instead of a stall.
    In tf.function, so that the members take graph names: the unmatched third member of rank 1 must not take an
    automatic name that a later eager call on the other ranks would reuse."""
    tensors = [tf.ones([2]), tf.ones([2], dtype=tf.float64)] + [tf.ones([1])] * (hvd.rank() % 2)
    expected = r"Mismatched numbers of tensors in the grouped call .*ha(s|ve) 2; rank 1 has 3\."
    with pytest.raises(tf.errors.OpError, match=expected):
        tf.function(lambda *ts: hvd.grouped_allreduce(list(ts)))(*tensors)
    with pytest.raises(tf.errors.OpError, match=expected):
        tf.function(lambda *ts: hvd.grouped_allgather(list(ts)))(*tensors)
    assert hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist() == [float(hvd.size())] * 2


def test_bad_input_raises_before_any_collective(hvd):
    with pytest.raises(TypeError, match="do not support dtype"):
        hvd.allreduce(tf.constant(["a"]))
    with pytest.raises(ValueError, match="average and op cannot both be set"):
        hvd.allreduce(tf.ones([1]), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(tf.constant(1.0))
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(tf.ones([1]), root_rank=hvd.size())
