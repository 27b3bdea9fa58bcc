"""Benchmark Keras 3 training steps: hvdplus DistributedOptimizer vs tf.distribute.MultiWorkerMirroredStrategy.

The same Keras model (an MLP 784-1024-1024-10, 1.86 M parameters, or a small CNN on 32x32x3 images),
batch 32 per rank, SGD with momentum, on CPU, trained by the same tf.function step (tape gradient, then
optimizer.apply_gradients) in four modes:
    single        one process, plain Keras (no collectives): the step time without distribution
    mwms          tf.distribute.MultiWorkerMirroredStrategy, CPU, CommunicationImplementation.RING,
                  one worker process per rank, meeting through TF_CONFIG on localhost ports
    hvdplus       hvd.DistributedOptimizer over MPI (mpirun), one rank per process
    hvdplus_fp16  the same with compression=hvd.Compression.fp16

How it is timed: each mode runs as its own job, and the jobs of all modes are repeated --rounds times in
alternating order (ABCD, DCBA, ...) so that a slow spell of the shared machine does not land on one mode
only. In a job, each model runs --warmup untimed blocks of --steps steps, then --reps timed blocks; a block's
wall time on rank 0 (every step synchronizes the ranks) divided by --steps is one sample of the step time.
(A custom step rather than model.fit: Keras 3.15's fit fails under MultiWorkerMirroredStrategy on CPU here,
in its symbolic build and in its per-replica log reduction.)
Every mode sets TensorFlow to 1 intra-op and 2 inter-op threads
per process. Reported: median step time (and quartiles), throughput = batch x ranks / step time, and the
ratios hvdplus / mwms and hvdplus / single of the step times (lower is better for hvdplus).

    .venv/bin/python scripts/bench_training_keras.py                 # 2 ranks
    .venv/bin/python scripts/bench_training.py --framework keras --rounds 1 --models mlp

Rank 0 of each job writes its measurements; the driver prints the table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import training_bench as tb
from bench_collectives import child_env

MODES = ("single", "mwms", "hvdplus", "hvdplus_fp16")


# ============================================================================ worker
def keras_model(name: str) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    if name == "cnn":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def synthetic_batch(model_name: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One batch of BATCH (32) random samples (each rank its own)."""
    generator = np.random.default_rng(seed)
    shape = (tb.BATCH, 32, 32, 3) if model_name == "cnn" else (tb.BATCH, 784)
    return generator.normal(size=shape).astype(np.float32), generator.integers(0, 10, tb.BATCH)


def step_times(
    model: Any, optimizer: Any, batch: tuple[np.ndarray, np.ndarray], strategy: Any, args: argparse.Namespace
) -> list[float]:
    """Per-step times of --reps blocks of --steps training steps, after --warmup blocks.

    One step is the same tf.function in every mode: forward, tape gradient, optimizer.apply_gradients, run by
    `strategy` (the default one outside MWMS), with the loss read back so that every step has finished."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = tf.constant(batch[0]), tf.constant(batch[1])

    def replica_step() -> Any:
        with tf.GradientTape() as tape:
            # MWMS sums the replicas' gradients: scale the mean loss so that the update uses their average
            loss = loss_fn(y, model(x, training=True)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    train_step = tf.function(lambda: strategy.run(replica_step))

    def run(count: int) -> None:
        for _ in range(count):
            strategy.experimental_local_results(train_step())[0].numpy()

    run(args.warmup * args.steps)
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        run(args.steps)
        times.append((time.perf_counter() - start) / args.steps)
    return times


def worker(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time one mode for every model; return {model: step times} on rank 0, {} elsewhere."""
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    results: dict[str, list[float]] = {}
    if args.mode == "mwms":
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        for name in args.models.split(","):
            with strategy.scope():
                model = keras_model(name)
                optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
                optimizer.build(model.trainable_variables)
            results[name] = step_times(model, optimizer, synthetic_batch(name, rank), strategy, args)
        return results if rank == 0 else {}
    strategy = tf.distribute.get_strategy()
    if args.mode == "single":
        for name in args.models.split(","):
            model = keras_model(name)
            results[name] = step_times(
                model, keras.optimizers.SGD(0.01, momentum=0.9), synthetic_batch(name, 0), strategy, args
            )
        return results
    import hvdplus.keras as hvd
    from hvdplus.tensorflow import broadcast_variables

    hvd.init()
    compression = hvd.Compression.fp16 if args.mode == "hvdplus_fp16" else hvd.Compression.none
    for name in args.models.split(","):
        model = keras_model(name)
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9), compression=compression)
        optimizer.build(model.trainable_variables)
        broadcast_variables(model.variables + optimizer.variables, root_rank=0)
        results[name] = step_times(model, optimizer, synthetic_batch(name, hvd.rank()), strategy, args)
    rank = hvd.rank()
    hvd.shutdown()
    return results if rank == 0 else {}


# ============================================================================ driver
def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_job(args: argparse.Namespace, mode: str) -> dict[str, list[float]]:
    """One job of `mode`; rank 0's step times by model."""
    with tempfile.TemporaryDirectory(prefix="hvdplus-bench-keras-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        command = tb.worker_command(__file__, args, mode, result_file, ["--np", str(args.np)])
        base = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        if mode == "single":
            procs = [subprocess.Popen(command, env=child_env(base), start_new_session=True)]
        elif mode == "mwms":
            workers = [f"localhost:{port}" for port in free_ports(args.np)]
            procs = [
                subprocess.Popen(
                    command,
                    start_new_session=True,
                    env=child_env(
                        {
                            **base,
                            "TF_CONFIG": json.dumps(
                                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
                            ),
                        }
                    ),
                )
                for rank in range(args.np)
            ]
        else:
            procs = tb.start_mpi_job(args.np, command, base)
        return tb.finish_job(mode, procs, args.timeout, result_file)


def summarize(samples: tb.Samples, np_ranks: int) -> dict[str, Any]:
    """Median step time, quartiles, throughput, and hvdplus's ratios to mwms and single, per model."""
    summary: dict[str, Any] = {}
    for model in next(iter(samples.values())):
        rows = {mode: tb.row(samples[mode][model], 1 if mode == "single" else np_ranks) for mode in MODES}
        for mode in ("hvdplus", "hvdplus_fp16"):
            rows[mode]["step_time_vs_mwms"] = rows[mode]["step_time_s"] / rows["mwms"]["step_time_s"]
        for mode in ("mwms", "hvdplus", "hvdplus_fp16"):
            rows[mode]["step_time_vs_single"] = rows[mode]["step_time_s"] / rows["single"]["step_time_s"]
        summary[model] = rows
    return summary


def run_driver(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    samples = tb.collect(MODES, args.rounds, lambda mode: run_job(args, mode))
    summary = summarize(samples, args.np)
    tb.print_table(
        f"keras, {args.np} ranks, batch {tb.BATCH} per rank, tf.function step, CPU",
        summary,
        MODES,
        [("vs mwms", "step_time_vs_mwms"), ("vs single", "step_time_vs_single")],
    )
    print("(step-time ratios: below 1.0 means hvdplus steps faster)")
    tb.write_report(args, summary, samples, started)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return tb.parse(
        tb.parser(__doc__.splitlines()[0], "results/bench_training_keras.json", "untimed blocks per job and model", 1),
        argv,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tb.run_worker(args, worker) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
