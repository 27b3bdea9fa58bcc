"""torch.distributed engine: Gloo collectives over host buffers (imports torch only when chosen)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdplus.common.elastic.plan import LATEST_KEY, GenerationReplaced, failure_key
from hvdplus.common.engines.base import bell_targets
from hvdplus.common.ops import ReduceOp
from hvdplus.common.settings import LaunchEnv

__all__ = [
    "TorchDistEngine",
    "TorchPlannedGroup",
    "all_gather_single",
    "gather_bytes",
    "PlannedMeeting",
    "reduce_scatter_single",
    "meet_in_store",
]

log = logging.getLogger("hvdplus")

_SUPERSEDED_POLL_SECONDS = 0.5  # an elastic worker's store reads look this often for a newer generation
_PLANNED_TIMEOUT = datetime.timedelta(days=365)  # the planned path's groups: stalls are watched, not timed out

# Gloo cannot reduce these; they are widened for the reduction and narrowed back.
_WIDENED = {"int16": np.int32, "uint16": np.int32}


class TorchDistEngine:
    """Runs collectives with torch.distributed's Gloo backend; rendezvous by file or TCP store."""

    name = "gloo"
    # A Gloo call costs 1.5-4 ms on these machines, as much as copying 5-10 MB twice: everything fuses, and a
    # DistributedOptimizer packs DDP's 25 MiB buckets (a 7.4 MB MLP's step: 30 -> 24 ms, one call instead of 4).
    alone_bytes: int | None = None
    bucket_bytes = 25 << 20

    def __init__(self, launch: LaunchEnv, timeout_seconds: float) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "the gloo engine needs PyTorch: pip install 'hvdplus[torch]' "
                "(or launch with mpirun and install 'hvdplus[mpi]')"
            ) from exc
        self._torch, self._dist = torch, dist
        self._beacon_store: Any = None  # the rendezvous store, when hvdplus made it
        self._srun_server: Any = None  # rank 0 under plain srun serves the step's rendezvous (see _srun_store)
        self._srun_secret_file = ""
        if launch.rank is None or launch.size is None:
            raise RuntimeError(
                "hvd.init() found no rank environment: start the job with hvdplusrun, mpirun or "
                "srun, or set HOROVOD_RANK, HOROVOD_SIZE and a rendezvous address"
            )
        self.rank, self.size = launch.rank, launch.size
        timeout = datetime.timedelta(seconds=timeout_seconds)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            # torch names its groups by a count that restarts with each job, so in a store that outlives the job
            # (hvdplusrun's, or a file's) a later job would read an earlier one's addresses: each job's groups
            # meet under its own incarnation.
            store = self._make_store(launch, timeout)
            incarnation = store_incarnation(store, self.size)
            job_store = dist.PrefixStore(f"hvdplus/job/{incarnation}/", store)
            dist.init_process_group("gloo", store=job_store, rank=self.rank, world_size=self.size, timeout=timeout)
        elif dist.get_world_size() != self.size:
            raise RuntimeError(
                f"torch.distributed is already initialized with world size {dist.get_world_size()}, "
                f"but the launcher says {self.size}"
            )
        else:  # the user's torch.distributed: its groups keep counting, but the planned groups need a count
            store = dist.distributed_c10d._get_default_store()
            incarnation = store_incarnation(store, self.size)
        try:
            self.world = dist.new_group(list(range(self.size)), backend="gloo", timeout=timeout)
        except BaseException:
            if self._owns_group:  # leave torch.distributed as it was: an elastic worker tries the next generation
                dist.destroy_process_group()
            raise
        self._timeout = timeout
        self._ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        }
        self.planned_meeting = PlannedMeeting(dist, "gloo", store, incarnation, self.rank, self._ops, self._tensor)

    def _make_store(self, launch: LaunchEnv, timeout: datetime.timedelta) -> Any:
        """The job's store (an elastic generation's namespace of it); also kept for stall beacons and failure
        notices."""
        store = self._new_store(launch, timeout)
        self._beacon_store = self._dist.PrefixStore(launch.store_prefix, store) if launch.store_prefix else store
        return self._beacon_store

    def _new_store(self, launch: LaunchEnv, timeout: datetime.timedelta) -> Any:
        if launch.rendezvous_file:
            return self._dist.FileStore(launch.rendezvous_file, self.size)
        if launch.srun_secret_file and not launch.secret_key:
            return self._srun_store(launch, timeout.total_seconds())
        if launch.secret_key and launch.rendezvous_addr and launch.rendezvous_port:
            # hvdplusrun's authenticated rendezvous. torch only keeps the C++ half of a Python store:
            # hold the Python object for the engine's lifetime or its methods vanish.
            self._store = _authenticated_store(self._dist, launch, timeout.total_seconds())
            return self._store
        if launch.rendezvous_addr and launch.rendezvous_port:
            return self._dist.TCPStore(
                launch.rendezvous_addr,
                launch.rendezvous_port,
                self.size,
                is_master=self.rank == 0 and not launch.agent_store,
                timeout=timeout,
                wait_for_workers=False,
            )
        raise RuntimeError(
            "the gloo engine needs a rendezvous: set HVDPLUS_RENDEZVOUS_ADDR and "
            "HVDPLUS_RENDEZVOUS_PORT (rank 0 listens there) or HVDPLUS_RENDEZVOUS_FILE"
        )

    def _srun_store(self, launch: LaunchEnv, timeout_seconds: float) -> Any:
        """Plain srun has no launcher to hand out a secret: rank 0 serves the authenticated store on the step's
        first node and publishes a fresh secret in a file only this user can read; the others read it (again, while
        the server rejects what they read: a file a crashed step left)."""
        from hvdplus.common.rendezvous import RendezvousServer, new_secret, publish_secret, with_published_secret

        # _with_srun_rendezvous sets the secret file with the step's first node and its port
        assert launch.srun_secret_file is not None and launch.rendezvous_addr is not None
        assert launch.rendezvous_port is not None

        def connect(secret: str) -> Any:
            return _authenticated_store(self._dist, dataclasses.replace(launch, secret_key=secret), timeout_seconds)

        if self.rank == 0:
            secret = new_secret()
            self._srun_server = RendezvousServer([launch.rendezvous_addr], secret, port=launch.rendezvous_port)
            publish_secret(launch.srun_secret_file, secret)
            self._srun_secret_file = launch.srun_secret_file
            self._store = connect(secret)
        else:
            self._store = with_published_secret(launch.srun_secret_file, connect, timeout_seconds)
        return self._store

    def _tensor(self, buf: np.ndarray, dtype: str | None = None) -> Any:
        tensor = self._torch.from_numpy(buf)
        return tensor.view(self._torch.bfloat16) if dtype == "bfloat16" else tensor

    def _bytes(self, buf: np.ndarray) -> Any:
        return self._torch.from_numpy(buf.view(np.uint8))

    def new_group(self, ranks: Sequence[int]) -> Any:
        group = self._dist.new_group(sorted(ranks), backend="gloo", timeout=self._timeout)
        return group if self.rank in ranks else None

    def allreduce(self, buf: np.ndarray, dtype: str, op: ReduceOp, group: Any, send: np.ndarray | None = None) -> None:
        if send is not None:  # Gloo reduces in place only
            np.copyto(buf, send)
        if dtype in _WIDENED:
            wide = buf.astype(_WIDENED[dtype])
            self._dist.all_reduce(self._tensor(wide), op=self._ops[op], group=group)
            buf[...] = wide
            return
        self._dist.all_reduce(self._tensor(buf, dtype), op=self._ops[op], group=group)

    def allgather(self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], group: Any) -> None:
        if send is None:
            index = self._dist.get_group_rank(group, self.rank)
            start = int(sum(counts[:index]))
            send = recv[start : start + counts[index]].copy()
        gather_bytes(self._dist, self._bytes(send), self._bytes(recv), [c * send.dtype.itemsize for c in counts], group)

    def broadcast(self, buf: np.ndarray, root: int, group: Any) -> None:
        self._dist.broadcast(self._bytes(buf), group_src=root, group=group)

    def alltoall(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int], group: Any
    ) -> None:
        itemsize = send.dtype.itemsize
        self._dist.all_to_all_single(
            self._bytes(recv),
            self._bytes(send),
            output_split_sizes=[c * itemsize for c in recv_counts],
            input_split_sizes=[c * itemsize for c in send_counts],
            group=group,
        )

    def reducescatter(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], dtype: str, op: ReduceOp, group: Any
    ) -> None:
        # Gloo's own reduce_scatter exists but measured about 3x slower than its allreduce here (64 MiB, 2 ranks:
        # 254 ms against 82 ms), so reduce everything and keep this rank's slice.
        if send is None:  # in place: this rank's slice of the reduced buffer is already at its offset
            self.allreduce(recv, dtype, op, group)
            return
        reduced = send.copy()
        self.allreduce(reduced, dtype, op, group)
        index = self._dist.get_group_rank(group, self.rank)
        start = int(sum(counts[:index]))
        recv[...] = reduced[start : start + counts[index]]

    def barrier(self, group: Any) -> None:
        self._dist.barrier(group=group)

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Any, source: int | None = None) -> None:
        request = self._dist.isend(self._bytes(send), group=group, group_dst=peer)
        self._dist.recv(self._bytes(recv), group=group, group_src=peer if source is None else source)
        assert request is not None  # None only on a rank outside `group`
        request.wait()

    def allgather_bytes(self, data: bytes, group: Any) -> list[bytes]:
        n = self._dist.get_world_size(group)
        sizes = self._torch.zeros(n, dtype=self._torch.int64)
        all_gather_single(self._dist)(sizes, self._torch.tensor([len(data)], dtype=self._torch.int64), group=group)
        counts = sizes.tolist()
        recv = np.empty(sum(counts), dtype=np.uint8)
        self.allgather(np.frombuffer(data, dtype=np.uint8).copy(), recv, counts, group)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [recv[offsets[i] : offsets[i + 1]].tobytes() for i in range(n)]

    def start_bitwise_and(self, words: np.ndarray, group: Any) -> _GlooPending:
        out = words.copy()
        work = self._dist.all_reduce(
            self._torch.from_numpy(out), op=self._dist.ReduceOp.BAND, group=group, async_op=True
        )
        return _GlooPending(work, out)

    def send_beacon(self, round_number: int, stream: int = 0, peers: Sequence[int] | None = None) -> None:
        if self._beacon_store is not None:  # the store's server outlives a frozen rank (hvdplusrun holds it)
            self._beacon_store.set(_beacon_key(stream, self.rank), str(round_number))

    def beacons(self, stream: int = 0, peers: Sequence[int] | None = None) -> dict[int, int]:
        if self._beacon_store is None:
            return {}
        others = [peer for peer in (range(self.size) if peers is None else peers) if peer != self.rank]
        keys = {peer: _beacon_key(stream, peer) for peer in others}
        return {peer: int(self._beacon_store.get(key)) for peer, key in keys.items() if self._beacon_store.check([key])}

    def announce_failure(self, message: str) -> None:
        if self._beacon_store is not None:  # the store outlives this rank's process group
            self._beacon_store.set(failure_key(self.rank), message)

    def failures(self) -> dict[int, str]:
        if self._beacon_store is None:
            return {}
        keys = {peer: failure_key(peer) for peer in range(self.size) if peer != self.rank}
        return {
            peer: self._beacon_store.get(key).decode(errors="replace")
            for peer, key in keys.items()
            if self._beacon_store.check([key])
        }

    def open_doorbell(self, on_ring: Callable[[], None], ranks: Sequence[int] | None = None) -> GlooDoorbell | None:
        members = list(range(self.size)) if ranks is None else list(ranks)
        group = self._dist.new_group(members, backend="gloo", timeout=GlooDoorbell.NEVER)  # every rank creates it
        return GlooDoorbell(self._dist, self._torch, members, group, on_ring) if self.rank in members else None

    def open_channel(self) -> GlooChannel:
        return GlooChannel(self._dist, self._torch, self.new_group(range(self.size)))

    def open_planned(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> TorchPlannedGroup:
        return self.planned_meeting.open(ranks, key, timeout_s, alive)

    def shutdown(self) -> None:
        """Destroy the groups hvdplus made (all of them, if it also made the default group) and drop
        every reference: a Gloo group that outlives this call is torn down at interpreter exit, which
        aborts the process now and then ("terminate called without an active exception")."""
        if self._dist.is_initialized():
            self._dist.destroy_process_group(None if self._owns_group else self.world)
        self.world = None
        if self._srun_server is not None:  # rank 0 under plain srun: the step's rendezvous ends with it
            self._srun_server.close()
            with contextlib.suppress(OSError):
                os.unlink(self._srun_secret_file)


def all_gather_single(dist: Any) -> Any:
    """torch.distributed's allgather into one tensor: `all_gather_single` since torch 2.13, which deprecates
    the `all_gather_into_tensor` of earlier releases (2.11 on the GPU machines has only that one)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single(dist: Any) -> Any:
    """Likewise `reduce_scatter_single` (torch 2.13), else `reduce_scatter_tensor`."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_bytes(dist: Any, send: Any, recv: Any, byte_counts: Sequence[int], group: Any) -> None:
    """Allgather of flat uint8 tensors, byte_counts[r] bytes from rank r into `recv` end to end (`send` must not
    alias `recv`). Uneven parts travel padded to the longest: Gloo's allgather needs equal sizes."""
    if len(set(byte_counts)) == 1:
        all_gather_single(dist)(recv, send, group=group)
        return
    padded, gathered, unpad = _padded_parts(send, recv, byte_counts)
    all_gather_single(dist)(gathered, padded, group=group)
    unpad()


def _padded_parts(send: Any, recv: Any, counts: Sequence[int]) -> tuple[Any, Any, Callable[[], None]]:
    """Gloo gathers equal parts only: (`send` copied into a part of the longest size, the buffer the parts land
    in, and what moves each gathered part, counts[r] elements of rank r, to its place in `recv`, end to end)."""
    longest = max(counts)
    padded = recv.new_zeros(longest)
    padded[: send.numel()] = send
    gathered = recv.new_empty(len(counts) * longest)

    def unpad() -> None:
        offset = 0
        for row, count in zip(gathered.view(len(counts), longest), counts):
            recv[offset : offset + count] = row[:count]
            offset += count

    return padded, gathered, unpad


def _authenticated_store(dist: Any, launch: LaunchEnv, timeout_seconds: float) -> Any:
    """A torch.distributed Store backed by hvdplusrun's rendezvous server (HMAC-authenticated). In an elastic job
    its blocking reads give up as soon as the launcher replaces this generation (a peer died before connecting):
    the worker then joins the next one instead of waiting out the timeout."""
    from hvdplus.common.rendezvous import RendezvousClient, RendezvousTimeout

    class AuthenticatedStore(dist.Store):
        def __init__(self, client: RendezvousClient) -> None:
            super().__init__()
            self._client = client
            self._clones: list[AuthenticatedStore] = []  # torch keeps only their C++ half

        def set(self, key: str, value: Any) -> None:
            self._client.set(key, value.encode() if isinstance(value, str) else bytes(value))

        def get(self, key: str) -> bytes:
            if not launch.elastic_worker:
                return self._client.get(key)
            deadline = time.monotonic() + self._client.timeout
            while True:  # in slices, looking for a newer generation in between
                try:
                    return self._client.get(key, min(_SUPERSEDED_POLL_SECONDS, self._client.timeout))
                except RendezvousTimeout:
                    if int(self._client.get(LATEST_KEY)) > launch.elastic_generation:
                        raise GenerationReplaced(
                            f"generation {launch.elastic_generation} of the elastic job was "
                            f"replaced while its workers connected (waiting for {key})"
                        ) from None
                    if time.monotonic() > deadline:
                        raise

        def add(self, key: str, amount: int) -> int:
            return self._client.add(key, amount)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
            return self._client.compare_set(key, as_bytes(expected), as_bytes(desired))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self._client.wait(keys, None if timeout is None else timeout.total_seconds())

        def check(self, keys: list[str]) -> bool:
            return self._client.check(keys)

        def delete_key(self, key: str) -> bool:
            return self._client.delete(key)

        def num_keys(self) -> int:
            return self._client.num_keys()

        def clone(self) -> AuthenticatedStore:
            clone = AuthenticatedStore(self._client.clone())
            self._clones.append(clone)
            return clone

    # _new_store calls this only with all three set
    assert launch.rendezvous_addr and launch.rendezvous_port and launch.secret_key
    return AuthenticatedStore(
        RendezvousClient(launch.rendezvous_addr, launch.rendezvous_port, launch.secret_key, timeout_seconds)
    )


def _beacon_key(stream: int, rank: int) -> str:
    """The store key of a rank's latest beacon in the world's rounds (stream 0) or a process set's."""
    return f"hvdplus/beacon/{rank}" if stream == 0 else f"hvdplus/beacon/{stream}/{rank}"


class GlooDoorbell:
    """Rings travel on a Gloo group of their own. Gloo's point-to-point works report completion only through a
    wait, and a wait that times out breaks the group, so a thread sleeps in an any-source receive (the group's
    timeout is a year: an idle job may stay idle) and wakes the coordinator; another thread sends."""

    polled = False

    _TAG = 0
    NEVER = datetime.timedelta(days=365)

    def __init__(self, dist: Any, torch: Any, members: list[int], group: Any, on_ring: Callable[[], None]) -> None:
        """`members`: the doorbell's global ranks, this rank among them; `group`: their Gloo group."""
        self._dist, self._torch, self._members, self._group = dist, torch, members, group
        self._index = members.index(dist.get_rank())
        self._on_ring = on_ring
        self._heard = -1
        self._outbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=target, name=f"hvdplus-doorbell-{role}", daemon=True)
            for role, target in (("receive", self._receive), ("send", self._send))
        ]
        for thread in self._threads:
            thread.start()

    def ring(self, round_number: int) -> None:
        self._outbox.put(round_number)

    def rung(self, round_number: int) -> bool:
        return self._heard >= round_number

    def close(self) -> None:
        """Stop the sender once its rings are out, and destroy the group. The receiver stays in its receive
        (Gloo cannot cancel one, and destroying the group does not end it): a daemon, it ends with the process."""
        self._outbox.put(None)
        self._threads[1].join(1.0)
        if self._dist.is_initialized():
            self._dist.destroy_process_group(self._group)

    def _receive(self) -> None:
        buf = self._torch.zeros(1, dtype=self._torch.int64)
        try:
            while True:
                self._dist.irecv(buf, src=None, group=self._group, tag=self._TAG).wait()
                self._heard = max(self._heard, int(buf[0]))
                self._on_ring()
        except Exception as exc:  # the group was destroyed at shutdown, or a peer is gone
            log.debug("doorbell receiver stopped: %s", exc)

    def _send(self) -> None:
        try:
            while (round_number := self._outbox.get()) is not None:
                bell = self._torch.tensor([round_number])
                for work in [
                    self._dist.isend(bell, dst=self._members[peer], group=self._group, tag=self._TAG)
                    for peer in bell_targets(self._index, len(self._members))
                ]:
                    work.wait()
        except Exception as exc:  # as above
            log.debug("doorbell sender stopped: %s", exc)


