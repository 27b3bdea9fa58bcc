"""MPI engine: mpi4py collectives (Open MPI, MPICH or a cluster's own MPI)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from hvdplus.common.data import halfops
from hvdplus.common.engines.base import bell_targets
from hvdplus.common.engines.blocked_calls import BlockedCalls, CallAtWait
from hvdplus.common.engines.ordered_calls import OrderedCalls
from hvdplus.common.handles import ALIVE_EVERY_S, Work
from hvdplus.common.ops import ReduceOp

__all__ = ["MPIEngine", "check_launcher_size", "check_thread_levels"]

_T = TypeVar("_T")

log = logging.getLogger("hvdplus")

# What MPI launchers declare as the job size: Open MPI's mpirun, and Hydra (MPICH, Intel MPI) or Slurm's PMI.
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_BEACON_TAG = 0x68766470  # point-to-point on the world communicator: collectives never match it
_FAILURE_TAG = _BEACON_TAG + 1
_FAILURE_BYTES = 2000  # a failure notice is cut to this: small enough to be sent eagerly, without a receiver
_SPIN_S = 200e-6  # how long a point-to-point transfer's wait tests back to back before it sleeps


def _thread_level_names(MPI: Any) -> dict[int, str]:
    return {getattr(MPI, name): f"MPI_{name}" for name in ("THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED")}


def _beacon_tag(stream: int) -> int:
    """The tag of a stream's beacons: the world's, or (above the failure notices') a process set's."""
    return _BEACON_TAG if stream == 0 else _FAILURE_TAG + stream


def check_launcher_size(world_size: int, environ: Mapping[str, str], library: str) -> None:
    """Refuse a COMM_WORLD whose size differs from the job its launcher started.

    mpi4py's wheel loads whichever MPI library it finds first; started by another MPI's mpirun, every
    rank then becomes a job of its own (size 1) and would train alone without any error."""
    for var in _LAUNCHER_SIZE_VARS:
        declared = environ.get(var, "")
        if declared.isdigit() and int(declared) != world_size:
            loaded = library.replace("\x00", "").split(",")[0].strip()
            raise RuntimeError(
                f"the MPI launcher started {declared} ranks ({var}={declared}) but MPI.COMM_WORLD has "
                f"{world_size}: mpi4py is using {loaded!r}, not the MPI of the "
                f"launcher. Start the job with that MPI's mpirun, or point mpi4py at the launcher's "
                f"library (MPI4PY_LIBMPI=/path/to/its/lib/libmpi.so); hvdplusrun does this for you."
            )


def check_thread_levels(levels: Sequence[int], multiple: int, names: Mapping[int, str]) -> None:
    """Refuse an MPI that some rank initialised below MPI_THREAD_MULTIPLE (`levels`: each rank's provided level).

    hvdplus calls MPI from several threads (each process set's rounds, the cross-host lane, the planned path's
    hooks, threads waiting on handles); below MULTIPLE that is undefined behaviour: crashes or silent corruption."""
    low = [rank for rank, level in enumerate(levels) if level < multiple]
    if low:
        found = ", ".join(sorted({names.get(levels[rank], str(levels[rank])) for rank in low}))
        raise RuntimeError(
            f"hvdplus calls MPI from several threads and needs MPI_THREAD_MULTIPLE, but MPI was initialised with "
            f"{found} on rank(s) {', '.join(map(str, low))}. Let mpi4py initialise MPI at its default level "
            f"(remove mpi4py.rc.thread_level or MPI4PY_RC_THREAD_LEVEL, or set it to 'multiple'; an application "
            f"that calls MPI_Init_thread itself must ask for MPI_THREAD_MULTIPLE and use an MPI built with thread "
            f"support), or run over Gloo instead (HOROVOD_CPU_OPERATIONS=gloo)."
        )


class MPIEngine:
    """Runs collectives with mpi4py on `comm` (MPI.COMM_WORLD unless the user passes one)."""

    name = "mpi"
    # An MPI call costs microseconds, and copying a 4 MB gradient into and out of a fusion buffer about 2 ms here:
    # large tensors go alone, and buckets hold only the small ones (DDP's first bucket, 1 MiB).
    alone_bytes: int | None = 1 << 20
    bucket_bytes = 1 << 20

    def __init__(self, comm: Any = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError("the MPI engine needs mpi4py: pip install 'hvdplus[mpi]'") from exc
        self._MPI = MPI
        if not MPI.Is_initialized():  # mpi4py.rc.initialize = False: initialize it, finalize it at exit
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
            atexit.register(MPI.Finalize)  # after hvd.shutdown(), which init() registers again after this
        if comm is None:
            check_launcher_size(MPI.COMM_WORLD.Get_size(), os.environ, MPI.Get_library_version())
            comm = MPI.COMM_WORLD
        elif isinstance(comm, (list, tuple)):
            comm = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(list(comm)))
        # Every rank learns every rank's level before any other collective, so all of them raise the same error.
        check_thread_levels(comm.allgather(MPI.Query_thread()), MPI.THREAD_MULTIPLE, _thread_level_names(MPI))
        self.world = comm.Dup()
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
        self._half_ops: dict[tuple[str, ReduceOp], Any] = {}
        self._half_ops_lock = threading.Lock()
        self._beacon_sends: list[tuple[Any, np.ndarray]] = []
        self._beacon_recvs: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}  # (stream, peer) -> its receive
        self._heard: dict[int, dict[int, int]] = {}  # stream -> peer -> round
        self._failure_sends: list[tuple[Any, np.ndarray]] = []
        self._failures: dict[int, str] = {}
        # Beacons and failure notices are sent and read by every set's rounds, each on a thread of its own: one
        # thread at a time (a notice probed by two threads would leave one of them in its receive for good).
        self._liveness_lock = threading.Lock()
        # The parent of planned groups: `Create_group` is collective over the new group's members only, and
        # runs on a communicator that no other thread's collective uses.
        self._planned_parent = self.world.Dup()
        self._planned_lock = threading.Lock()
        self._blocked = BlockedCalls(f"hvdplus-mpi-watch-{self.rank}", self._stuck)

    def _stuck(self, error: BaseException) -> None:
        """A blocking call's `alive` gave up (a peer froze inside the call): the call can never return, so say why
        as a traceback's last line (which hvdplusrun's blame reads) and abort the job, as MPI does on an error."""
        sys.stderr.write("".join(traceback.format_exception_only(error)))
        sys.stderr.flush()
        log.error("a collective is blocked for good (%s): aborting the MPI job", error)
        self.world.Abort(1)

    def new_group(self, ranks: Sequence[int]) -> Any:
        member = self.rank in ranks
        comm = self.world.Split(0 if member else self._MPI.UNDEFINED, sorted(ranks).index(self.rank) if member else 0)
        return comm if member else None

    def _op(self, dtype: str, op: ReduceOp) -> Any:
        """MPI's own op, or a user op for bfloat16 (MPI has none) and for float16 when an adapter
        registered a fast kernel (Open MPI's float16 sum is ~10x slower than its float32 sum)."""
        if not (dtype == "bfloat16" or (dtype == "float16" and halfops.has_fast_kernels(dtype, op))):
            return self._ops[op]
        if (dtype, op) not in self._half_ops:
            with self._half_ops_lock:  # each process set's rounds run on a thread of their own: create one op only
                if (dtype, op) not in self._half_ops:
                    self._half_ops[(dtype, op)] = self._MPI.Op.Create(halfops.half_reducer(dtype, op), commute=True)
        return self._half_ops[(dtype, op)]

    def _start(self, group: Any, call: Callable[[Any], None]) -> Work:
        """`call(comm)`, a blocking MPI collective on the group's communicator: queued on a planned group's thread,
        or run by the thread that waits for it on a negotiated group (DataEngine)."""
        if isinstance(group, MPIPlannedGroup):
            return group.calls.start(partial(call, group.comm))
        return CallAtWait(partial(call, group), self._blocked)

    def start_allreduce(
        self, buf: np.ndarray, dtype: str, op: ReduceOp, group: Any, send: np.ndarray | None = None
    ) -> Work:
        source, mpi_op = self._MPI.IN_PLACE if send is None else send, self._op(dtype, op)
        return self._start(group, lambda comm: comm.Allreduce(source, buf, op=mpi_op))

    def start_allgather(self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], group: Any) -> Work:
        source = self._MPI.IN_PLACE if send is None else send
        spec = [recv, list(counts), _displacements(counts), _mpi_type(self._MPI, recv)]
        return self._start(group, lambda comm: comm.Allgatherv(source, spec))

    def start_broadcast(self, buf: np.ndarray, root: int, group: Any) -> Work:
        return self._start(group, lambda comm: comm.Bcast(buf, root=root))

    def start_alltoall(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int], group: Any
    ) -> Work:
        mpi_type = _mpi_type(self._MPI, send)
        sent = [send, list(send_counts), _displacements(send_counts), mpi_type]
        received = [recv, list(recv_counts), _displacements(recv_counts), mpi_type]
        return self._start(group, lambda comm: comm.Alltoallv(sent, received))

    def start_reducescatter(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], dtype: str, op: ReduceOp, group: Any
    ) -> Work:
        source = self._MPI.IN_PLACE if send is None else [send, _mpi_type(self._MPI, send)]
        mpi_op = self._op(dtype, op)

        def call(comm: Any) -> None:
            comm.Reduce_scatter(source, [recv, _mpi_type(self._MPI, recv)], recvcounts=list(counts), op=mpi_op)
            if send is None:
                _to_own_run(recv, counts, comm.Get_rank())

        return self._start(group, call)

    def start_barrier(self, group: Any) -> Work:
        return self._start(group, lambda comm: comm.Barrier())

    def start_sendrecv(
        self, send: np.ndarray, recv: np.ndarray, peer: int, group: Any, source: int | None = None
    ) -> Work:
        other = peer if source is None else source
        return self._start(group, lambda comm: comm.Sendrecv(send, dest=peer, recvbuf=recv, source=other))

    def allgather_bytes(self, data: bytes, group: Any) -> list[bytes]:
        sizes = np.array(group.allgather(len(data)), dtype=np.int64)
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        group.Allgatherv(
            np.frombuffer(data, dtype=np.uint8), [recv, sizes.tolist(), _displacements(sizes), self._MPI.BYTE]
        )
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        return [recv[offsets[i] : offsets[i + 1]].tobytes() for i in range(len(sizes))]

    def run_watched(self, call: Callable[[], _T], alive: Callable[[], None] | None) -> _T:
        return self._blocked.run(call, alive)

    def start_bitwise_and(self, words: np.ndarray, group: Any, spin_s: float = 0.0) -> _MPIWork:
        out = np.empty_like(words)
        return _MPIWork(group.Iallreduce(words, out, op=self._MPI.BAND), (words, out), out, spin_s)

    def send_beacon(self, round_number: int, stream: int = 0, peers: Sequence[int] | None = None) -> None:
        others = [peer for peer in (range(self.size) if peers is None else peers) if peer != self.rank]
        with self._liveness_lock:
            self._beacon_sends = _send_round(self.world, round_number, others, self._beacon_sends, _beacon_tag(stream))

    def beacons(self, stream: int = 0, peers: Sequence[int] | None = None) -> dict[int, int]:
        with self._liveness_lock:
            return self._read_beacons(stream, peers)

    def _read_beacons(self, stream: int, peers: Sequence[int] | None) -> dict[int, int]:
        heard = self._heard.setdefault(stream, {})
        for peer in range(self.size) if peers is None else peers:
            if peer == self.rank:
                continue
            # Posted on the first stall only: a healthy job never has them pending.
            request, buf = self._beacon_recvs.get((stream, peer)) or self._post_beacon_recv(stream, peer)
            while request.Test():
                heard[peer] = int(buf[0])
                request, buf = self._post_beacon_recv(stream, peer)
            self._beacon_recvs[(stream, peer)] = request, buf
        return dict(heard)

    def announce_failure(self, message: str) -> None:
        buf = np.frombuffer(message.encode()[:_FAILURE_BYTES], dtype=np.uint8)
        with self._liveness_lock:
            self._failure_sends += [
                (self.world.Isend(buf, dest=peer, tag=_FAILURE_TAG), buf)
                for peer in range(self.size)
                if peer != self.rank
            ]

    def failures(self) -> dict[int, str]:
        status = self._MPI.Status()
        with self._liveness_lock:
            while self.world.Iprobe(source=self._MPI.ANY_SOURCE, tag=_FAILURE_TAG, status=status):
                buf = np.empty(status.Get_count(self._MPI.BYTE), dtype=np.uint8)
                self.world.Recv(buf, source=status.Get_source(), tag=_FAILURE_TAG)
                self._failures[status.Get_source()] = buf.tobytes().decode(errors="replace")
            return dict(self._failures)

    def _post_beacon_recv(self, stream: int, peer: int) -> tuple[Any, np.ndarray]:
        buf = np.empty(1, dtype=np.int64)
        return self.world.Irecv(buf, source=peer, tag=_beacon_tag(stream)), buf

    def open_doorbell(self, on_ring: Callable[[], None], ranks: Sequence[int] | None = None) -> MPIDoorbell | None:
        if ranks is None:
            return MPIDoorbell(self.world.Dup(), self._MPI.ANY_SOURCE)
        comm = self.new_group(ranks)  # collective over the world; a communicator of its own for the rings
        return None if comm is None else MPIDoorbell(comm, self._MPI.ANY_SOURCE)

    def open_channel(self) -> MPIChannel:
        return MPIChannel(self.world.Dup(), self._MPI)

    def open_planned(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> MPIPlannedGroup:
        """`alive` is not called: MPI's group creation blocks, and a rank that dies ends the MPI job."""
        with self._planned_lock:
            group = self._planned_parent.Get_group().Incl(list(ranks))
            comm = self._planned_parent.Create_group(group, tag=key % int(self.world.Get_attr(self._MPI.TAG_UB)))
            group.Free()
        return MPIPlannedGroup(comm, self._MPI)

    def shutdown(self) -> None:
        self._blocked.close()
        self._planned_parent.Free()
        for request, _ in self._beacon_recvs.values():  # a frozen peer never sends: cancel what waits for it
            request.Cancel()
            request.Wait()
        self._beacon_recvs.clear()
        for request, _ in self._failure_sends:  # eager messages: complete, or their peer is gone
            if not request.Test():
                request.Free()
        self._failure_sends.clear()
        for op in self._half_ops.values():
            op.Free()
        self._half_ops.clear()


class MPIDoorbell:
    """Rings are 8-byte messages on a communicator of their own, received by one any-source receive that the
    coordinator tests while it sleeps (an MPI wait would spin a core; messages this small complete eagerly)."""

    polled = True

    def __init__(self, comm: Any, any_source: int) -> None:
        self._comm, self._any_source = comm, any_source
        self._sends: list[tuple[Any, np.ndarray]] = []
        self._heard = -1
        self._buf = np.empty(1, dtype=np.int64)
        self._recv = comm.Irecv(self._buf, source=self._any_source)

    def ring(self, round_number: int) -> None:
        self._sends = _send_round(
            self._comm, round_number, bell_targets(self._comm.Get_rank(), self._comm.Get_size()), self._sends
        )

    def rung(self, round_number: int) -> bool:
        while self._recv.Test():
            self._heard = max(self._heard, int(self._buf[0]))
            self._recv = self._comm.Irecv(self._buf, source=self._any_source)
        return self._heard >= round_number

    def close(self) -> None:
        self._recv.Cancel()
        self._recv.Wait()
        for request, _ in self._sends:  # delivered eagerly, or to a peer that is gone: nothing to wait for
            if not request.Test():
                request.Free()
        self._sends.clear()
        self._comm.Free()  # a removed process set's doorbell must not keep its context id


def _send_round(
    comm: Any, round_number: int, peers: Sequence[int], in_flight: list[tuple[Any, np.ndarray]], tag: int = 0
) -> list[tuple[Any, np.ndarray]]:
    """Start sending a round number (one int64) to each of `peers` without blocking. Returns the sends still in
    flight: those of `in_flight` not yet complete, then the new ones, each with the buffer it reads."""
    buf = np.array([round_number], dtype=np.int64)
    return [(request, sent) for request, sent in in_flight if not request.Test()] + [
        (comm.Isend(buf, dest=peer, tag=tag), buf) for peer in peers
    ]


class MPIChannel:
    """Point to point on a duplicate of the world communicator (so no collective's message can match)."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        self._comm, self._MPI = comm, MPI
        self.max_tag = int(comm.Get_attr(MPI.TAG_UB))

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> _MPIWork:
        return _MPIWork(self._comm.Isend([buf, _mpi_type(self._MPI, buf)], dest=peer, tag=tag), (buf,), None, _SPIN_S)

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> _MPIWork:
        return _MPIWork(self._comm.Irecv([buf, _mpi_type(self._MPI, buf)], source=peer, tag=tag), (buf,), None, _SPIN_S)

    def close(self) -> None:
        self._comm.Free()


class MPIPlannedGroup:
    """The planned path's communicator: the engine's collectives on it run as MPI's blocking ones, in the order
    started, on a thread of its own (engines/ordered_calls.py says why not MPI's non-blocking ones)."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        self.comm, self._MPI = comm, MPI
        self.size = comm.Get_size()
        self.calls = OrderedCalls(f"hvdplus-planned-mpi-{comm.Get_rank()}")

    def close(self) -> None:
        if self.comm != self._MPI.COMM_NULL and self.calls.close():  # closed once, by its plan or at shutdown; a
            self.comm.Free()  # call still blocked keeps it (freeing it under the call would crash)


class _MPIWork:
    """A non-blocking MPI call (a transfer, or a control round's AND) and the buffers it reads or writes, alive until
    it completes. MPI progresses it only inside MPI calls, and MPI's own Wait would spin a core that a peer on the
    same host needs (a pipeline stage computing, a late rank), so `wait` tests it: back to back for `spin_s`, then
    with sleeps doubling from 20 us to 1 ms."""

    __slots__ = ("_request", "_buffers", "_result", "_spin_s")
    _FIRST_SLEEP_S, _MAX_SLEEP_S = 20e-6, 1e-3

    def __init__(self, request: Any, buffers: tuple[np.ndarray, ...], result: Any = None, spin_s: float = 0.0) -> None:
        self._request, self._buffers, self._result, self._spin_s = request, buffers, result, spin_s

    def done(self) -> bool:
        return bool(self._request.Test())

    def wait(self, alive: Callable[[], None] | None = None) -> Any:
        now = time.perf_counter()
        spin_until, next_alive, delay = now + self._spin_s, now + ALIVE_EVERY_S, 0.0
        while not self._request.Test():
            now = time.perf_counter()
            if now >= spin_until:
                if alive is not None and now >= next_alive:
                    alive()
                    next_alive = now + ALIVE_EVERY_S
                delay = min(max(2 * delay, self._FIRST_SLEEP_S), self._MAX_SLEEP_S)
                time.sleep(delay)
        return self._result


def _to_own_run(buf: np.ndarray, counts: Sequence[int], index: int) -> None:
    """MPI leaves an in-place reduce-scatter's result at the start of the buffer: move it to member `index`'s
    run (counts[index] elements after the runs before it)."""
    start, count = int(sum(counts[:index])), int(counts[index])
    if start and count:
        buf[start : start + count] = buf[:count].copy()


def _displacements(counts: Sequence[int] | np.ndarray) -> list[int]:
    starts: list[int] = np.cumsum(np.asarray(counts, dtype=np.int64))[:-1].tolist()
    return [0] + starts


def _mpi_type(MPI: Any, buf: np.ndarray) -> Any:
    """The MPI datatype of a numpy buffer (bfloat16 travels as its uint16 storage)."""
    return MPI._typedict[buf.dtype.char]
