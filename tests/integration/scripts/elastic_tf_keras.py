"""An elastic Keras job for the tests: model.fit with KerasState and the three elastic callbacks, resumed with
`initial_epoch=state.epoch`. Every rank trains on the same batch at every step, so the averaged gradient does not
depend on the size: the final weights depend only on the number of optimizer steps (EPOCHS * STEPS).

Environment: EPOCHS (default 4), STEPS per epoch (default 6), KILL="<worker id>:<epoch>:<batch>" (the worker
SIGKILLs itself right after the commit of that batch, in its first life), GROW="<hosts file>:<epoch>:<batch>" (at
that batch of a one-worker job, add 127.0.0.1:1 to the discovery script's hosts file and wait for the job to grow).
Without hvdplusrun it runs as one process: the reference.
Prints one JSON line per batch about to be committed {"epoch": fit's epoch, "batch": state.batch, "rank", "size",
"worker"}, one per epoch end {"epoch_end": fit's epoch, "state_epoch"} and {"final": weights, "iterations", ...}.
"""

import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdplus.keras as hvd  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", "4"))
STEPS = int(os.environ.get("STEPS", "6"))
WORKER = os.environ.get("HVDPLUS_ELASTIC_WORKER", "single/0")
FIRST_LIFE = os.environ.get("HVDPLUS_ELASTIC_GENERATION", "0") == "0"
KILL = os.environ.get("KILL", "::").split(":")
GROW = os.environ.get("GROW", "").rsplit(":", 2)


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Report(keras.callbacks.Callback):
    """Prints each batch and epoch as the next commit will hold it (put before CommitStateCallback)."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.epoch = None

    def on_train_batch_end(self, batch, logs=None):
        say(epoch=self.epoch, batch=self.state.batch, rank=hvd.rank(), size=hvd.size(), worker=WORKER)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        say(epoch_end=epoch, state_epoch=self.state.epoch, rank=hvd.rank(), size=hvd.size(), worker=WORKER)


class Act(keras.callbacks.Callback):
    """After the commit of a batch: die, or grow the job, where the environment asks."""

    def __init__(self, state, report: Report) -> None:
        super().__init__()
        self.state = state
        self.report = report

    def on_train_batch_end(self, batch, logs=None):
        where = (self.report.epoch, self.state.batch)
        if FIRST_LIFE and [WORKER, str(where[0]), str(where[1])] == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if GROW[0] and hvd.size() == 1 and where == (int(GROW[1]), int(GROW[2])):
            with open(GROW[0], "a") as hosts:
                hosts.write("127.0.0.1:1\n")
            assert self.state.wait_for_host_updates(60), "the job did not grow"


def main() -> None:
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    inputs = np.arange(8 * 4, dtype=np.float32).reshape(8, 4) / 32
    data = tf.data.Dataset.from_tensors((inputs, np.ones((8, 1), np.float32))).repeat()
    report = Report(state)
    callbacks = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        report,
        hvd.elastic.CommitStateCallback(state),
        Act(state, report),
    ]

    @hvd.elastic.run
    def train(state):
        state.model.fit(
            data,
            steps_per_epoch=STEPS,
            epochs=EPOCHS,
            initial_epoch=state.epoch,
            callbacks=callbacks,
            shuffle=False,
            verbose=0,
        )

    train(state)
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    say(
        final=[float(w) for w in weights],
        iterations=int(model.optimizer.iterations.numpy()),
        rank=hvd.rank(),
        size=hvd.size(),
        worker=WORKER,
    )


if __name__ == "__main__":
    main()
