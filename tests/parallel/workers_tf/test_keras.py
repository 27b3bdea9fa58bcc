"""hvdplus.keras: DistributedOptimizer in model.fit against single-process training, callbacks, save and reload.

Written to pass at any world size; run by tests/parallel/test_tf_jobs.py on 2 and 3 ranks."""

from __future__ import annotations

import json
import zipfile

import keras
import numpy as np
import pytest

import hvdplus.keras as hvd_keras

STEPS = 3
PER_RANK = 4
# See test_tf_training.py: float32 summation order only, a few momentum-SGD steps.
EXACT = {"rtol": 1e-5, "atol": 1e-6}


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def data(samples: int) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(1234)
    return (
        generator.normal(size=(samples, 4)).astype(np.float32),
        generator.normal(size=(samples, 2)).astype(np.float32),
    )


def reference_weights(size: int, passes: int) -> list[np.ndarray]:
    """Plain Keras, one process: STEPS updates on batches of size * passes * PER_RANK samples."""
    model = make_model(seed=0)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    x, y = data(STEPS * size * passes * PER_RANK)
    model.fit(x, y, batch_size=size * passes * PER_RANK, shuffle=False, verbose=0)
    return model.get_weights()


def rank_rows(hvd, passes: int) -> np.ndarray:
    """This rank's rows: micro-batch m of update u is block (u * passes + m) * size + rank of PER_RANK rows."""
    blocks = [(u * passes + m) * hvd.size() + hvd.rank() for u in range(STEPS) for m in range(passes)]
    return np.concatenate([np.arange(b * PER_RANK, (b + 1) * PER_RANK) for b in blocks])


def fit_distributed(hvd, passes: int = 1, run_eagerly: bool = False, callbacks=(), **kwargs) -> keras.Model:
    model = make_model(seed=hvd.rank())  # different start on each rank: the broadcast callback must fix it
    optimizer = hvd_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=passes, **kwargs
    )
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    x, y = data(STEPS * hvd.size() * passes * PER_RANK)
    rows = rank_rows(hvd, passes)
    model.fit(
        x[rows],
        y[rows],
        batch_size=PER_RANK,
        shuffle=False,
        verbose=0,
        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks],
    )
    return model


def test_fit_matches_single_process(hvd):
    model = fit_distributed(hvd)
    assert isinstance(model.optimizer, keras.optimizers.SGD) and int(model.optimizer.iterations) == STEPS
    for got, want in zip(model.get_weights(), reference_weights(hvd.size(), 1)):
        np.testing.assert_allclose(got, want, **EXACT)


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["tf.function", "eager"])
def test_backward_passes_per_step_matches_single_process(hvd, run_eagerly):
    model = fit_distributed(hvd, passes=2, run_eagerly=run_eagerly, average_aggregated_gradients=True)
    assert int(model.optimizer.iterations) == 2 * STEPS  # every batch counts, one update per two
    for got, want in zip(model.get_weights(), reference_weights(hvd.size(), 2)):
        np.testing.assert_allclose(got, want, **EXACT)


def test_two_accumulating_optimizers_in_one_tf_function_step(hvd):
    """Each optimizer's collectives get their own names (taken before the update's tf.cond, whose branch
    graph would number them afresh), and both models match single-process training."""
    import tensorflow as tf

    models = [make_model(seed=0), make_model(seed=0)]  # the same start on every rank: no broadcast needed
    optimizers = [
        hvd_keras.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2, average_aggregated_gradients=True
        )
        for _ in models
    ]
    for model, optimizer in zip(models, optimizers):
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        for model, optimizer in zip(models, optimizers):
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, model(x))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    x, y = data(STEPS * hvd.size() * 2 * PER_RANK)
    rows = rank_rows(hvd, 2).reshape(-1, PER_RANK)
    for batch in rows:
        step(x[batch], y[batch])
    want = reference_weights(hvd.size(), 2)
    for model in models:
        for got, expected in zip(model.get_weights(), want):
            np.testing.assert_allclose(got, expected, **EXACT)


