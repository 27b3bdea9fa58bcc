"""Train a small CNN on scikit-learn's handwritten digits with hvdplus.keras and model.fit (Horovod's recipe).

Each rank fits on its shard of the data; gradients are averaged by hvd.DistributedOptimizer (fp16 on the
wire with --fp16, local accumulation with --batches-per-allreduce); the callbacks broadcast rank 0's
initial weights, average the epoch metrics and warm the learning rate up; rank 0 shows a progress bar with
the accuracy and throughput of every epoch and keeps the best model in --checkpoint (a plain .keras file). Run it
with any launcher:

    hvdplusrun -np 2 python examples/keras_train.py --epochs 5
    mpirun -np 2 --oversubscribe python examples/keras_train.py --epochs 5
    python examples/keras_train.py            # one process, no launcher

One process with --batch-size 64 --lr 0.04 trains with the global batch and learning rate of 2 ranks with the
defaults (32 samples per rank, 0.02 scaled by 2). --summary-json PATH writes the final accuracy and images/s as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hvdplus.keras as hvd  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and backward pass")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank (scaled by the ranks)")
    parser.add_argument("--fp16", action="store_true", help="compress gradients to float16 for the allreduce")
    parser.add_argument(
        "--batches-per-allreduce", type=int, default=1, help="backward passes accumulated locally per allreduce"
    )
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--checkpoint", default="./checkpoints/best.keras", help="best model, written by rank 0")
    parser.add_argument(
        "--summary-json",
        metavar="PATH",
        help="rank 0 writes the final test accuracy and the training images/s (all ranks together) here as JSON",
    )
    return parser.parse_args()


def load_data() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The 1797 8x8 digits scaled to [0, 1], in a fixed random order: 1500 to train, the rest to test."""
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    images = (digits.images[order, :, :, None] / 16.0).astype(np.float32)
    labels = digits.target[order].astype(np.int64)
    return (images[:1500], labels[:1500]), (images[1500:], labels[1500:])


def make_model() -> keras.Model:
    """Two 3x3 convolutions and a linear classifier for 8x8 digits."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


class Throughput(keras.callbacks.Callback):
    """Adds images/s (all ranks together: each epoch trains on the whole training set once) to the epoch's logs.

    An epoch's time runs from its start to its last training batch, leaving out the validation after it."""

    def __init__(self, images_per_epoch: int) -> None:
        super().__init__()
        self.images_per_epoch = images_per_epoch
        self.seconds: list[float] = []  # of each epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.began = self.last_batch = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.last_batch = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self.last_batch - self.began)
        if logs is not None:
            logs["images/s"] = self.images_per_epoch / self.seconds[-1]

    def images_per_second(self) -> float:
        """Over the epochs after the first (which traces the training step), or the first if it is the only one."""
        steady = self.seconds[1:] or self.seconds
        return self.images_per_epoch * len(steady) / sum(steady)


def main() -> None:
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(42 + hvd.rank())  # different starts: the broadcast callback aligns them
    (x_train, y_train), (x_test, y_test) = load_data()
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shard(hvd.size(), hvd.rank())
        .shuffle(1500, seed=hvd.rank())
        .batch(args.batch_size)
    )

    scaled_lr = args.lr * hvd.size()
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(scaled_lr, momentum=0.9),
        compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none,
        backward_passes_per_step=args.batches_per_allreduce,
        average_aggregated_gradients=True,
    )
    model = make_model()
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=scaled_lr,
            warmup_epochs=args.warmup_epochs,
            momentum_correction=False,
            verbose=1 if hvd.rank() == 0 else 0,
        ),
    ]
    if hvd.rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_accuracy", mode="max", filepath=args.checkpoint))
    throughput = Throughput(len(x_train))
    callbacks.append(throughput)  # after MetricAverageCallback: the ranks step together, no average needed
    model.fit(
        train,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        callbacks=callbacks,
        shuffle=False,  # the dataset shuffles itself (Keras warns that it ignores shuffle=True for a tf.data.Dataset)
        verbose=1 if hvd.rank() == 0 else 0,
    )

    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    accuracy = float(hvd.allreduce(accuracy, name="final_accuracy"))  # identical models: the same on every rank
    if hvd.rank() == 0:
        print(f"Final test accuracy: {accuracy:.3f} ({hvd.size()} rank{'s' if hvd.size() > 1 else ''})")
        best = keras.models.load_model(args.checkpoint)  # a plain Keras file: no hvdplus needed to load it
        print(f"Best checkpoint {args.checkpoint}: test accuracy {best.evaluate(x_test, y_test, verbose=0)[1]:.3f}")
        if args.summary_json:
            summary = {
                "example": "keras_train",
                "ranks": hvd.size(),
                "global_batch_size": args.batch_size * args.batches_per_allreduce * hvd.size(),
                "learning_rate": scaled_lr,
                "epochs": args.epochs,
                "test_accuracy": accuracy,
                "images_per_second": throughput.images_per_second(),
                "train_seconds": sum(throughput.seconds),
            }
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=2)
    hvd.shutdown()


if __name__ == "__main__":
    main()
