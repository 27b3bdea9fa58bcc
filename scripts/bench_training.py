"""Benchmark data-parallel training steps: hvdplus DistributedOptimizer against the framework's own baseline.

PyTorch (--framework torch, the default): steady-state step time of a small CNN (two conv layers and two
linear layers, 1.07 M parameters, 32x32x3 images) and an MLP (784-1024-1024-10, 1.86 M parameters), batch
32 per rank, SGD with momentum, on CPU, for three modes:
    ddp           torch.nn.parallel.DistributedDataParallel over Gloo (no hvdplus in the process)
    hvdplus       hvd.DistributedOptimizer (engine from --engine: mpi or gloo)
    hvdplus_fp16  the same with compression=hvd.Compression.fp16

How it is timed: each mode runs as its own job (so no mode shares its CPU with another's background
threads), and the jobs of all modes are repeated --rounds times in alternating order (ABC, CBA, ...)
so that a slow spell of the shared machine does not land on one mode only. Every job runs with
THP_MEM_ALLOC_ENABLE=1, which hvdplus.torch sets on import, so the DDP baseline uses the same allocator. In a
job, each model warms up for --warmup steps, then --reps blocks of --steps steps are timed, each block after a
barrier; a block's time is the slowest rank's. Reported: median step time over all blocks of all rounds (and the
quartiles), throughput = batch x ranks / step time, and each mode's throughput ratio to the baseline.

    .venv/bin/python scripts/bench_training.py                 # 2 ranks, hvdplus over MPI
    .venv/bin/python scripts/bench_training.py --engine gloo --rounds 3

Rank 0 of each job writes its measurements; the driver prints the table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import training_bench as tb


@dataclass(frozen=True)
class Framework:
    """A framework's benchmark: its modes (the first is the baseline) and the worker that times one mode."""

    modes: tuple[str, ...]
    uses_hvdplus: Callable[[str], bool]
    worker: Callable[[argparse.Namespace], dict[str, list[float]]]


# ============================================================================ PyTorch worker
def torch_model(name: str) -> Any:
    import torch

    torch.manual_seed(0)
    if name == "cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(64 * 8 * 8, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def torch_worker(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time one mode's training steps for every model; return {model: block times} on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.mode == "ddp":
        rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.environ["HVDPLUS_RENDEZVOUS_FILE"], size), rank=rank, world_size=size
        )
        barrier = dist.barrier

        def slowest(times: np.ndarray) -> np.ndarray:
            tensor = torch.from_numpy(times)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            return tensor.numpy()
    else:
        import hvdplus.torch as hvd

        hvd.init()
        rank, size, barrier = hvd.rank(), hvd.size(), hvd.barrier

        def slowest(times: np.ndarray) -> np.ndarray:
            return hvd.allreduce(torch.from_numpy(times), op=hvd.Max, name=f"bench.max.{model_name}").numpy()

    results = {}
    for model_name in args.models.split(","):
        model = torch_model(model_name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if args.mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            compression = hvd.Compression.fp16 if args.mode == "hvdplus_fp16" else hvd.Compression.none
            optimizer = hvd.DistributedOptimizer(
                optimizer,
                compression=compression,
                named_parameters=[(f"{model_name}.{n}", p) for n, p in model.named_parameters()],
            )
        generator = torch.Generator().manual_seed(rank)
        shape = (tb.BATCH, 3, 32, 32) if model_name == "cnn" else (tb.BATCH, 784)
        x, y = torch.randn(shape, generator=generator), torch.randint(0, 10, (tb.BATCH,), generator=generator)

        def step(model=model, optimizer=optimizer, x=x, y=y) -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        results[model_name] = slowest(tb.timed_blocks(args, step, barrier)).tolist()
    if args.mode == "ddp":
        dist.destroy_process_group()
    else:
        hvd.shutdown()
    return results if rank == 0 else {}


FRAMEWORKS: dict[str, Framework] = {
    "torch": Framework(("ddp", "hvdplus", "hvdplus_fp16"), lambda mode: mode != "ddp", torch_worker),
}


# ============================================================================ driver
def run_job(args: argparse.Namespace, mode: str) -> dict[str, list[float]]:
    """One job of `mode` on --np ranks; rank 0's per-block step times by model."""
    with tempfile.TemporaryDirectory(prefix="hvdplus-bench-training-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        command = tb.worker_command(__file__, args, mode, result_file, ["--framework", args.framework])
        # Every mode on the same allocator: hvdplus.torch turns torch's huge pages on at import, so DDP gets them too.
        threads = {"OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1"}
        if FRAMEWORKS[args.framework].uses_hvdplus(mode) and args.engine == "mpi":
            procs = tb.start_mpi_job(args.np, command, threads)
        else:
            procs = tb.start_gloo_job(args.np, command, threads, workdir)
        return tb.finish_job(mode, procs, args.timeout, result_file)


def summarize(samples: tb.Samples, modes: tuple[str, ...], np_ranks: int) -> dict[str, Any]:
    """Per model and mode: median step time, quartiles, throughput and throughput ratio to the baseline."""
    summary: dict[str, Any] = {}
    for model in next(iter(samples.values())):
        rows = {mode: tb.row(samples[mode][model], np_ranks) for mode in modes}
        for mode in modes:
            rows[mode]["ratio_to_" + modes[0]] = rows[modes[0]]["step_time_s"] / rows[mode]["step_time_s"]
        summary[model] = rows
    return summary


def run_driver(args: argparse.Namespace) -> int:
    modes = FRAMEWORKS[args.framework].modes
    started = time.perf_counter()
    samples = tb.collect(modes, args.rounds, lambda mode: run_job(args, mode))
    summary = summarize(samples, modes, args.np)
    tb.print_table(
        f"{args.framework}, {args.np} ranks, batch {tb.BATCH} per rank, hvdplus engine {args.engine}",
        summary,
        modes,
        [("vs " + modes[0], "ratio_to_" + modes[0])],
    )
    tb.write_report(args, summary, samples, started)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tb.parser(__doc__.splitlines()[0], "results/bench_training.json", "untimed steps per job and model", 5)
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    parser.add_argument("--engine", choices=("mpi", "gloo"), default="mpi", help="hvdplus's engine")
    return tb.parse(parser, argv)


def main(argv: list[str] | None = None) -> int:
    framework = argparse.ArgumentParser(add_help=False)
    framework.add_argument("--framework")
    known, rest = framework.parse_known_args(argv)
    if known.framework == "keras":  # Keras vs MultiWorkerMirroredStrategy: its own launcher and modes
        from bench_training_keras import main as keras_main

        return keras_main(rest)
    args = parse_args(argv)
    return tb.run_worker(args, FRAMEWORKS[args.framework].worker) if args.worker else run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