def test_accumulation_counts_its_own_calls_when_wrapping_a_trained_optimizer(hvd):
    variable = keras.Variable(np.zeros(2, np.float32))
    plain = keras.optimizers.SGD(1.0)
    plain.build([variable])
    plain.iterations.assign(1)  # one step taken before wrapping
    optimizer = hvd_keras.DistributedOptimizer(plain, backward_passes_per_step=2)
    grad = np.ones(2, np.float32)
    optimizer.apply([grad], [variable])
    np.testing.assert_array_equal(variable.numpy(), [0.0, 0.0])  # first of two micro-batches: no update yet
    optimizer.apply([grad], [variable])
    np.testing.assert_array_equal(variable.numpy(), [-2.0, -2.0])  # lr 1 x (1 + 1), summed (not averaged)
    assert int(optimizer.iterations) == 3


def test_mixed_precision_wraps_the_loss_scale_optimizer_and_skips_overflow_on_every_rank(hvd):
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.warns(UserWarning, match="wrap the loss-scale optimizer"):
            hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model = make_model(seed=0)
        optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
        model.compile(optimizer=optimizer, loss="mse")
        assert model.optimizer is optimizer  # compile keeps it: it already is a LossScaleOptimizer
        x, y = data(2 * PER_RANK * hvd.size())
        model.fit(x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()], batch_size=PER_RANK, verbose=0)
        scale = float(optimizer.dynamic_scale)
        before = model.get_weights()
        grads = [tf.zeros_like(v) for v in model.trainable_variables]
        if hvd.rank() == 0:  # an overflow on one rank only: the reduced gradients overflow on every rank
            grads[0] = grads[0] + np.inf
        optimizer.apply(grads, model.trainable_variables)
        assert float(optimizer.dynamic_scale) == scale / 2
        for got, want in zip(model.get_weights(), before):
            np.testing.assert_array_equal(got, want)
        everyone = hvd_keras.allgather_object([w.tolist() for w in model.get_weights()])
        assert all(weights == everyone[0] for weights in everyone)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_fp16_compression_and_groups(hvd):
    model = fit_distributed(hvd, compression=hvd_keras.Compression.fp16, groups=2)
    # fp16 rounding of O(1) gradients (~5e-4 relative) over 3 steps of lr 0.1: within 1e-3
    for got, want in zip(model.get_weights(), reference_weights(hvd.size(), 1)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


class Recorder(keras.callbacks.Callback):
    """Keeps copies of the epoch-end logs and the learning rate at each batch."""

    def __init__(self):
        super().__init__()
        self.epochs, self.rates = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def test_metric_average_and_learning_rate_callbacks(hvd):
    before, after = Recorder(), Recorder()
    initial = 0.1 * hvd.size()
    callbacks = [
        before,
        hvd_keras.callbacks.MetricAverageCallback(),
        hvd_keras.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=1, momentum_correction=False),
        hvd_keras.callbacks.LearningRateScheduleCallback(initial, 0.5, start_epoch=1, momentum_correction=False),
        after,
    ]
    model = make_model(seed=hvd.rank())
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", metrics=["mae"])
    x, y = data(STEPS * PER_RANK)
    model.fit(x * (hvd.rank() + 1), y, batch_size=PER_RANK, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    everyone = hvd.allgather_object(before.epochs)
    for epoch in range(2):
        for key in ("loss", "mae"):
            assert after.epochs[epoch][key] == pytest.approx(np.mean([logs[epoch][key] for logs in everyone]))
    n = hvd.size()
    warmup = [initial / n * ((b + 1) / STEPS * (n - 1) + 1) for b in range(STEPS)]  # Horovod's formula, epoch 0
    np.testing.assert_allclose(after.rates, warmup + [initial * 0.5] * STEPS, rtol=1e-6)
    assert after.rates[STEPS - 1] == pytest.approx(initial)  # warmup ends at the full rate
    assert after.epochs[1]["learning_rate"] == pytest.approx(initial * 0.5)


def test_save_reload_without_and_with_hvdplus(hvd, tmp_path_factory):
    model = fit_distributed(hvd)
    path = str(tmp_path_factory.mktemp(f"rank{hvd.rank()}") / "model.keras")
    model.save(path)
    config = zipfile.ZipFile(path).read("config.json").decode()
    assert "hvdplus" not in config and json.loads(config)["compile_config"]["optimizer"]["class_name"] == "SGD"
    plain = keras.models.load_model(path)
    assert type(plain.optimizer) is keras.optimizers.SGD
    wrapped = hvd_keras.load_model(path)
    assert isinstance(wrapped.optimizer, keras.optimizers.SGD) and type(wrapped.optimizer) is not keras.optimizers.SGD
    assert int(wrapped.optimizer.iterations) == STEPS
    for mine, saved in zip(wrapped.optimizer.variables, plain.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(saved))
    x, y = data(PER_RANK)
    wrapped.fit(x, y * hvd.rank(), batch_size=PER_RANK, verbose=0)  # different data, same update on every rank
    everyone = hvd.allgather_object([w.tolist() for w in wrapped.get_weights()])
    assert all(weights == everyone[0] for weights in everyone)


def test_best_model_checkpoint_writes_on_rank_zero_only(hvd, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"best{hvd.rank()}") / "best.keras"
    x, y = data(STEPS * PER_RANK)
    model = make_model(seed=0)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(
        x,
        y,
        batch_size=PER_RANK,
        epochs=2,
        verbose=0,
        validation_data=(x, y),
        callbacks=[
            hvd_keras.callbacks.MetricAverageCallback(),
            hvd_keras.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=str(path)),
        ],
    )
    assert path.exists() == (hvd.rank() == 0)
    with pytest.raises(ValueError, match="filepath"):
        hvd_keras.callbacks.BestModelCheckpoint()