class GlooChannel:
    """Point to point on a Gloo group of all ranks of its own; buffers travel as bytes, moved by Gloo's threads."""

    max_tag = 2**31 - 1

    def __init__(self, dist: Any, torch: Any, group: Any) -> None:
        self._dist, self._torch, self._group = dist, torch, group

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> _GlooTransfer:
        tensor = self._torch.from_numpy(buf.reshape(-1).view(np.uint8))
        return _GlooTransfer(self._dist.isend(tensor, dst=peer, group=self._group, tag=tag), tensor)

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> _GlooTransfer:
        tensor = self._torch.from_numpy(buf.reshape(-1).view(np.uint8))
        return _GlooTransfer(self._dist.irecv(tensor, src=peer, group=self._group, tag=tag), tensor)

    def close(self) -> None:
        self._dist.destroy_process_group(self._group)


def store_incarnation(store: Any, size: int) -> int:
    """How many jobs of `size` ranks counted themselves in `store` before this one. A job's groups meet under it, so
    that a job started after `hvd.shutdown()` never reads its predecessor's keys from a store that outlived it
    (hvdplusrun's, a rendezvous file, or the user's torch.distributed store): each job's ranks all count before the
    next job's can, since shutdown is collective."""
    return (int(store.add("hvdplus/planned/incarnations", 1)) - 1) // size


