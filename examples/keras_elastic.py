"""Train keras_train.py's CNN on scikit-learn's digits elastically: the job goes on while workers fail or join.

The model, its optimizer and the epoch and batch reached live in an hvd.elastic.KerasState, committed every
--batches-per-commit batches by the elastic callbacks. When a worker dies, the others go back to the last commit
and go on with fewer workers; when hosts are added (with --host-discovery-script), the new workers receive the
state at the next commit. After each change, fit resumes at the epoch and batch reached, on the data resharded
over the new number of workers, with the learning rate rescaled to it. Run it with hvdplusrun's elastic mode:

    hvdplusrun -np 2 --min-np 1 -H localhost:1,127.0.0.1:1 python examples/keras_elastic.py
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras_train import load_data, make_model  # noqa: E402

import hvdplus.keras as hvd  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker and step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one worker (scaled by the workers)")
    parser.add_argument("--batches-per-commit", type=int, default=5, help="batches between two commits")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(42)
    (x_train, y_train), (x_test, y_test) = load_data()
    model = make_model()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)

    def on_state_reset() -> None:
        model.optimizer.learning_rate = args.lr * hvd.size()

    state.register_reset_callbacks([on_state_reset])
    callbacks = [
        hvd.callbacks.MetricAverageCallback(),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        # The same shuffle on every worker, dealt over the workers of this generation.
        data = (
            tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(len(x_train), seed=0)
            .repeat()
            .shard(hvd.size(), hvd.rank())
            .batch(args.batch_size)
        )
        steps = math.ceil(len(x_train) / (args.batch_size * hvd.size()))
        state.model.fit(
            data,
            steps_per_epoch=steps,
            epochs=args.epochs,
            initial_epoch=state.epoch,
            validation_data=(x_test, y_test),
            callbacks=callbacks,
            shuffle=False,
            verbose=2 if hvd.rank() == 0 else 0,
        )

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"Final test accuracy: {accuracy:.3f} (workers at the end: {hvd.size()})")


if __name__ == "__main__":
    main()