def test_partial_optimizer_and_broadcast_global_variables(hvd):
    model = make_model(seed=hvd.rank())
    local = model.layers[-1]
    hvd_keras.broadcast_global_variables(0, model)
    optimizer = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[local])
    model.compile(optimizer=optimizer, loss="mse")
    x, y = data(PER_RANK)
    model.fit(x, y * (hvd.rank() + 1), batch_size=PER_RANK, verbose=0)
    everyone = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    shared, local_weights = slice(0, 2), slice(2, 4)
    assert all(w[shared] == everyone[0][shared] for w in everyone)
    assert any(w[local_weights] != everyone[0][local_weights] for w in everyone)
    with pytest.raises(RuntimeError, match="pass the model|global variable"):
        hvd_keras.broadcast_global_variables(0)


def test_bad_optimizer_arguments(hvd):
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        hvd_keras.DistributedOptimizer(object())
    wrapped = hvd_keras.DistributedOptimizer(keras.optimizers.Adam())
    with pytest.raises(ValueError, match="only once"):
        hvd_keras.DistributedOptimizer(wrapped)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum, gradient_predivide_factor=2.0)


class Unbuilt(keras.Model):
    """A subclassed model: it has no variables until its first call."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_broadcast_callback_waits_for_a_model_that_builds_on_first_call(hvd):
    keras.utils.set_random_seed(hvd.rank())
    model = Unbuilt()
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data(2 * PER_RANK)
    model.fit(
        x,
        y,
        batch_size=PER_RANK,
        shuffle=False,
        verbose=0,
        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    everyone = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert all(weights == everyone[0] for weights in everyone)  # broadcast after batch 0, then equal updates


def test_value_collectives_return_numpy(hvd):
    total = hvd_keras.allreduce(np.array([hvd.rank(), 1.0]), name="keras.value.allreduce", op=hvd_keras.Sum)
    assert isinstance(total, np.ndarray) and total.tolist() == [sum(range(hvd.size())), hvd.size()]
    assert hvd_keras.allreduce([2.0], average=True, name="keras.value.average").tolist() == [2.0]
    assert hvd_keras.allgather(np.full((1, 2), hvd.rank()), name="keras.value.allgather")[:, 0].tolist() == list(
        range(hvd.size())
    )
    assert hvd_keras.broadcast(np.array([hvd.rank()]), 0, name="keras.value.broadcast").tolist() == [0]
