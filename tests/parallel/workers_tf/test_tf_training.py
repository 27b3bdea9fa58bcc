"""DistributedGradientTape against single-process training on the combined batch, eagerly and in tf.function.

Written to pass at any world size; run by tests/parallel/test_tf_jobs.py on 2 and 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from hvdplus.common.exceptions import CollectiveMismatchError

STEPS = 4
PER_RANK = 4

# float32, a few steps of a tiny MLP: distributed and reference gradients differ only by summation order
# (~1e-7 relative), which momentum SGD cannot amplify beyond ~1e-6 in 4 steps; 1e-5 leaves margin and still
# catches any scaling error (a missing average is off by a factor of size).
EXACT = {"rtol": 1e-5, "atol": 1e-6}
# fp16 keeps 11 significant bits: each gradient element is rounded (~4.9e-4 relative) before the sum and the
# sum once more; over 4 steps of lr 0.1 the parameters move by O(0.1), so 1e-3 absolute bounds the error.
HALF = {"rtol": 1e-3, "atol": 1e-3}


def make_weights(seed: int) -> list[tf.Variable]:
    """Variables with numpy initial values (in a tf.compat.v1 graph, an initial value read from another variable
    would race with that variable's own initializer under global_variables_initializer)."""
    generator = np.random.default_rng(seed)
    return [
        tf.Variable(generator.normal(size=shape).astype(np.float32), name=name)
        for shape, name in (((4, 8), "w1"), ((8,), "b1"), ((8, 2), "w2"))
    ]


def global_batches(size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    generator = np.random.default_rng(1234)
    return [
        (
            generator.normal(size=(size * PER_RANK, 4)).astype(np.float32),
            generator.normal(size=(size * PER_RANK, 2)).astype(np.float32),
        )
        for _ in range(STEPS)
    ]


def loss_fn(weights: list[tf.Variable], x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    w1, b1, w2 = weights
    return tf.reduce_mean((tf.tanh(x @ w1 + b1) @ w2 - y) ** 2)


def train(
    hvd, weights, batches, distributed: bool, compile_step: bool, lr: float = 0.1, **tape_kwargs
) -> list[np.ndarray]:
    velocity = [tf.Variable(tf.zeros_like(w)) for w in weights]

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(weights, x, y)
        if distributed:
            tape = hvd.DistributedGradientTape(tape, **tape_kwargs)
        for w, v, g in zip(weights, velocity, tape.gradient(loss, weights)):
            v.assign(0.9 * v + g)
            w.assign_sub(lr * v)

    step = tf.function(step) if compile_step else step
    for x, y in batches:
        step(tf.constant(x), tf.constant(y))
    return [w.numpy() for w in weights]


def distributed(hvd, compile_step: bool, lr: float = 0.1, **tape_kwargs) -> list[np.ndarray]:
    """Rank r starts from its own weights (broadcast from 0) and trains on its rows of each global batch."""
    weights = make_weights(seed=hvd.rank())
    hvd.broadcast_variables(weights, root_rank=0)
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    shards = [(x[rows], y[rows]) for x, y in global_batches(hvd.size())]
    return train(hvd, weights, shards, True, compile_step, lr, **tape_kwargs)


@pytest.fixture(scope="module")
def reference(hvd) -> list[np.ndarray]:
    return train(hvd, make_weights(seed=0), global_batches(hvd.size()), False, False)


@pytest.mark.parametrize("compile_step", [False, True], ids=["eager", "tf.function"])
def test_tape_matches_single_process(hvd, reference, compile_step):
    for got, want in zip(distributed(hvd, compile_step), reference):
        np.testing.assert_allclose(got, want, **EXACT)


def test_tape_options_keep_the_average(hvd, reference):
    """Groups and predivide still produce the averaged gradient, Sum the summed one, fp16 about the average."""
    for got, want in zip(distributed(hvd, True, groups=2, gradient_predivide_factor=2.0), reference):
        np.testing.assert_allclose(got, want, **EXACT)
    # Sum over n ranks is n times the average: momentum SGD with lr / n then takes the reference's steps
    for got, want in zip(distributed(hvd, True, lr=0.1 / hvd.size(), op=hvd.Sum), reference):
        np.testing.assert_allclose(got, want, **EXACT)
    for got, want in zip(distributed(hvd, True, compression=hvd.Compression.fp16), reference):
        np.testing.assert_allclose(got, want, **HALF)


def test_partial_tape_keeps_local_gradients_local(hvd):
    import keras

    local = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(float(hvd.rank())))
    shared = tf.Variable([1.0])
    local.build((None, 1))
    x = tf.constant([[float(hvd.rank() + 1)]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(x) * shared + shared * x)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    kernel_grad, bias_grad, shared_grad = tape.gradient(loss, [local.kernel, local.bias, shared])
    # local gradients: this rank's own, divided by size (scale_local_gradients); shared: averaged over ranks
    np.testing.assert_allclose(kernel_grad.numpy(), [[(hvd.rank() + 1) / hvd.size()]])
    np.testing.assert_allclose(bias_grad.numpy(), [1.0 / hvd.size()])
    expected_shared = np.mean([(r + 1) * r + (r + 1) for r in range(hvd.size())])
    np.testing.assert_allclose(shared_grad.numpy(), [expected_shared], rtol=1e-6)


def test_sparse_gradients_are_allgathered(hvd):
    table = tf.Variable(tf.ones([hvd.size() + 1, 2]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [hvd.rank()]) * float(hvd.rank() + 1))
    [grad] = hvd.DistributedGradientTape(tape).gradient(loss, [table])
    assert isinstance(grad, tf.IndexedSlices)
    dense = tf.convert_to_tensor(grad).numpy()
    np.testing.assert_allclose(dense[: hvd.size(), 0], (np.arange(hvd.size()) + 1) / hvd.size())
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [hvd.rank()]))
    [grad] = hvd.DistributedGradientTape(tape, sparse_as_dense=True).gradient(loss, [table])
    assert isinstance(grad, tf.Tensor) and grad.shape == (hvd.size() + 1, 2)


def test_bad_tape_arguments(hvd):
    with pytest.raises(TypeError, match="tf.GradientTape"):
        hvd.DistributedGradientTape(object())
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), groups="all")
    with pytest.raises(TypeError, match="Compressor"):
        hvd.DistributedGradientTape(tf.GradientTape(), compression="fp16")


