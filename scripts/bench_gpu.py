"""Benchmark hvdplus on one GPU: what DistributedOptimizer adds to a training step at one rank.

At one rank Horovod's optimizer still runs its allreduces, so this is the cost of the machinery on a GPU step:
hooks, the plan's NCCL calls (or negotiation and the background thread, with the planned path off) and the
synchronisation at step(). Three modes, each in a process of its own, never beside another:

    plain        the model and torch.optim, no hvdplus
    planned      hvd.DistributedOptimizer, default settings (the planned path: buckets reduced from the hooks)
    negotiated   the same with HVDPLUS_PLANNED_PATH=0 (every step negotiated by the background thread)

The jobs repeat --rounds times in alternating order; each times --reps blocks of --steps steps after --warmup
steps; medians of all blocks, and each mode's throughput relative to plain. Needs a CUDA device.

    python scripts/bench_gpu.py --model resnet50 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import training_bench as tb

MODES = ("plain", "planned", "negotiated")


def make_model(name: str) -> Any:
    """A torchvision model by name, or the examples' small CNN ('small_cnn') where torchvision is missing."""
    if name == "small_cnn":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from pytorch_synthetic_benchmark import small_cnn

        return small_cnn()
    from torchvision import models

    return getattr(models, name)()


def worker(args: argparse.Namespace) -> dict[str, list[float]]:
    """Time one mode in this process: seconds per step of each block, and the device's name."""
    import torch

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = make_model(args.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    planned = None
    if args.mode != "plain":
        import hvdplus.torch as hvd

        hvd.init()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    times = tb.timed_blocks(args, step, torch.cuda.synchronize)
    torch.cuda.synchronize()
    if args.mode != "plain":
        planned = getattr(optimizer, "_reducer", None) is not None
        hvd.shutdown()
    print(f"{args.mode}: planned path {planned}", flush=True)
    return {"times": times.tolist(), "device": [torch.cuda.get_device_name(device)]}


def run_job(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hvdplus-bench-gpu-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--result-file"]
        command += [result_file, "--model", args.model, "--batch-size", str(args.batch_size)]
        command += ["--image-size", str(args.image_size), "--steps", str(args.steps), "--reps", str(args.reps)]
        command += ["--warmup", str(args.warmup)]
        env = {"HVDPLUS_PLANNED_PATH": "0"} if mode == "negotiated" else {}
        return tb.finish_job(mode, tb.start_gloo_job(1, command, env, workdir), args.timeout, result_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    tb.timing_options(parser, "results/bench_gpu.json", steps=10, reps=5, warmup=10, timeout=300)
    args = parser.parse_args(argv)
    if args.worker:
        tb.run_worker(args, worker)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    device = ""
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            result = run_job(args, mode)
            samples[mode] += result["times"]
            device = result["device"][0]
    median = {mode: float(np.median(times)) for mode, times in samples.items()}
    print(f"\n{args.model}, batch {args.batch_size}, {device}, 1 rank; medians of {args.rounds} x {args.reps} blocks")
    print(f"{'mode':12} {'step (ms)':>10} {'throughput vs plain':>20}")
    for mode in MODES:
        print(f"{mode:12} {1000 * median[mode]:10.2f} {median['plain'] / median[mode]:19.3f}x")
    report = {"device": device, "args": vars(args), "median_s": median, "samples": samples}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
