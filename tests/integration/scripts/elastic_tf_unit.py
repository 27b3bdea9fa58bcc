"""One-process checks of hvd.elastic for TensorFlow and Keras: commits, restores, syncs and the Keras callbacks.

Run as a one-rank Gloo job (HOROVOD_RANK=0, HOROVOD_SIZE=1, HVDPLUS_RENDEZVOUS_FILE). Prints one JSON line per
check: {"check": name, "error": None or the traceback}.
"""

import json
import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdplus.keras as hvd_keras  # noqa: E402
import hvdplus.tensorflow as hvd  # noqa: E402
from hvdplus.common.exceptions import HorovodInternalError  # noqa: E402

CHECKS = []


def check(func):
    CHECKS.append(func)
    return func


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def assert_equal(actual, expected):
    assert len(actual) == len(expected), (len(actual), len(expected))
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def dense_model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


DATA = (np.arange(32, dtype=np.float32).reshape(8, 4) / 32, np.ones((8, 1), np.float32))


@check
def tensorflow_state_restores_the_commit_into_reused_arrays():
    w, b = tf.Variable([[1.0, 2.0], [3.0, 4.0]]), tf.Variable([0.5], dtype=tf.float64)
    state = hvd.elastic.TensorFlowState([w, b], step=0)
    w.assign_add(tf.ones_like(w))
    state.step = 1
    state.commit()
    arrays = list(state._handlers["variables"]._arrays)
    committed = values([w, b])
    w.assign(tf.zeros_like(w))
    b.assign([7.0])
    state.step = 5
    state.commit()
    assert all(new is old for new, old in zip(state._handlers["variables"]._arrays, arrays)), "reallocated"
    w.assign_add(tf.ones_like(w))
    state.restore()
    assert_equal(values([w, b]), [np.zeros((2, 2), np.float32), np.array([7.0])])
    assert state.step == 5
    w.assign(committed[0])
    b.assign(committed[1])
    state.commit()
    state.restore()
    assert_equal(values([w, b]), committed)


@check
def tensorflow_state_keeps_keras_variables_too():
    model = dense_model(keras.optimizers.SGD(0.1))
    state = hvd.elastic.TensorFlowState(model.trainable_variables)
    committed = values(model.trainable_variables)
    model.fit(*DATA, batch_size=8, epochs=1, verbose=0)
    state.restore()
    assert_equal(values(model.trainable_variables), committed)


@check
def tensorflow_state_sync_keeps_rank_0s_values_and_commits_them():
    w = tf.Variable([1.0, 2.0])
    state = hvd.elastic.TensorFlowState([w], epoch=3)
    w.assign([5.0, 6.0])
    state.sync()
    w.assign([0.0, 0.0])
    state.restore()
    assert_equal(values([w]), [np.array([5.0, 6.0], np.float32)])
    assert state.epoch == 3


@check
def tensorflow_state_in_a_graph_uses_the_session():
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0, 2.0]), use_resource=True)
        session.run(tf.compat.v1.global_variables_initializer())
        state = hvd.elastic.TensorFlowState(session=session, step=0)  # default: the global variables
        assert state.variables == [w]
        session.run(w.assign([3.0, 4.0]))
        state.commit()
        session.run(w.assign([0.0, 0.0]))
        state.restore()
        assert session.run(w).tolist() == [3.0, 4.0]
        state.sync()
        assert session.run(w).tolist() == [3.0, 4.0]


@check
def tensorflow_state_in_a_graph_needs_a_session():
    with tf.Graph().as_default():
        tf.compat.v1.get_variable("w", initializer=tf.constant([1.0]), use_resource=True)
        try:
            hvd.elastic.TensorFlowState()
        except ValueError as exc:
            assert "needs a session" in str(exc), exc
        else:
            raise AssertionError("no ValueError")


@check
def keras_state_builds_the_optimizer_and_restores_weights_and_slots():
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model = dense_model(optimizer)
    assert not optimizer.built
    state = hvd_keras.elastic.KerasState(model, epoch=0, batch=0)
    assert optimizer.built and len(state._handlers["optimizer"]._arrays) == len(optimizer.variables) == 6
    model.fit(*DATA, batch_size=8, epochs=2, verbose=0)
    state.commit()
    committed = values(model.variables) + values(optimizer.variables)
    assert int(optimizer.iterations.numpy()) == 2
    model.fit(*DATA, batch_size=8, epochs=3, verbose=0)
    state.restore()
    assert_equal(values(model.variables) + values(optimizer.variables), committed)


@check
def keras_state_reset_empties_a_distributed_optimizers_gradient_accumulation():
    """Each rank's partial sums cannot be given to a new worker: after a reset every rank starts a new window."""
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    model = dense_model(optimizer)
    state = hvd_keras.elastic.KerasState(model)
    model.fit(*DATA, batch_size=8, epochs=1, verbose=0)  # one pass of two: the gradient waits in accumulators
    assert any(a.any() for a in values(optimizer._hvd_accumulators))
    state.on_reset()
    assert not any(a.any() for a in values(optimizer._hvd_accumulators)) and int(optimizer._hvd_calls.numpy()) == 0
    assert model.train_function is not None


