"""Horovod's TensorFlow 2 synthetic benchmark on hvdplus: training throughput on random images, per rank and total.

    mpirun -np 2 --oversubscribe python examples/tensorflow2_synthetic_benchmark.py
    mpirun -np 2 --oversubscribe python examples/tensorflow2_synthetic_benchmark.py --fp16-allreduce --model ResNet50

The default model is a small built-in CNN; --model takes any keras.applications model name (untrained weights).
"""

from __future__ import annotations

import argparse
import timeit

import keras
import numpy as np
import tensorflow as tf

import hvdplus.tensorflow as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--model", default="small_cnn", help="small_cnn, or a keras.applications model name")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--image-size", type=int, default=32, help="height and width of the random images")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches")
    parser.add_argument(
        "--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration"
    )
    parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    parser.add_argument(
        "--eager", action="store_true", help="run the training step eagerly instead of as a tf.function"
    )
    return parser.parse_args()


def make_model(name: str, image_size: int) -> keras.Model:
    if name == "small_cnn":
        layers = [keras.Input((image_size, image_size, 3))]
        for width in (32, 64, 128):
            layers += [
                keras.layers.Conv2D(width, 3, padding="same", use_bias=False),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.MaxPooling2D(),
            ]
        return keras.Sequential(layers + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1000)])
    if not hasattr(keras.applications, name):
        raise SystemExit(f"unknown --model {name}: use small_cnn or a keras.applications name such as ResNet50")
    return getattr(keras.applications, name)(weights=None, input_shape=(image_size, image_size, 3))


def log(text: str, is_root: bool) -> None:
    if is_root:
        print(text, flush=True)


def main() -> None:
    args = parse_args()
    hvd.init()
    root, ranks = hvd.rank() == 0, hvd.size()
    model = make_model(args.model, args.image_size)
    optimizer = keras.optimizers.SGD(0.01 * ranks)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], minval=0, maxval=999, dtype=tf.int64)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    benchmark_step = step if args.eager else tf.function(step)
    log(f"Model: {args.model}", root)
    log(f"Batch size: {args.batch_size}", root)
    log(f"Number of CPUs: {ranks}", root)
    log("Running warmup...", root)
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...", root)
    img_secs = []
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {img_sec:.1f} img/sec per CPU", root)
        img_secs.append(img_sec)
    mean, confidence = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {mean:.1f} +-{confidence:.1f}", root)
    log(f"Total img/sec on {ranks} CPU(s): {ranks * mean:.1f} +-{ranks * confidence:.1f}", root)
    hvd.shutdown()


if __name__ == "__main__":
    main()
