"""hvdplus.keras.ZeroOptimizer: sharded optimizer state in model.fit and custom loops against single-process
training on the combined batch, shard sizes, save/reload with plain Keras, mismatched models, bf16.

Written to pass at any world size; run by tests/parallel/test_tf_jobs.py on 2 and 3 ranks."""

from __future__ import annotations

import functools
import json
import math
import warnings
import zipfile

import keras
import numpy as np
import pytest

from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.keras.zero import ZeroOptimizer
from hvdplus.tensorflow.compression import Compression

STEPS = 3
PER_RANK = 4
# The sharded step computes the same float32 update as plain Keras; only the order in which the ranks' gradient
# contributions are summed (and averaged) differs from the single-process mean, a few ulps per step: a few Adam /
# momentum-SGD steps stay within rtol 1e-5 / atol 1e-6 (as for DistributedOptimizer in test_keras.py).
EXACT = {"rtol": 1e-5, "atol": 1e-6}


def make_model(seed: int = 0, units: int = 8, extra: bool = False) -> keras.Model:
    # 4*8 + 8 + 8*2 + 2 = 58 parameters: not a multiple of 2 or 3, so shards differ in size and variables span ranks
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((4,)), keras.layers.Dense(units, activation="tanh")]
    if extra:
        layers.append(keras.layers.Dense(units, activation="tanh"))
    return keras.Sequential(layers + [keras.layers.Dense(2)])


def data(samples: int) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(1234)
    return (
        generator.normal(size=(samples, 4)).astype(np.float32),
        generator.normal(size=(samples, 2)).astype(np.float32),
    )


def adam():
    return keras.optimizers.Adam(0.01)


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


@functools.cache
def reference(size: int, make_optimizer, passes: int = 1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Plain Keras, one process: STEPS updates on batches of size * passes * PER_RANK samples; returns the
    weights and the optimizer's variables (computed once per job: Keras' fit costs seconds)."""
    model = make_model()
    model.compile(optimizer=make_optimizer(), loss="mse", run_eagerly=True)  # tiny model: tracing costs more
    x, y = data(STEPS * size * passes * PER_RANK)
    model.fit(x, y, batch_size=size * passes * PER_RANK, shuffle=False, verbose=0)
    return model.get_weights(), [np.array(v.numpy()) for v in model.optimizer.variables]


def rank_rows(hvd, passes: int = 1) -> np.ndarray:
    """This rank's rows: micro-batch m of update u is block (u * passes + m) * size + rank of PER_RANK rows."""
    blocks = [(u * passes + m) * hvd.size() + hvd.rank() for u in range(STEPS) for m in range(passes)]
    return np.concatenate([np.arange(b * PER_RANK, (b + 1) * PER_RANK) for b in blocks])


def fit_zero(hvd, make_optimizer=adam, run_eagerly: bool = False, **kwargs) -> keras.Model:
    model = make_model()  # the same start on every rank
    model.compile(optimizer=ZeroOptimizer(make_optimizer(), **kwargs), loss="mse", run_eagerly=run_eagerly)
    x, y = data(STEPS * hvd.size() * PER_RANK)
    rows = rank_rows(hvd)
    model.fit(x[rows], y[rows], batch_size=PER_RANK, shuffle=False, verbose=0)
    return model


def assert_weights(model: keras.Model, want: list[np.ndarray], **tolerance) -> None:
    assert len(model.get_weights()) == len(want)
    for got, expected in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, expected, **(tolerance or EXACT))


def sharded_sizes(optimizer) -> int:
    """Elements of the optimizer's own variables, leaving out the scalars (iterations, learning rate)."""
    return sum(int(np.prod(v.shape)) for v in optimizer.variables if len(v.shape) > 0)


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["tf.function", "eager"])
def test_fit_with_adam_matches_single_process(hvd, run_eagerly):
    model = fit_zero(hvd, run_eagerly=run_eagerly)
    assert isinstance(model.optimizer, keras.optimizers.Adam) and int(model.optimizer.iterations) == STEPS
    assert_weights(model, reference(hvd.size(), adam)[0])
    everyone = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert all(weights == everyone[0] for weights in everyone)  # the allgather gives every rank the same bits