@dataclasses.dataclass(frozen=True)
class PlannedMeeting:
    """Where a job's planned-path groups ('gloo' or 'nccl') meet: the job's `store`, under its `incarnation`
    (`store_incarnation`). `ops`: the engine's map from hvdplus's reduce ops to torch's; `tensor_of(buf, dtype)`:
    the caller's buffer as a tensor."""

    dist: Any
    backend: str
    store: Any
    incarnation: int
    rank: int
    ops: dict[ReduceOp, Any]
    tensor_of: Callable[[Any, str], Any]

    def open(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> TorchPlannedGroup:
        """A group of `ranks` only, under a prefix of its own: the other ranks take no part (torch's new_group would
        need every rank of the job). A step's buckets start while a peer may still be busy (a checkpoint, say): no
        timeout but the stall shutdown time, if set; a long wait is reported as a stall (_TorchPlannedWork).
        The members meet in the store first (meet_in_store): without it, torch's constructor would wait for a
        member that died before arriving as long as the group's timeout, a year without a stall limit."""
        dist = self.dist
        prefix = dist.PrefixStore(
            f"hvdplus/planned/{self.backend}/{self.incarnation}/{key}/{'.'.join(map(str, ranks))}/", self.store
        )
        timeout = _PLANNED_TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        group = meet_in_store(dist, self.backend, prefix, list(ranks).index(self.rank), len(ranks), timeout, alive)
        return TorchPlannedGroup(dist, group, len(ranks), self.ops, self.tensor_of)


def meet_in_store(
    dist: Any, backend: str, prefix: Any, index: int, size: int, timeout: datetime.timedelta, alive: Callable[[], None]
) -> Any:
    """A process group of `size` members only (this one member `index`), met under the `prefix` store: each says
    it is here and waits for the others with `alive()` between short waits (torch's constructor would wait for a
    member that died before arriving as long as the group's timeout), then builds the group on `backend`."""
    prefix.set(f"here/{index}", "1")
    _await_keys(prefix, [f"here/{member}" for member in range(size)], alive)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, index, size, options)
    import torch

    group = dist.ProcessGroupGloo(prefix, index, size, timeout)
    # Gloo's constructor can return on one rank while a peer still connects to it: a group dropped at once (an
    # optimizer made for one step) would close that connection under the peer. Leave once every pair is up.
    group.allreduce([torch.zeros(1)]).wait()
    return group


