"""Train a small CNN on scikit-learn's digits with a custom TensorFlow 2 loop and hvd.DistributedGradientTape.

The training step is a tf.function; the tape's gradients are averaged over the ranks inside it. Every rank
starts from rank 0's weights and optimizer state (hvd.broadcast_variables); rank 0 prints the progress.

    mpirun -np 2 --oversubscribe python examples/tensorflow2_train.py --epochs 5
    python examples/tensorflow2_train.py            # one process, no launcher
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvdplus.tensorflow as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank (scaled by the ranks)")
    parser.add_argument("--fp16", action="store_true", help="compress gradients to float16 for the allreduce")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different initial weights: the broadcast fixes them
    digits = load_digits()
    images, labels = (digits.images[..., None] / 16.0).astype(np.float32), digits.target
    split = len(images) * 4 // 5
    train = (
        tf.data.Dataset.from_tensor_slices((images[:split], labels[:split]))
        .shard(hvd.size(), hvd.rank())
        .shuffle(split, seed=args.seed)
        .batch(args.batch_size)
    )
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    for epoch in range(1, args.epochs + 1):
        losses = [float(train_step(x, y)) for x, y in train]
        mean_loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name=f"epoch_loss.{epoch}"))
        if hvd.rank() == 0:
            print(f"Epoch {epoch}: loss {mean_loss:.4f}")
    logits = model(images[split:], training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == labels[split:]))
    if hvd.rank() == 0:
        print(f"Final test accuracy: {accuracy:.3f} ({hvd.size()} ranks)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
