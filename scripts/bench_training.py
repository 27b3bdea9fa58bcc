"""Benchmark data-parallel training steps: hvdplus DistributedOptimizer against the framework's own baseline.

PyTorch (--framework torch, the default): steady-state step time of a small CNN (two conv layers and two
linear layers, 1.07 M parameters, 32x32x3 images) and an MLP (784-1024-1024-10, 1.86 M parameters), batch
32 per rank, SGD with momentum, on CPU, for three modes:
    ddp           torch.nn.parallel.DistributedDataParallel over Gloo (no hvdplus in the process)
    hvdplus       hvd.DistributedOptimizer (engine from --engine: mpi or gloo)
    hvdplus_fp16  the same with compression=hvd.Compression.fp16

How it is timed: each mode runs as its own job (so no mode shares its CPU with another's background
threads), and the jobs of all modes are repeated --rounds times in alternating order (ABC, CBA, ...)
so that a slow spell of the shared machine does not land on one mode only. In a job, each model warms
up for --warmup steps, then --reps blocks of --steps steps are timed, each block after a barrier; a
block's time is the slowest rank's. Reported: median step time over all blocks of all rounds (and the
quartiles), throughput = batch x ranks / step time, and each mode's throughput ratio to the baseline.

    .venv/bin/python scripts/bench_training.py                 # 2 ranks, hvdplus over MPI
    .venv/bin/python scripts/bench_training.py --engine gloo --rounds 3

Rank 0 of each job writes its measurements; the driver prints the table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench_collectives import _MPI_ENV, child_env, find_mpirun, load_average, wait_all

BATCH = 32
MODELS = ("cnn", "mlp")


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
        return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                   torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 10))
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def torch_worker(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time one mode's training steps for every model; return {model: block times} on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.mode == "ddp":
        rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
        dist.init_process_group("gloo", store=dist.FileStore(os.environ["HVDPLUS_RENDEZVOUS_FILE"], size),
                                rank=rank, world_size=size)
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
            optimizer = hvd.DistributedOptimizer(optimizer, compression=compression,
                                                 named_parameters=[(f"{model_name}.{n}", p)
                                                                   for n, p in model.named_parameters()])
        generator = torch.Generator().manual_seed(rank)
        shape = (BATCH, 3, 32, 32) if model_name == "cnn" else (BATCH, 784)
        x, y = torch.randn(shape, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)

        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        for _ in range(args.warmup):
            step()
        times = np.empty(args.reps)
        for rep in range(args.reps):
            barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[rep] = time.perf_counter() - start
        results[model_name] = (slowest(times) / args.steps).tolist()
    if args.mode == "ddp":
        dist.destroy_process_group()
    else:
        hvd.shutdown()
    return results if rank == 0 else {}


FRAMEWORKS: dict[str, Framework] = {
    "torch": Framework(("ddp", "hvdplus", "hvdplus_fp16"), lambda mode: mode != "ddp", torch_worker),
}


# ============================================================================ driver
def worker_command(args: argparse.Namespace, mode: str, result_file: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", "--framework", args.framework, "--mode", mode,
            "--models", args.models, "--steps", str(args.steps), "--reps", str(args.reps),
            "--warmup", str(args.warmup), "--result-file", result_file]


def run_job(args: argparse.Namespace, mode: str) -> dict[str, list[float]]:
    """One job of `mode` on --np ranks; rank 0's per-block step times by model."""
    with tempfile.TemporaryDirectory(prefix="hvdplus-bench-training-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        command = worker_command(args, mode, result_file)
        threads = {"OMP_NUM_THREADS": "1"}
        if FRAMEWORKS[args.framework].uses_hvdplus(mode) and args.engine == "mpi":
            env = child_env({**_MPI_ENV, **threads, "HOROVOD_CPU_OPERATIONS": "mpi"})
            mpirun = [find_mpirun(), "-np", str(args.np), "--oversubscribe", "--bind-to", "none"]
            procs = [subprocess.Popen(mpirun + command, env=env, start_new_session=True)]
        else:
            procs = [subprocess.Popen(command, start_new_session=True, env=child_env({
                **threads, "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_RANK": str(rank),
                "HOROVOD_SIZE": str(args.np), "HVDPLUS_RENDEZVOUS_FILE": os.path.join(workdir, "rendezvous")}))
                for rank in range(args.np)]
        codes = wait_all(procs, args.timeout)
        if any(codes) or not os.path.exists(result_file):
            raise RuntimeError(f"the {mode} job failed (exit codes {codes})")
        return json.loads(Path(result_file).read_text())


def summarize(blocks: dict[str, dict[str, list[float]]], modes: tuple[str, ...], np_ranks: int) -> dict[str, Any]:
    """Median step time, quartiles, throughput and ratio to the baseline mode, per model and mode."""
    summary: dict[str, Any] = {}
    for model in next(iter(blocks.values())):
        rows = {}
        for mode in modes:
            times = np.asarray(blocks[mode][model])
            median = float(np.median(times))
            rows[mode] = {"step_time_s": median, "p25_p75_s": [float(q) for q in np.percentile(times, [25, 75])],
                          "samples_per_s": BATCH * np_ranks / median, "blocks": len(times)}
        for mode in modes:
            rows[mode]["ratio_to_" + modes[0]] = rows[modes[0]]["step_time_s"] / rows[mode]["step_time_s"]
        summary[model] = rows
    return summary


def print_table(summary: dict[str, Any], modes: tuple[str, ...], args: argparse.Namespace) -> None:
    print(f"\n{args.framework}, {args.np} ranks, batch {BATCH} per rank, hvdplus engine {args.engine}")
    print(f"{'model':6} {'mode':14} {'step (ms)':>10} {'p25-p75 (ms)':>15} {'samples/s':>10} "
          f"{'vs ' + modes[0]:>8}")
    for model, rows in summary.items():
        for mode in modes:
            row = rows[mode]
            p25, p75 = (1000 * q for q in row["p25_p75_s"])
            print(f"{model:6} {mode:14} {1000 * row['step_time_s']:10.2f} {p25:7.2f}-{p75:<7.2f} "
                  f"{row['samples_per_s']:10.1f} {row['ratio_to_' + modes[0]]:7.2f}x")


def run_driver(args: argparse.Namespace) -> int:
    modes = FRAMEWORKS[args.framework].modes
    blocks: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        for mode in (modes if round_index % 2 == 0 else modes[::-1]):
            for model, times in run_job(args, mode).items():
                blocks[mode].setdefault(model, []).extend(times)
    summary = summarize(blocks, modes, args.np)
    print_table(summary, modes, args)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "load_average": load_average(), "wall_s": time.perf_counter() - started,
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "result_file")},
              "batch_per_rank": BATCH, "summary": summary, "block_step_times_s": blocks}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    parser.add_argument("--np", type=int, default=2, help="ranks per job")
    parser.add_argument("--engine", choices=("mpi", "gloo"), default="mpi", help="hvdplus's engine")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed block")
    parser.add_argument("--reps", type=int, default=7, help="timed blocks per job and model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per job and model")
    parser.add_argument("--rounds", type=int, default=2, help="jobs per mode, in alternating order")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job before it is stopped")
    parser.add_argument("--json", default="results/bench_training.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    framework = argparse.ArgumentParser(add_help=False)
    framework.add_argument("--framework")
    known, rest = framework.parse_known_args(argv)
    if known.framework == "keras":  # Keras vs MultiWorkerMirroredStrategy: its own launcher and modes
        from bench_training_keras import main as keras_main

        return keras_main(rest)
    args = parse_args(argv)
    if not args.worker:
        return run_driver(args)
    results = FRAMEWORKS[args.framework].worker(args)
    if results:
        Path(args.result_file).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
