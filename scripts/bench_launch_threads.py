"""Benchmark what each launcher's default threads cost: a small MLP's training step under `hvdplusrun -np N --gloo`
against DDP under `torchrun --nproc-per-node N` (issue 57).

The MLP is 256-256-10, batch 32 per rank, SGD; the step (forward, backward, gradient allreduce, update) is so
small that ranks which each start a thread per core spend it fighting over the cores. Three jobs, each started the
way a user starts it, with OMP_NUM_THREADS taken out of the environment:
    hvdplusrun          hvdplusrun's default: each rank gets cores // local ranks threads
    hvdplusrun_all      -x OMP_NUM_THREADS=<cores>: every rank a thread per core (hvdplusrun before issue 57)
    torchrun_ddp        torch DistributedDataParallel over Gloo; torchrun sets OMP_NUM_THREADS=1
Each job warms up, then times --steps steps after a barrier; a job's step time is its slowest rank's. The jobs
run in turn --rounds times; the medians and each one's ratio to torchrun's are printed.

    .venv/bin/python scripts/bench_launch_threads.py --np 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def worker(ddp: bool, warmup: int, steps: int) -> None:
    """One rank's job: train the MLP; rank 0 prints `STEP_MS <slowest rank's ms per step>`."""
    import torch

    if ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, barrier = dist.get_rank(), dist.barrier
    else:
        import hvdplus.torch as hvd

        hvd.init()
        rank, barrier = hvd.rank(), hvd.barrier
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    inputs, labels = torch.randn(32, 256), torch.randint(0, 10, (32,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    if rank == 0:
        print(f"STEP_MS {(time.perf_counter() - start) * 1000 / steps:.3f}", flush=True)


def job(mode: str, np: int, warmup: int, steps: int) -> float:
    """Run one job the way a user starts it; its ms per step."""
    me = [sys.executable, __file__, "--worker", "ddp" if mode == "torchrun_ddp" else "hvdplus"]
    me += ["--warmup", str(warmup), "--steps", str(steps)]
    if mode == "torchrun_ddp":
        argv = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={np}", *me[1:]]
    else:
        cores = "" if mode == "hvdplusrun" else f"OMP_NUM_THREADS={len(os.sched_getaffinity(0))}"
        argv = [str(BIN / "hvdplusrun"), "-np", str(np), "--gloo", *(["-x", cores] if cores else []), *me]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if "STEP_MS" in line]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(lines[0].split("STEP_MS")[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["ddp", "hvdplus"])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker == "ddp", args.warmup, args.steps)
        return
    modes = ["torchrun_ddp", "hvdplusrun", "hvdplusrun_all"]
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            times[mode].append(job(mode, args.np, args.warmup, args.steps))
    baseline = statistics.median(times["torchrun_ddp"])
    print(f"MLP 256-256-10, batch 32, {args.np} ranks, {len(os.sched_getaffinity(0))} cores, {args.rounds} rounds")
    for mode in modes:
        median = statistics.median(times[mode])
        print(f"{mode:16s} {median:7.2f} ms/step  {median / baseline:5.2f}x torchrun  {times[mode]}")


if __name__ == "__main__":
    main()