def _await_keys(store: Any, keys: list[str], alive: Callable[[], None]) -> None:
    """Return once every key is in `store`, checking it at growing intervals (1 ms to 50 ms: members usually
    arrive within milliseconds of each other) and calling `alive()` once a second. (`store.wait` with a timeout
    raises a different error for each kind of store, some only a RuntimeError saying "Wait timeout".)"""
    pause, last_alive = 1e-3, time.monotonic()
    while not store.check(keys):
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
        if time.monotonic() - last_alive >= 1.0:
            alive()
            last_alive = time.monotonic()


class TorchPlannedGroup:
    """The planned path's communicator: torch.distributed's asynchronous allreduce on a group of its own (Gloo's
    threads move it; NCCL, on a stream of its own)."""

    def __init__(
        self, dist: Any, group: Any, size: int, ops: dict[ReduceOp, Any], tensor_of: Callable[[Any, str], Any]
    ) -> None:
        """`ops`: the engine's map from hvdplus's reduce ops to torch's."""
        self._group, self.size, self._tensor_of = group, size, tensor_of
        self._options: dict[ReduceOp, Any] = {}
        for op, torch_op in ops.items():
            self._options[op] = dist.AllreduceOptions()
            self._options[op].reduceOp = torch_op

    def start_allreduce(self, buf: Any, dtype: str, op: ReduceOp) -> _TorchPlannedWork:
        if dtype in _WIDENED:
            raise TypeError(f"the planned path does not reduce {dtype} over torch.distributed")
        tensor = self._tensor_of(buf, dtype)
        return _TorchPlannedWork(self._group.allreduce([tensor], self._options[op]), tensor)

    def start_reducescatter(self, buf: Any, dtype: str, counts: Sequence[int]) -> _TorchPlannedWork:
        """An allreduce of which this rank keeps its run: Gloo's reduce-scatter measured 3x slower than its
        allreduce here (TorchDistEngine.reducescatter)."""
        return self.start_allreduce(buf, dtype, ReduceOp.SUM)

    def start_allgather(self, buf: Any, dtype: str, counts: Sequence[int]) -> _TorchPlannedWork:
        """Each member's run travels padded to the longest (gather_bytes), and the runs move back into `buf` once
        complete."""
        tensor, index = self._tensor_of(buf, dtype), self._group.rank()
        start = int(sum(counts[:index]))
        padded, gathered, unpad = _padded_parts(tensor[start : start + counts[index]], tensor, counts)
        return _TorchPlannedWork(self._group._allgather_base(gathered, padded), (tensor, padded, gathered), unpad)

    def close(self) -> None:
        self._group = None  # the group's threads and connections go with its last reference