@check
def keras_state_refuses_an_unbuilt_model_no_optimizer_or_a_zero_optimizer():
    built = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    for model, optimizer, error, words in [
        (keras.Sequential([keras.layers.Dense(1)]), keras.optimizers.SGD(), ValueError, "Model must be built"),
        (built, None, ValueError, "needs an optimizer"),
        (built, hvd_keras.ZeroOptimizer(keras.optimizers.SGD(0.1)), TypeError, "cannot keep a ZeroOptimizer"),
    ]:
        try:
            hvd.elastic.TensorFlowKerasState(model, optimizer)
        except error as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"no {error.__name__} for {words!r}")


@check
def run_restores_the_commit_after_a_collective_failed_in_a_graph():
    w = tf.Variable([1.0])
    state = hvd.elastic.TensorFlowState([w], attempts=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(float(w.numpy()[0]))
        w.assign([2.0])
        if len(calls) == 1:  # what a tf.function reports when a peer dies in its allreduce
            raise tf.errors.UnknownError(
                None,
                None,
                "Graph execution error:\n\nDetected at node HorovodWait ...\n"
                "hvdplus.tensorflow._graph.HorovodInternalError: collective failed\n"
                "\t [[{{node DistributedOptimizer/HorovodWait_3}}]] [Op:__inference_f]",
            )
        return "done"

    assert train(state) == "done" and calls == [1.0, 1.0], calls
    assert hvd.is_initialized() and hvd.size() == 1


@check
def run_lets_other_tensorflow_errors_through():
    @hvd.elastic.run
    def train(state):
        raise tf.errors.InvalidArgumentError(None, None, "bad shape\n\t [[{{node MatMul}}]]")

    try:
        train(hvd.elastic.ObjectState(step=0))
    except tf.errors.InvalidArgumentError as exc:
        assert not isinstance(exc, HorovodInternalError)
    else:
        raise AssertionError("no InvalidArgumentError")


def fit_with_callbacks(state, steps, **fit_args):
    """model.fit on the same batch every step with the three elastic callbacks and a recorder; returns the
    (fit's epoch, state.batch) of each committed batch and state.epoch after each epoch."""
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((self._epoch, state.batch))

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            seen.append(("end", state.epoch))

    callbacks = [
        hvd_keras.elastic.UpdateEpochStateCallback(state),
        hvd_keras.elastic.UpdateBatchStateCallback(state),
        hvd_keras.elastic.CommitStateCallback(state),
        Record(),
    ]
    data = tf.data.Dataset.from_tensors(DATA).repeat()
    state.model.fit(data, steps_per_epoch=steps, callbacks=callbacks, verbose=0, shuffle=False, **fit_args)
    return seen


@check
def callbacks_resume_an_epoch_at_its_batch_with_initial_epoch():
    """A state committed at epoch 1 after 3 of 5 batches: fit(initial_epoch=state.epoch) runs the 2 batches left
    of epoch 1, then epoch 2 in full; fit's epochs are the job's."""
    model = dense_model(keras.optimizers.SGD(0.01))
    state = hvd_keras.elastic.KerasState(model, epoch=1, batch=3)
    seen = fit_with_callbacks(state, 5, initial_epoch=state.epoch, epochs=3)
    assert seen == [(1, 4), (1, 5), ("end", 2)] + [(2, b) for b in range(1, 6)] + [("end", 3)], seen
    assert int(model.optimizer.iterations.numpy()) == 7 and state.batch == 0 and state.epoch == 3


@check
def callbacks_count_epochs_when_fit_starts_at_zero():
    """Horovod's way, fit(epochs=epochs - state.epoch): fit numbers from 0, state.epoch still counts the job's."""
    model = dense_model(keras.optimizers.SGD(0.01))
    state = hvd_keras.elastic.KerasState(model, epoch=2, batch=0)
    seen = fit_with_callbacks(state, 2, epochs=4 - state.epoch)
    assert seen == [(0, 1), (0, 2), ("end", 3), (1, 1), (1, 2), ("end", 4)], seen


@check
def commit_state_callback_commits_every_few_batches_and_at_epoch_ends():
    model = dense_model(keras.optimizers.SGD(0.01))
    state = hvd_keras.elastic.KerasState(model, batch=0)
    commits = []
    state.check_host_updates = lambda: commits.append(int(model.optimizer.iterations.numpy()))
    model.fit(
        tf.data.Dataset.from_tensors(DATA).repeat(),
        steps_per_epoch=5,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2)],
    )
    assert commits == [2, 4, 5], commits
    try:
        hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=0)
    except ValueError as exc:
        assert "batches_per_commit must be a positive int, got 0" in str(exc)
    else:
        raise AssertionError("no ValueError")


def main():
    hvd.init()
    for func in CHECKS:
        try:
            func()
            error = None
        except BaseException:  # noqa: B902 - every failure is reported, the checks go on
            error = traceback.format_exc()
        print(json.dumps({"check": func.__name__, "error": error}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
