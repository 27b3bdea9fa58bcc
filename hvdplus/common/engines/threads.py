"""An engine whose ranks are threads of one process: N simulated ranks running the real coordinator.

It exists to measure and test the parts of hvdplus whose cost grows with the job (negotiation, the response
cache, fusion planning) at sizes no test machine has processes for: `scripts/bench_negotiation.py` runs 1024
ranks in one process. Each engine call is charged to its thread (CPU time spent simulating the transport is
kept apart, so what remains is hvdplus's own work) and counts the bytes the rank would receive over a real
transport: everything the others sent for an allgather or a swap, and log2(N) times the buffer for an allreduce
(recursive doubling, what MPI does for small buffers).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from hvdplus.common.engines.base import bell_targets
from hvdplus.common.handles import ALIVE_EVERY_S, Completed
from hvdplus.common.ops import ReduceOp

__all__ = ["ThreadWorld", "ThreadEngine"]

_T = TypeVar("_T")

_DONE = Completed()  # a simulated collective has completed once its call returns
_REDUCERS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


class _Round:
    """One collective call: every rank's contribution, and the combined value the last arrival computes."""

    def __init__(self, size: int) -> None:
        self.parts: list[Any] = [None] * size
        self.arrived = 0
        self.done = threading.Event()
        self.result: Any = None
        self.readers = 0


class ThreadWorld:
    """What the N ranks share: the rounds of their collectives and the mailboxes of their swaps."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._rounds: dict[int, _Round] = {}
        self._mail: defaultdict[tuple[int, int], queue.SimpleQueue] = defaultdict(queue.SimpleQueue)
        self.beacons: dict[int, int] = {}  # rank -> the control round it last said it waits in (the world's)
        self.failures: dict[int, str] = {}  # rank -> why its runtime stopped
        self.doorbells: dict[int, ThreadDoorbell] = {}
        self.engines = [ThreadEngine(self, rank) for rank in range(size)]

    def join(self, sequence: int, rank: int, part: Any, combine: Callable[[list[Any]], Any]) -> _Round:
        """Add `rank`'s part to collective number `sequence`; the last rank to arrive combines the parts."""
        with self._lock:
            entry = self._rounds.get(sequence)
            if entry is None:
                entry = self._rounds[sequence] = _Round(self.size)
            entry.parts[rank] = part
            entry.arrived += 1
            last = entry.arrived == self.size
        if last:
            entry.result = combine(entry.parts)
            entry.done.set()
        return entry

    def leave(self, sequence: int, entry: _Round) -> None:
        with self._lock:
            entry.readers += 1
            if entry.readers == self.size:
                del self._rounds[sequence]

    def mailbox(self, source: int, destination: int) -> queue.SimpleQueue:
        with self._lock:
            return self._mail[(source, destination)]


class ThreadDoorbell:
    """A simulated rank's doorbell: a ring raises the round its targets have heard of and wakes them."""

    polled = False

    def __init__(self, world: ThreadWorld, rank: int, on_ring: Callable[[], None]) -> None:
        self._world, self._rank, self._on_ring = world, rank, on_ring
        self._lock = threading.Lock()
        self._heard = -1
        world.doorbells[rank] = self

    def ring(self, round_number: int) -> None:
        for peer in bell_targets(self._rank, self._world.size):
            self._world.doorbells[peer].hear(round_number)

    def hear(self, round_number: int) -> None:
        with self._lock:
            self._heard = max(self._heard, round_number)
        self._on_ring()

    def rung(self, round_number: int) -> bool:
        return self._heard >= round_number

    def close(self) -> None:
        return None


class _ThreadRound:
    """A control round of a simulated rank in flight (a handles.Work)."""

    def __init__(self, engine: ThreadEngine, sequence: int, entry: _Round, nbytes: int) -> None:
        self._engine, self._sequence, self._entry, self._nbytes = engine, sequence, entry, nbytes

    def done(self) -> bool:
        return self._entry.done.is_set()

    def wait(self, alive: Callable[[], None] | None = None) -> np.ndarray:
        if alive is not None:
            while not self._entry.done.wait(ALIVE_EVERY_S):
                alive()
        words: np.ndarray = self._engine._finish(self._sequence, self._entry, self._nbytes).copy()  # this rank's own
        return words