@pytest.mark.parametrize("make_optimizer,passes", [(adam, 1), (sgd, 2)], ids=["adam", "sgd-momentum-2-passes"])
@pytest.mark.parametrize("compiled", [True, False], ids=["tf.function", "eager"])
def test_custom_loop_matches_single_process(hvd, make_optimizer, passes, compiled):
    # With backward_passes_per_step, `iterations` counts every call (as DistributedOptimizer's accumulation
    # does), so an optimizer whose update reads the step count (Adam's bias correction) differs from plain
    # large-batch training there; momentum SGD does not read it.
    import tensorflow as tf

    model = make_model()
    optimizer = ZeroOptimizer(make_optimizer(), backward_passes_per_step=passes)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    step = tf.function(step) if compiled else step
    x, y = data(STEPS * hvd.size() * passes * PER_RANK)
    for batch in rank_rows(hvd, passes).reshape(-1, PER_RANK):
        step(x[batch], y[batch])
    assert int(optimizer.iterations) == STEPS * passes
    assert_weights(model, reference(hvd.size(), make_optimizer, passes)[0])


def loop_reference(make_model_fn, make_optimizer, batches) -> list[np.ndarray]:
    """Plain Keras custom loop in one process over the given (x, y) batches."""
    import tensorflow as tf

    model, optimizer = make_model_fn(), make_optimizer()
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return model.get_weights()


def mixed_model() -> keras.Model:
    # a float64 layer (4*8 + 8 = 40 elements) and a float32 one (8*2 + 2 = 18): two flat sequences, cut separately
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh", dtype="float64"), keras.layers.Dense(2)]
    )


def test_variables_of_two_dtypes_are_sharded_per_dtype(hvd):
    import tensorflow as tf

    model = mixed_model()
    optimizer = ZeroOptimizer(adam())
    x, y = data(STEPS * hvd.size() * PER_RANK)
    for batch in rank_rows(hvd).reshape(-1, PER_RANK):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y[batch], model(x[batch]))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    shards = {str(v.dtype): int(np.prod(v.shape)) for v in optimizer.sharded_variables[-2:]}
    assert sum(hvd.allgather_object(shards["float64"])) == 40 and sum(hvd.allgather_object(shards["float32"])) == 18
    rows = hvd.size() * PER_RANK
    want = loop_reference(mixed_model, adam, [(x[s : s + rows], y[s : s + rows]) for s in range(0, len(x), rows)])
    assert_weights(model, want)


def test_a_rank_may_own_nothing(hvd):
    """Two elements on three ranks: the last rank's shard is empty, and the step still matches plain Adam."""
    variable = keras.Variable(np.array([1.0, -2.0], np.float32))
    optimizer = ZeroOptimizer(adam())
    plain_variable = keras.Variable(np.array([1.0, -2.0], np.float32))
    plain = adam()
    mean = np.mean(np.arange(1, hvd.size() + 1, dtype=np.float32))
    for step in range(STEPS):
        optimizer.apply([np.full(2, (hvd.rank() + 1) * (step - 1.5), np.float32)], [variable])
        plain.apply([np.full(2, mean * (step - 1.5), np.float32)], [plain_variable])
    np.testing.assert_allclose(variable.numpy(), plain_variable.numpy(), **EXACT)
    assert sum(hvd.allgather_object(sharded_sizes(optimizer))) == 2 * 2


def test_process_set(hvd):
    """Ranks 1..size-1 train together (rank 0 stays out): as one process on their combined batches."""
    import tensorflow as tf

    members = hvd.add_process_set(list(range(1, hvd.size()))) if hvd.size() > 1 else hvd.global_process_set
    try:
        if not members.included():
            return
        model = make_model()
        optimizer = ZeroOptimizer(adam(), process_set=members, name="ZeroSubset")
        x, y = data(STEPS * members.size() * PER_RANK)
        blocks = [u * members.size() + members.rank() for u in range(STEPS)]
        for block in blocks:
            batch = slice(block * PER_RANK, (block + 1) * PER_RANK)
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y[batch], model(x[batch]))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        assert_weights(model, reference(members.size(), adam)[0])
    finally:
        if members is not hvd.global_process_set:
            hvd.remove_process_set(members)


