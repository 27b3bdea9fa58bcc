"""Negotiation at scale: the per-rank cost of hvdplus's control plane at 64, 256 and 1024 ranks.

The ranks are threads of this one process (`hvdplus.common.engines.threads`), each running the real
Coordinator: its queue, response cache, message table, announcement exchange, fusion planning and executor.
Only the transport is simulated, and it is charged apart. Each rank submits T allreduces of one float
("gradient/0" .. "gradient/T-1", in the same order on every rank) and waits for them: once on a first step,
where every name is new and is negotiated in full, then S more times in a steady state, where every name is
cached and each cycle costs one fixed-size bitwise-AND of the cache bits.

Per rank, as the median over ranks (max in brackets):
* CPU ms: hvdplus's own work, i.e. the coordinator thread's CPU clock minus the time it spent inside the
  simulated transport, plus the submitting thread's CPU for the submits;
* cycles and CPU per cycle;
* KiB received, counting what a real transport would deliver to the rank: all the others' data for an
  allgather or a pairwise swap, and log2(N) times the buffer for an allreduce (MPI's recursive doubling for
  small buffers).

The first step runs both announcement exchanges: one allgather (every rank receives N x T requests) and
recursive doubling of merged tables (log2 N swaps of a table of T entries). The allgather row stops at
--allgather-max ranks: simulating it costs O(N^2 T) in this one process.

Target (issue 17): the steady state at 1024 ranks within 1.5x of 64, and a first step whose per-rank cost
grows as O(T), not O(N T). The steady state is compared per step (T cached allreduces): the number of cycles a
step takes depends on how the GIL interleaves the simulated ranks, and fewer cycles carry more tensors each.
Python's garbage collector is paused during the measured steps, since one collection walks all N simulated
ranks' objects and would be charged to whichever rank happened to trigger it.

    .venv/bin/python scripts/bench_negotiation.py --ranks 64,256,1024 --tensors 300 --json results/negotiation.json

This needs only numpy (no MPI, no torch). The GIL runs one rank at a time, so a 1024-rank step takes
seconds of wall time; per-rank CPU is what is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.engines.threads import ThreadEngine, ThreadWorld
from hvdplus.common.ops import OpKind
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology


@dataclass
class Row:
    ranks: int
    phase: str
    exchange: str
    cpu_ms: float
    cpu_ms_max: float
    cycles: float
    cpu_us_per_cycle: float
    kib: float
    kib_per_cycle: float


class _Rank:
    """One simulated rank: its engine, coordinator, and the clocks read between phases."""

    def __init__(self, engine: ThreadEngine, settings: Settings) -> None:
        self.engine = engine
        self.coordinator = Coordinator(engine, settings, Topology.single_host(engine.rank, engine.size))
        self.clock = time.pthread_getcpuclockid(self.coordinator.counters.thread_id)
        self.submit_cpu = 0.0

    def snapshot(self) -> tuple[float, int, int]:
        """(hvdplus CPU s, cycles, bytes received) so far."""
        thread_cpu = time.clock_gettime(self.clock) - self.engine.engine_cpu(self.coordinator.counters.thread_id)
        return thread_cpu + self.submit_cpu, self.coordinator.counters.rounds, self.engine.bytes_received

    def step(self, names: list[str]) -> None:
        """Submit one allreduce per name, then wait for all (the CPU of the submits is counted)."""
        started = time.thread_time()
        handles = [
            self.coordinator.submit(
                Request(name=name, kind=OpKind.ALLREDUCE, shape=(1,)), np.ones(1, np.float32), np.empty(1, np.float32)
            )
            for name in names
        ]
        self.submit_cpu += time.thread_time() - started
        for handle in handles:
            handle.wait(600)


def _in_threads(ranks: list[_Rank], work: str, names: list[str], repeats: int) -> None:
    def body(rank: _Rank) -> None:
        for _ in range(repeats):
            getattr(rank, work)(names)

    threads = [threading.Thread(target=body, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _measure(ranks: list[_Rank], names: list[str], repeats: int, size: int, phase: str, exchange: str) -> Row:
    """Run `repeats` steps on every rank and return the per-rank cost of one step."""
    gc.collect()
    gc.disable()  # a collection walks all N ranks' objects and would be charged to whichever rank triggered it
    try:
        before = [rank.snapshot() for rank in ranks]
        _in_threads(ranks, "step", names, repeats)
        after = [rank.snapshot() for rank in ranks]
    finally:
        gc.enable()
    cpu = [(a[0] - b[0]) / repeats for a, b in zip(after, before)]
    cycles = [(a[1] - b[1]) / repeats for a, b in zip(after, before)]
    received = [(a[2] - b[2]) / repeats for a, b in zip(after, before)]
    median_cycles = statistics.median(cycles)
    median_cpu, median_bytes = statistics.median(cpu), statistics.median(received)
    return Row(
        size,
        phase,
        exchange,
        round(median_cpu * 1e3, 3),
        round(max(cpu) * 1e3, 3),
        median_cycles,
        round(median_cpu * 1e6 / median_cycles, 1),
        round(median_bytes / 1024, 2),
        round(median_bytes / 1024 / median_cycles, 3),
    )


def run(size: int, tensors: int, steady_steps: int, exchange: str) -> list[Row]:
    """A fresh world of `size` ranks: one first step, then `steady_steps` cached ones (doubling only)."""
    doubling_from = 1 if exchange == "doubling" else size + 1
    settings = Settings.from_env({}, negotiation_doubling_ranks=doubling_from, stall_check_disable=True)
    world = ThreadWorld(size)
    ranks = [_Rank(engine, settings) for engine in world.engines]
    names = [f"gradient/{i}" for i in range(tensors)]
    try:
        rows = [_measure(ranks, names, 1, size, "first step", exchange)]
        if exchange == "doubling":
            rows.append(_measure(ranks, names, steady_steps, size, "steady state", "(cached)"))
        return rows
    finally:
        ranks[0].coordinator.shutdown()  # any rank's shutdown stops them all
        for rank in ranks:
            rank.coordinator.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="64,256,1024", help="comma-separated job sizes")
    parser.add_argument("--tensors", type=int, default=300, help="allreduces per step (T)")
    parser.add_argument("--steady-steps", type=int, default=5)
    parser.add_argument("--allgather-max", type=int, default=256, help="largest size for the allgather row")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    threading.stack_size(512 * 1024)  # 2 threads a rank: keep 1024 ranks' stacks small
    rows: list[Row] = []
    sizes = [int(n) for n in args.ranks.split(",")]
    header = (
        f"{'ranks':>6} {'phase':<13} {'exchange':<10} {'CPU ms/step':>12} {'(max)':>8} {'cycles':>7} "
        f"{'CPU us/cycle':>13} {'KiB/step':>10} {'KiB/cycle':>10}"
    )
    print(f"negotiation cost per rank, {args.tensors} allreduces a step\n{header}")
    for size in sizes:
        for exchange in ("doubling", "allgather") if size <= args.allgather_max else ("doubling",):
            for row in run(size, args.tensors, args.steady_steps, exchange):
                rows.append(row)
                print(
                    f"{row.ranks:>6} {row.phase:<13} {row.exchange:<10} {row.cpu_ms:>12.2f} {row.cpu_ms_max:>8.2f} "
                    f"{row.cycles:>7.1f} {row.cpu_us_per_cycle:>13.1f} {row.kib:>10.1f} {row.kib_per_cycle:>10.2f}",
                    flush=True,
                )
    steady = {row.ranks: row for row in rows if row.phase == "steady state"}
    if len(steady) > 1:
        low, high = steady[min(steady)], steady[max(steady)]
        print(
            f"\nsteady state, {high.ranks} vs {low.ranks} ranks, per step of {args.tensors} cached allreduces: CPU "
            f"{high.cpu_ms / low.cpu_ms:.2f}x (target: within 1.5x), bytes {high.kib / low.kib:.2f}x; per cycle: "
            f"CPU {high.cpu_us_per_cycle / low.cpu_us_per_cycle:.2f}x. The per-step figure is the like-for-like one: "
            f"how many cycles a step takes depends on how the GIL interleaves the simulated ranks, and fewer cycles "
            f"carry more tensors each."
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"tensors": args.tensors, "rows": [asdict(row) for row in rows]}, out, indent=2)


if __name__ == "__main__":
    main()