class ThreadEngine:
    """Rank `rank` of a ThreadWorld. Only the world group exists (process sets are not simulated)."""

    name = "threads"
    alone_bytes: int | None = 1 << 20  # simulated ranks: MPI's policy
    bucket_bytes = 1 << 20
    world = "world"

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self._world, self.rank, self.size = world, rank, world.size
        self._sequence = 0
        self._log_size = math.ceil(math.log2(world.size)) if world.size > 1 else 0
        self.bytes_received = 0
        self._engine_cpu: dict[int, float] = defaultdict(float)

    def engine_cpu(self, thread_id: int) -> float:
        """CPU seconds thread `thread_id` spent inside this engine (simulating the transport)."""
        return self._engine_cpu[thread_id]

    # --------------------------------------------------------------- plumbing
    def _start(self, part: Any, combine: Callable[[list[Any]], Any]) -> tuple[int, _Round]:
        sequence, self._sequence = self._sequence, self._sequence + 1
        return sequence, self._world.join(sequence, self.rank, part, combine)

    def _finish(self, sequence: int, entry: _Round, nbytes: int) -> Any:
        started = time.thread_time()
        entry.done.wait()
        self._world.leave(sequence, entry)
        self.bytes_received += nbytes
        self._engine_cpu[threading.get_ident()] += time.thread_time() - started
        return entry.result

    def _collective(self, part: Any, combine: Callable[[list[Any]], Any], nbytes: int) -> Any:
        started = time.thread_time()
        sequence, entry = self._start(part, combine)
        self._engine_cpu[threading.get_ident()] += time.thread_time() - started
        return self._finish(sequence, entry, nbytes)

    def _check(self, group: Any) -> None:
        if group != self.world:
            raise ValueError("the thread engine simulates the world group only")

    # --------------------------------------------------------------- Engine
    def new_group(self, ranks: Sequence[int]) -> Any:
        raise ValueError("the thread engine simulates the world group only; it has no process sets")

    def start_allreduce(
        self, buf: np.ndarray, dtype: str, op: ReduceOp, group: Any, send: np.ndarray | None = None
    ) -> Completed:
        self._check(group)
        reduce = _REDUCERS[op]
        source = buf if send is None else send
        result = self._collective(source.copy(), lambda parts: _fold(reduce, parts), self._log_size * buf.nbytes)
        np.copyto(buf, result)
        return _DONE

    def start_allgather(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], group: Any
    ) -> Completed:
        self._check(group)
        if send is None:
            start = sum(counts[: self.rank])
            send = recv[start : start + counts[self.rank]]
        recv[...] = self._collective(send.copy(), np.concatenate, recv.nbytes - send.nbytes)
        return _DONE

    def start_broadcast(self, buf: np.ndarray, root: int, group: Any) -> Completed:
        self._check(group)
        buf[...] = self._collective(buf.copy(), lambda parts: parts[root], buf.nbytes)
        return _DONE

    def start_alltoall(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int], group: Any
    ) -> Completed:
        self._check(group)
        offsets = np.concatenate([[0], np.cumsum(send_counts)])
        pieces = [send[offsets[r] : offsets[r + 1]].copy() for r in range(self.size)]
        everyone = self._collective(pieces, lambda parts: parts, recv.nbytes)
        recv[...] = np.concatenate([everyone[source][self.rank] for source in range(self.size)])
        return _DONE

    def start_reducescatter(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], dtype: str, op: ReduceOp, group: Any
    ) -> Completed:
        self._check(group)
        start = sum(counts[: self.rank])
        total = self._collective(
            (recv if send is None else send).copy(), lambda parts: _fold(_REDUCERS[op], parts), recv.nbytes
        )
        target = recv[start : start + counts[self.rank]] if send is None else recv
        target[...] = total[start : start + counts[self.rank]]
        return _DONE

    def start_barrier(self, group: Any) -> Completed:
        self._check(group)
        self._collective(None, lambda parts: None, 0)
        return _DONE

    def start_sendrecv(
        self, send: np.ndarray, recv: np.ndarray, peer: int, group: Any, source: int | None = None
    ) -> Completed:
        self._check(group)
        started = time.thread_time()
        self._world.mailbox(self.rank, peer).put(send.copy())
        received = self._world.mailbox(peer if source is None else source, self.rank).get()
        recv[...] = received
        self.bytes_received += received.nbytes
        self._engine_cpu[threading.get_ident()] += time.thread_time() - started
        return _DONE

    def allgather_bytes(self, data: bytes, group: Any) -> list[bytes]:
        self._check(group)
        everyone: list[bytes] = self._collective(data, list, 0)
        self.bytes_received += sum(map(len, everyone)) - len(data)
        return everyone

    def run_watched(self, call: Callable[[], _T], alive: Callable[[], None] | None) -> _T:
        return call()  # simulated ranks are threads of one process: none freezes alone

    def start_bitwise_and(self, words: np.ndarray, group: Any, spin_s: float = 0.0) -> _ThreadRound | Completed:
        self._check(group)
        if self.size == 1:
            return Completed(words.copy())
        started = time.thread_time()
        sequence, entry = self._start(words.copy(), lambda parts: _fold(np.bitwise_and, parts))
        self._engine_cpu[threading.get_ident()] += time.thread_time() - started
        return _ThreadRound(self, sequence, entry, self._log_size * words.nbytes)

    def send_beacon(self, round_number: int, stream: int = 0, peers: Sequence[int] | None = None) -> None:
        assert stream == 0, "simulated ranks have no process sets"
        self._world.beacons[self.rank] = round_number

    def beacons(self, stream: int = 0, peers: Sequence[int] | None = None) -> dict[int, int]:
        return {peer: round_number for peer, round_number in dict(self._world.beacons).items() if peer != self.rank}

    def announce_failure(self, message: str) -> None:
        self._world.failures[self.rank] = message

    def failures(self) -> dict[int, str]:
        return {peer: message for peer, message in dict(self._world.failures).items() if peer != self.rank}

    def open_doorbell(self, on_ring: Callable[[], None], ranks: Sequence[int] | None = None) -> ThreadDoorbell:
        assert ranks is None or list(ranks) == list(range(self.size)), "simulated ranks have no process sets"
        return ThreadDoorbell(self._world, self.rank, on_ring)

    def shutdown(self) -> None:
        return None


def _fold(reduce: np.ufunc, parts: list[np.ndarray]) -> np.ndarray:
    result: np.ndarray = parts[0].copy()
    for part in parts[1:]:
        reduce(result, part, out=result)
    return result