def test_slots_hold_only_this_ranks_shard(hvd):
    model = make_model()
    optimizer = ZeroOptimizer(adam())
    optimizer.build(model.trainable_variables)
    total = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    counts = [
        math.ceil(total / hvd.size()) if r < total % hvd.size() else total // hvd.size() for r in range(hvd.size())
    ]
    assert sharded_sizes(optimizer) == 2 * counts[hvd.rank()] <= 2 * math.ceil(total / hvd.size())
    assert sum(hvd.allgather_object(sharded_sizes(optimizer))) == 2 * total  # every element has one owner
    assert len(optimizer.replicated_variables) == 2 and all(len(v.shape) == 0 for v in optimizer.replicated_variables)
    plain = adam()
    plain.build(model.trainable_variables)
    assert sharded_sizes(plain) == 2 * total
    if hvd.size() > 1:
        assert sharded_sizes(optimizer) < sharded_sizes(plain)


def test_save_reloads_with_plain_keras_with_and_without_consolidation(hvd, tmp_path_factory):
    model = fit_zero(hvd, run_eagerly=True)
    _, want = reference(hvd.size(), adam)
    directory = tmp_path_factory.mktemp(f"zero{hvd.rank()}")
    if hvd.rank() == 0:  # without consolidation: the weights and the shared scalars, a fresh optimizer state
        model.save(str(directory / "plain.keras"))
        config = json.loads(zipfile.ZipFile(directory / "plain.keras").read("config.json").decode())
        assert "hvdplus" not in json.dumps(config)
        assert config["compile_config"]["optimizer"]["class_name"] == "Adam"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            loaded = keras.models.load_model(str(directory / "plain.keras"))
        assert type(loaded.optimizer) is keras.optimizers.Adam
        assert_weights(loaded, model.get_weights(), rtol=0, atol=0)
    state = model.optimizer.consolidated_variables(to=0)  # collective
    assert (state is None) == (hvd.rank() != 0)
    if hvd.rank() == 0:  # the full state in the plain layout: equal to single-process Adam's
        assert len(state) == len(want)
        for got, expected in zip(state, want):
            np.testing.assert_allclose(got, expected, **EXACT)
        model.save(str(directory / "full.keras"))
        loaded = keras.models.load_model(str(directory / "full.keras"))
        assert type(loaded.optimizer) is keras.optimizers.Adam
        assert len(loaded.optimizer.variables) == len(want)
        for got, expected in zip(loaded.optimizer.variables, want):
            np.testing.assert_allclose(got.numpy(), expected, **EXACT)
        loaded.save_weights(str(directory / "full.weights.h5"))
    path = hvd.broadcast_object(str(directory / "full.weights.h5"), 0)
    # every rank reloads the full state into a fresh ZeroOptimizer, takes its shard, and trains on as before
    resumed = make_model()
    resumed.compile(optimizer=ZeroOptimizer(adam()), loss="mse")
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    assert int(resumed.optimizer.iterations) == STEPS
    for mine, theirs in zip(resumed.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    # and wrapping the plain optimizer of a loaded model keeps its state the same way
    plain = keras.models.load_model(path.replace(".weights.h5", ".keras"))
    wrapped = ZeroOptimizer(plain.optimizer)
    assert int(wrapped.iterations) == STEPS
    for mine, theirs in zip(wrapped.variables, model.optimizer.variables):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.parametrize("how", ["shape", "count"])
def test_mismatched_models_raise_on_every_rank(hvd, how):
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    import tensorflow as tf

    first = hvd.rank() == 0
    model = make_model(units=9 if first and how == "shape" else 8, extra=first and how == "count")
    optimizer = ZeroOptimizer(adam())
    x, y = data(PER_RANK)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(CollectiveMismatchError, match=r"trainable variable \d+ \('.*(kernel|bias)'\) differs"):
        optimizer.apply(grads, model.trainable_variables)
    assert hvd.allgather_object("still usable") == ["still usable"] * hvd.size()


def test_bf16_compression_is_close_to_single_process(hvd):
    model = fit_zero(hvd, run_eagerly=True, compression=Compression.bf16)
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3) on the averaged gradient shards; Adam's
    # update is ~lr * m / sqrt(v), so a relative error of a few 1e-3 in the gradients moves 3 steps of lr 0.01 by
    # ~1e-4 (measured: 1.2e-4 at most on 2 ranks, and not 0, so bf16 really was on the wire): atol 1e-3 + rtol
    # 1e-3 leaves a margin of about eight.
    assert_weights(model, reference(hvd.size(), adam)[0], rtol=1e-3, atol=1e-3)