def test_variables_of_different_shapes_raise_on_every_rank(hvd):
    weights = tf.Variable(tf.ones([2 + min(hvd.rank(), 1)]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(weights)
    with pytest.raises(CollectiveMismatchError, match="Mismatched shapes"):
        hvd.DistributedGradientTape(tape).gradient(loss, [weights])
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy().tolist() == [float(hvd.size())]  # the job goes on


def test_tf1_distributed_optimizer_in_a_graph_matches_single_process(hvd, reference):
    """horovod.tensorflow.DistributedOptimizer of a tf.compat.v1.train optimizer: minimize() applies averaged
    gradients (Horovod's _DistributedOptimizer.compute_gradients), in a tf.compat.v1 graph with placeholders."""
    graph = tf.Graph()
    with graph.as_default():
        weights = make_weights(seed=hvd.rank())
        x, y = tf.compat.v1.placeholder(tf.float32, [None, 4]), tf.compat.v1.placeholder(tf.float32, [None, 2])
        optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
        assert (
            isinstance(optimizer, tf.compat.v1.train.Optimizer)
            and optimizer.get_name() == "DistributedMomentumOptimizer"
        )
        step = optimizer.minimize(loss_fn(weights, x, y), var_list=weights)
        bcast = hvd.broadcast_global_variables(0)
        init = tf.compat.v1.global_variables_initializer()
    rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        session.run(bcast)
        for xs, ys in global_batches(hvd.size()):
            session.run(step, feed_dict={x: xs[rows], y: ys[rows]})
        assert len(optimizer.variables()) == len(weights) and optimizer.get_slot_names() == ["momentum"]
        for got, want in zip(session.run(weights), reference):
            np.testing.assert_allclose(got, want, **EXACT)


def test_distributed_optimizer_hands_keras_optimizers_to_hvdplus_keras(hvd):
    import keras

    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    assert isinstance(wrapped, keras.optimizers.SGD) and type(wrapped) is not keras.optimizers.SGD
    variable = keras.Variable(np.zeros(2, np.float32))
    wrapped.apply([np.full(2, hvd.rank() + 1.0, np.float32)], [variable])
    np.testing.assert_allclose(variable.numpy(), [-0.1 * (hvd.size() + 1) / 2] * 2, rtol=1e-3)  # averaged
    with pytest.raises(ValueError, match="Adasum is not supported yet with Keras"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2)
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        hvd.DistributedOptimizer(object())