class _GlooTransfer:
    """A Gloo send or receive and the tensor it reads or writes. Gloo's send/recv works report completion only
    through `wait`, which sleeps on a condition (no core spent) up to the engine's timeout."""

    def __init__(self, work: Any, tensor: Any) -> None:
        self._work, self._tensor = work, tensor

    def wait(self, alive: Callable[[], None]) -> None:
        self._work.wait()  # a timed wait would close the connection to the peer when the time is up


class _TorchPlannedWork:
    """A planned allreduce in flight. Over Gloo, `wait` sleeps on it (no core spent, woken the moment it
    completes); over NCCL, it makes the caller's current stream wait for it and returns. A wait that lasts is
    watched from the side (`_WATCHDOG`): Gloo's timed wait, the other way to look up now and then, costs ~0.4 ms
    more per wait here, and polling more still on a busy host."""

    def __init__(self, work: Any, tensors: Any, then: Callable[[], None] | None = None) -> None:
        """`tensors` stay alive until the work completes; `then` runs once, after it has."""
        self._work, self._tensors, self._then = work, tensors, then

    def test(self) -> bool:
        if not self._work.is_completed():
            return False
        self._work.wait()  # raises the collective's error, if it failed
        self._done()
        return True

    def wait(self, alive: Callable[[], None]) -> None:
        if self._work.is_completed():
            self._work.wait()
        else:
            with _WATCHDOG.watching(alive):
                self._work.wait()
        self._done()

    def _done(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()


class _Watchdog:
    """Calls the `alive` of the planned wait in progress once a second from a thread of its own (started at the
    first long wait), so that a stall is still reported while the waiting thread sleeps in Gloo. Its errors are
    logged: the wait itself ends by Gloo's own timeout (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) or a peer's error."""

    _EVERY_S = 1.0

    def __init__(self) -> None:
        self._waits: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, alive: Callable[[], None]) -> Any:
        key = threading.get_ident()
        with self._lock:
            self._waits[key] = alive
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdplus-planned-watchdog", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self._EVERY_S)
            with self._lock:
                checks = list(self._waits.values())
            for alive in checks:
                try:
                    alive()
                except Exception as exc:  # hvdplus stopped or the stall limit passed: Gloo ends the wait
                    log.warning("%s", exc)


_WATCHDOG = _Watchdog()


class _GlooPending:
    """A Gloo collective in flight: Gloo's own threads move the data, and `wait` sleeps on its completion."""

    def __init__(self, work: Any, out: np.ndarray) -> None:
        self._work, self._out = work, out

    def wait(self, spin_s: float = 0.0, max_sleep_s: float = 1e-3, timeout_s: float | None = None) -> np.ndarray | None:
        if timeout_s is None:
            self._work.wait()
            return self._out
        try:  # Gloo's timed wait raises when the time is up, and leaves the collective running
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            if not self._work.is_completed():
                return None
            # It finished between the timeout and the check: an untimed wait returns, or raises its real error.
            self._work.wait()
        return self._out
