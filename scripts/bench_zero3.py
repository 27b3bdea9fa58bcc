"""ZeRO-3 (hvd.shard_parameters) against FSDP2, ZeroOptimizer (stage 1/2) and DistributedOptimizer on a GPT-style
transformer: peak RSS per rank, resident model state, bytes sent and step time; then a memory limit that one
process cannot train the model under, and stage 3 at 2 ranks training it.

    python scripts/bench_zero3.py                      # ~200M parameters, 2 ranks, 2 rounds (~15 min here)
    python scripts/bench_zero3.py --layers 2 --rounds 1 --steps 1     # a quick look

The model: token embedding (8192 x 1024), `--layers` pre-norm `TransformerEncoderLayer`s (d 1024, 16 heads,
feed-forward 4096, causal), final LayerNorm and an untied output layer; 12 layers is the 168M model of the issue,
15 (the default) about 206M. AdamW, fp32, batch 2 x 128 tokens per rank, one thread per rank. Every configuration
runs in its own jobs, in alternating order over `--rounds`, so no configuration is timed beside another:
- zero3: built on the meta device, hvd.shard_parameters(units=[TransformerEncoderLayer]) + hvd.ZeroOptimizer,
  MPI engine;
- fsdp2: torch.distributed.fsdp.fully_shard per layer and on the root, Gloo (torch 2.13's CPU backend);
- zero: hvd.ZeroOptimizer (stage 1/2), MPI; distributed: hvd.DistributedOptimizer, MPI.

Per rank: peak RSS over the timed steps only (after setup and the warm-up step, `5` is written to
/proc/self/clear_refs, which resets VmHWM; VmHWM is read after the last step); the parameter, gradient and
optimizer-state bytes resident right after a step; the bytes each rank sends per step, counted from the calls
made (ring costs: an allgather or reduce-scatter of S bytes sends (N-1)/N S, an allreduce 2 (N-1)/N S; Gloo's
reduce-scatter in torch 2.13 runs an allreduce and is counted as one); the median step time.

The memory limit is a cgroup (v1 memory controller, or v2 memory.max) per process, set to 1.15x the largest
peak RSS a stage-3 rank reached in the timed runs. One process training the model (plain AdamW) is killed by
the kernel's OOM killer under it; stage 3 at 2 ranks, each rank in its own cgroup of that size, trains.
Writes results/bench_zero3.json; scripts/bench_report.py renders it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_collectives import child_env, wait_all  # noqa: E402
from training_bench import start_mpi_job  # noqa: E402

MODES = ("zero3", "fsdp2", "zero", "distributed")
VOCAB, WIDTH, HEADS, SEQ, BATCH = 8192, 1024, 16, 128, 2
CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")


# ============================================================================ inside a job
def build_model(layers: int, meta: bool = False, width: int = WIDTH, vocab: int = VOCAB) -> Any:
    """The GPT, drawn from seed 0; `meta`: on the meta device, for hvd.shard_parameters to materialise. `width`
    and `vocab` vary the model for scripts/bench_zero_gpu.py (heads of 64 dimensions, as here)."""
    import torch

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.layers = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    width, width // (WIDTH // HEADS), 4 * width, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
            for layer in self.layers:
                x = layer(x, src_mask=mask, is_causal=True)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT()
    return GPT()


def clear_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SentBytes:
    """Bytes this rank sends, from the collectives called (ring costs)."""

    def __init__(self, size: int) -> None:
        self.size, self.total = size, 0

    def add(self, kind: str, nbytes_: int) -> None:
        share = (self.size - 1) / self.size
        self.total += int(nbytes_ * share * (2 if kind == "allreduce" else 1))


def count_hvdplus_bytes(counter: SentBytes) -> None:
    from hvdplus.common import collectives as core

    def wrap(name: str, kind: str, size_of: Any) -> None:
        original = getattr(core, name)

        def counted(array: Any, *args: Any, **kwargs: Any) -> Any:
            counter.add(kind, size_of(array, kwargs))
            return original(array, *args, **kwargs)

        setattr(core, name, counted)

    wrap("submit_allreduce", "allreduce", lambda a, kw: a.nbytes)
    wrap("submit_reducescatter", "reducescatter", lambda a, kw: a.nbytes)
    wrap(
        "submit_allgather",
        "allgather",
        lambda a, kw: kw["output"].nbytes if kw.get("output") is not None else a.nbytes * counter.size,
    )


def count_torch_bytes(counter: SentBytes) -> None:
    import torch.distributed as dist

    def wrap(name: str, kind: str, which: str) -> None:
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            named = dict(zip(("output", "input"), args), **kwargs)
            tensor = named[which]
            counter.add(kind, tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    # torch 2.13's FSDP2 calls these two (fsdp/_fully_shard/_fsdp_collectives.py)
    wrap("all_gather_single", "allgather", "output")
    wrap("reduce_scatter_single", "allreduce", "input")


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.cgroup:
        enter_cgroup(args.cgroup, int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0"))))
    if args.mode == "fsdp2":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    elif args.mode == "single":
        rank, size = 0, 1
    else:
        import hvdplus.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    counter = SentBytes(size)
    model = build_model(args.layers, meta=args.mode == "zero3")  # stage 3 never holds the whole model
    params = sum(p.numel() for p in model.parameters())
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        count_torch_bytes(counter)
    elif args.mode == "single":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        if args.mode == "zero3":
            hvd.shard_parameters(model, units=[torch.nn.TransformerEncoderLayer])
        wrap = hvd.DistributedOptimizer if args.mode == "distributed" else hvd.ZeroOptimizer
        optimizer = wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), named_parameters=model.named_parameters())
        count_hvdplus_bytes(counter)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    times, sent = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            clear_peak()
        before = counter.total
        started = time.perf_counter()
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
            sent.append(counter.total - before)
    result = {
        "rank": rank,
        "params": params,
        "step_s": times,
        "sent_bytes": sent,
        "peak_rss_bytes": peak_rss(),
        **resident(args.mode, model, optimizer),
    }
    if args.mode == "fsdp2":
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, result)
        dist.destroy_process_group()
    elif args.mode == "single":
        everyone = [result]
    else:
        everyone = hvd.allgather_object(result)
        hvd.shutdown()
    if rank == 0:
        Path(args.result_file).write_text(json.dumps(everyone))


def resident(mode: str, model: Any, optimizer: Any) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes this rank holds right after a step."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    if mode == "zero3":
        params = sum(
            unit.nbytes() + (nbytes(unit.full) if unit.persistent else 0) for unit in model._hvdplus_zero3.units
        )
    else:
        params = nbytes(local(p) for p in model.parameters())
    grads = nbytes(local(p.grad) for p in model.parameters() if p.grad is not None)
    if mode in ("zero", "zero3"):
        grads += nbytes(flat.grad for flat in optimizer._zero.flats)
    state = nbytes(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"param_bytes": params, "grad_bytes": grads, "state_bytes": state}


# ============================================================================ cgroups
def cgroup_dir(name: str) -> Path:
    return CGROUP_V1 / name if CGROUP_V1.is_dir() else CGROUP_V2 / name


def make_cgroups(prefix: str, count: int, limit: int) -> None:
    for index in range(count):
        path = cgroup_dir(f"{prefix}-{index}")
        path.mkdir(exist_ok=True)
        if CGROUP_V1.is_dir():
            (path / "memory.limit_in_bytes").write_text(str(limit))
        else:
            (path / "memory.max").write_text(str(limit))
            (path / "memory.swap.max").write_text("0")


def remove_cgroups(prefix: str, count: int) -> None:
    for index in range(count):
        path = cgroup_dir(f"{prefix}-{index}")
        if path.is_dir():
            try:
                path.rmdir()
            except OSError:
                pass


def enter_cgroup(prefix: str, index: int) -> None:
    (cgroup_dir(f"{prefix}-{index}") / "cgroup.procs").write_text(str(os.getpid()))


# ============================================================================ the driver
def start(mode: str, args: argparse.Namespace, ranks: int, result_file: str, cgroup: str = "") -> list[Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--mode",
        mode,
        "--layers",
        str(args.layers),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--result-file",
        result_file,
        *(["--cgroup", cgroup] if cgroup else []),
    ]
    env = child_env({"OMP_NUM_THREADS": "1"})
    if mode in ("fsdp2", "single"):
        procs = []
        for rank in range(ranks):
            rank_env = dict(
                env,
                RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(29500 + os.getpid() % 1000),
            )
            procs.append(subprocess.Popen(command, env=rank_env, start_new_session=True))
        return procs
    return start_mpi_job(ranks, command, {"OMP_NUM_THREADS": "1"})


def run_job(mode: str, args: argparse.Namespace, ranks: int, cgroup: str = "") -> tuple[list[int], Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result_file = str(Path(tmp) / "result.json")
        codes = wait_all(start(mode, args, ranks, result_file, cgroup), args.timeout)
        found = json.loads(Path(result_file).read_text()) if os.path.exists(result_file) else None
        return codes, found


def summarize(mode: str, samples: list[list[dict]]) -> dict[str, Any]:
    ranks = [r for job in samples for r in job]
    return {
        "step_s_median": statistics.median(t for r in ranks if r["rank"] == 0 for t in r["step_s"]),
        "peak_rss_bytes_max": max(r["peak_rss_bytes"] for r in ranks),
        "peak_rss_bytes_per_rank": [
            max(r["peak_rss_bytes"] for r in ranks if r["rank"] == k) for k in sorted({r["rank"] for r in ranks})
        ],
        "sent_bytes_per_step": statistics.median(s for r in ranks for s in r["sent_bytes"]),
        **{key: max(r[key] for r in ranks) for key in ("param_bytes", "grad_bytes", "state_bytes")},
        "params": ranks[0]["params"],
    }


def memory_limit_demo(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    """One process under `limit` (expected: OOM-killed), then stage 3 at 2 ranks, each under `limit`."""
    prefix = f"hvdplus-bench-{os.getpid()}"
    make_cgroups(prefix, args.np, limit)
    try:
        single_codes, _ = run_job("single", args, 1, prefix)
        zero3_codes, zero3 = run_job("zero3", args, args.np, prefix)
    finally:
        remove_cgroups(prefix, args.np)
    return {
        "limit_bytes": limit,
        "single_exit_codes": single_codes,
        "zero3_exit_codes": zero3_codes,
        "zero3_peak_rss_bytes": [r["peak_rss_bytes"] for r in zero3] if zero3 else None,
        "zero3_step_s": statistics.median(zero3[0]["step_s"]) if zero3 else None,
    }


def checks(summary: dict[str, Any], ranks: int) -> dict[str, Any]:
    z3, fsdp, z2, ddp = (summary[m] for m in MODES)
    model_state = lambda row: row["param_bytes"] + row["grad_bytes"] + row["state_bytes"]  # noqa: E731
    unit = 4 * (12 * WIDTH * WIDTH + 13 * WIDTH)  # one TransformerEncoderLayer, fp32
    return {
        "state_ratio_vs_distributed": model_state(z3) / model_state(ddp),
        "state_target_bytes": model_state(ddp) / ranks + unit,
        "state_ok": model_state(z3) <= model_state(ddp) / ranks + unit,
        "rss_ok": z3["peak_rss_bytes_max"] < fsdp["peak_rss_bytes_max"],
        "step_ratio_vs_fsdp2": z3["step_s_median"] / fsdp["step_s_median"],
        "step_ratio_vs_zero": z3["step_s_median"] / z2["step_s_median"],
        "step_ok": z3["step_s_median"] <= 0.6 * fsdp["step_s_median"]
        and z3["step_s_median"] <= 1.25 * z2["step_s_median"],
    }


def build_report(args: argparse.Namespace, samples: dict[str, list[Any]]) -> dict[str, Any]:
    """The JSON report of the timed jobs (the memory-limit run is added to it after)."""
    summary = {mode: summarize(mode, samples[mode]) for mode in MODES}
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "ranks": args.np,
        "layers": args.layers,
        "params": summary["zero3"]["params"],
        "batch": [BATCH, SEQ],
        "steps": args.steps,
        "rounds": args.rounds,
        "summary": summary,
        "checks": checks(summary, args.np),
        "samples": samples,
    }


def print_table(report: dict[str, Any]) -> None:
    mib = 1 << 20
    print(f"{report['params'] / 1e6:.0f}M parameters, {report['ranks']} ranks, AdamW fp32, batch {BATCH} x {SEQ}")
    print(f"{'':<12}{'peak RSS/rank':>15}{'params':>10}{'grads':>10}{'state':>10}{'sent/step':>11}{'step':>9}")
    for mode in MODES:
        row = report["summary"][mode]
        print(
            f"{mode:<12}{row['peak_rss_bytes_max'] / mib:>11.0f} MiB{row['param_bytes'] / mib:>6.0f} MiB"
            f"{row['grad_bytes'] / mib:>6.0f} MiB{row['state_bytes'] / mib:>6.0f} MiB"
            f"{row['sent_bytes_per_step'] / mib:>7.0f} MiB{row['step_s_median']:>8.2f} s"
        )
    c = report["checks"]
    print(
        f"stage 3 model state {c['state_ratio_vs_distributed']:.3f}x DistributedOptimizer's (ok: {c['state_ok']}); "
        f"peak RSS below FSDP2's: {c['rss_ok']}; step {c['step_ratio_vs_fsdp2']:.2f}x FSDP2's (target <= 0.6) and "
        f"{c['step_ratio_vs_zero']:.2f}x stage 2's (target <= 1.25)"
    )
    demo = report.get("memory_limit")
    if demo:
        print(
            f"under a {demo['limit_bytes'] / mib:.0f} MiB limit per process: one process exits "
            f"{demo['single_exit_codes']}, stage 3 at {report['ranks']} ranks exits {demo['zero3_exit_codes']}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES + ("single",), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", default="", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=15, help="transformer layers (12: 168M, 15: 206M)")
    parser.add_argument("--np", type=int, default=2, help="ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per job")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per job (the first two fault in memory and find the units' order)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="jobs per configuration, in alternating order")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--no-limit-demo", action="store_true", help="skip the memory-limit demonstration")
    parser.add_argument("--json", default="results/bench_zero3.json", help="where to write the report")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    started = time.time()
    samples: dict[str, list[Any]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else tuple(reversed(MODES)):
            codes, found = run_job(mode, args, args.np)
            if any(codes) or not found:
                raise RuntimeError(f"the {mode} job failed (exit codes {codes})")
            samples[mode].append(found)
            print(f"round {round_ + 1}: {mode} done", flush=True)
    report = build_report(args, samples)
    if not args.no_limit_demo:
        report["memory_limit"] = memory_limit_demo(args, int(1.15 * report["summary"]["zero3"]["peak_rss_bytes_max"]))
    report["seconds"] = round(time.time() - started)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print_table(report)


if __name__ == "__main__":
    main()
