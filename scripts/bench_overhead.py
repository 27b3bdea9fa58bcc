"""Benchmark the framework overhead of a training step: what hvdplus and DDP add beyond compute and transfer.

The model has 161 parameters of 64 floats each: ResNet-50's count of gradient tensors, at sizes where compute
and transfer are near zero, so what remains is the cost of the machinery (hooks, bucketing, negotiation,
hand-offs between threads, engine calls). A step's overhead is its time minus the same step in one process
(no distribution) minus one raw engine allreduce of all the gradients' bytes (41 KB):

    ddp            torch DistributedDataParallel over Gloo         - single - raw_gloo
    hvdplus_mpi    hvd.DistributedOptimizer on the MPI engine      - single - raw_mpi
    hvdplus_gloo   hvd.DistributedOptimizer on the Gloo engine     - single - raw_gloo

Every mode runs as its own job (the baselines never beside a running hvdplus), the jobs repeated --rounds times
in alternating order; each job times --reps blocks of --steps steps after --warmup steps, and a block counts at
its slowest rank. Medians over all blocks are reported, with each overhead's ratio to DDP's.

    .venv/bin/python scripts/bench_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import training_bench as tb

TENSORS, FLOATS = 161, 64
MODES = ("single", "raw_mpi", "raw_gloo", "ddp", "hvdplus_mpi", "hvdplus_gloo")
_RAW = {"ddp": "raw_gloo", "hvdplus_mpi": "raw_mpi", "hvdplus_gloo": "raw_gloo"}


def model() -> Any:
    import torch

    class Tensors161(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(FLOATS)) for _ in range(TENSORS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([(w * x).sum() for w in self.weights]).sum()

    return Tensors161()


def worker(args: argparse.Namespace) -> list[float]:
    """Time one mode in this process; the slowest rank's block times on rank 0 (empty elsewhere)."""
    import torch

    torch.set_num_threads(1)
    mode = args.mode
    grads = np.ones(TENSORS * FLOATS, dtype=np.float32)
    if mode == "raw_mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        times = tb.timed_blocks(args, lambda: comm.Allreduce(MPI.IN_PLACE, grads), comm.Barrier)
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        return times.tolist() if comm.Get_rank() == 0 else []
    net, optimizer_of = model(), lambda m: torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(FLOATS)
    if mode == "single":
        optimizer = optimizer_of(net)
        return tb.timed_blocks(args, _step(net, optimizer, x), lambda: None).tolist()
    if mode in ("raw_gloo", "ddp"):
        import torch.distributed as dist

        rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
        store = dist.FileStore(os.environ["HVDPLUS_RENDEZVOUS_FILE"], size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        if mode == "raw_gloo":
            tensor = torch.from_numpy(grads)
            times = tb.timed_blocks(args, lambda: dist.all_reduce(tensor), dist.barrier)
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            times = tb.timed_blocks(args, _step(ddp, optimizer_of(ddp), x), dist.barrier)
        slowest = torch.from_numpy(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.tolist() if rank == 0 else []
    import hvdplus.torch as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer_of(net), named_parameters=net.named_parameters())
    times = tb.timed_blocks(args, _step(net, optimizer, x), hvd.barrier)
    slowest = hvd.allreduce(torch.from_numpy(times), op=hvd.Max, name="bench.overhead.max").numpy()
    planned = getattr(optimizer, "_reducer", None) is not None
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 0:
        print(f"{mode}: planned path {'on' if planned else 'off'}", flush=True)
    return slowest.tolist() if rank == 0 else []


def _step(net: Any, optimizer: Any, x: Any) -> Any:
    def step() -> None:
        optimizer.zero_grad()
        net(x).backward()
        optimizer.step()

    return step


def run_job(args: argparse.Namespace, mode: str) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="hvdplus-bench-overhead-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--result-file"]
        command += [result_file, "--steps", str(args.steps), "--reps", str(args.reps), "--warmup", str(args.warmup)]
        threads = {"OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1"}
        if mode in ("raw_mpi", "hvdplus_mpi"):
            procs = tb.start_mpi_job(args.np, command, threads)
        else:
            procs = tb.start_gloo_job(1 if mode == "single" else args.np, command, threads, workdir)
        return tb.finish_job(mode, procs, args.timeout, result_file)["times"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    tb.timing_options(parser, "results/bench_overhead.json", steps=50, reps=7, warmup=10, rounds=3, timeout=300)
    args = parser.parse_args(argv)
    if args.worker:
        tb.run_worker(args, lambda a: {"times": times} if (times := worker(a)) else {})
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            samples[mode] += run_job(args, mode)
    report = summarize(samples, args)
    median, overhead = report["median_s"], report["overhead_s"]
    print(f"\n{TENSORS} tensors of {FLOATS} floats, {args.np} ranks; medians of {args.rounds} x {args.reps} blocks")
    print(f"{'mode':14} {'step (ms)':>10} {'overhead (ms)':>14} {'vs ddp':>8}")
    for mode in MODES:
        extra = f"{1000 * overhead[mode]:14.2f} {report['ratio_to_ddp'][mode]:7.2f}x" if mode in _RAW else ""
        print(f"{mode:14} {1000 * median[mode]:10.3f} {extra}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")
    return 0


def summarize(samples: dict[str, list[float]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON report: medians, overheads (step - single - raw) and their ratios to DDP's, and every sample."""
    median = {mode: float(np.median(times)) for mode, times in samples.items()}
    overhead = {mode: median[mode] - median["single"] - median[raw] for mode, raw in _RAW.items()}
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "result_file")},
        "tensors": TENSORS,
        "floats": FLOATS,
        "median_s": median,
        "overhead_s": overhead,
        "ratio_to_ddp": {mode: overhead[mode] / overhead["ddp"] for mode in _RAW},
        "samples_s": samples,
    }


if __name__ == "__main__":
    sys.exit(main())
