"""torch.distributed engine: Gloo collectives over host buffers (imports torch only when chosen).

Its store is torch_store.py's, its doorbell and channel gloo_channels.py's, its planned groups torch_planned.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from hvdplus.common.elastic.plan import failure_key
from hvdplus.common.engines.gloo_channels import GlooChannel, GlooDoorbell, GlooRound
from hvdplus.common.engines.torch_collectives import (
    WIDENED,
    TorchWork,
    all_gather_single,
    reduce_options,
    start_gather,
)
from hvdplus.common.engines.torch_planned import (
    PlannedMeeting,
    TorchPlannedGroup,
    collective_work,
    process_group_of,
    store_incarnation,
)
from hvdplus.common.engines.torch_store import authenticated_store
from hvdplus.common.handles import Completed
from hvdplus.common.ops import ReduceOp
from hvdplus.common.settings import LaunchEnv

__all__ = ["TorchDistEngine"]

_T = TypeVar("_T")

log = logging.getLogger("hvdplus")


class TorchDistEngine:
    """Runs collectives with torch.distributed's Gloo backend; rendezvous by file or TCP store."""

    name = "gloo"
    # A Gloo call costs 1.5-4 ms on these machines, as much as copying 5-10 MB twice: everything fuses, and a
    # DistributedOptimizer packs DDP's 25 MiB buckets (a 7.4 MB MLP's step: 30 -> 24 ms, one call instead of 4).
    alone_bytes: int | None = None
    bucket_bytes = 25 << 20

    def __init__(self, launch: LaunchEnv, timeout_seconds: float, stall_shutdown_s: float | None = None) -> None:
        """`timeout_seconds`: the rendezvous's and the groups' (HVDPLUS_TIMEOUT). `stall_shutdown_s`: the stall
        shutdown time, if set, which bounds one collective on the rounds' groups instead, as it bounds the planned
        groups': a collective stuck on a frozen peer ends then (the rounds name the peer just before), rather than
        at HVDPLUS_TIMEOUT, and releases Gloo's threads, which destroying the group (at exit, or an elastic reset)
        would otherwise wait for."""
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
        self._timeout = timeout
        self._call_timeout = None if stall_shutdown_s is None else datetime.timedelta(seconds=stall_shutdown_s)
        try:
            self.world = self._bounded(dist.new_group(list(range(self.size)), backend="gloo", timeout=timeout))
        except BaseException:
            if self._owns_group:  # leave torch.distributed as it was: an elastic worker tries the next generation
                dist.destroy_process_group()
            raise
        self._ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        }
        self._options = reduce_options(dist.AllreduceOptions, self._ops)
        self.planned_meeting = PlannedMeeting(dist, "gloo", store, incarnation, self.rank)

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
            self._store = authenticated_store(self._dist, launch, timeout.total_seconds())
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
            return authenticated_store(self._dist, dataclasses.replace(launch, secret_key=secret), timeout_seconds)

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
        return self._bounded(group) if self.rank in ranks else None

    def _bounded(self, group: Any) -> Any:
        """`group`, whose collectives time out at the stall shutdown time from now on, if one is set (its opening
        waited up to HVDPLUS_TIMEOUT: ranks may reach it far apart)."""
        if self._call_timeout is not None and self._call_timeout < self._timeout:
            set_timeout = getattr(self._dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
            if set_timeout is not None:
                set_timeout(self._call_timeout, group)
        return group

    def start_allreduce(
        self, buf: np.ndarray, dtype: str, op: ReduceOp, group: Any, send: np.ndarray | None = None
    ) -> TorchWork:
        if send is not None:  # Gloo reduces in place only
            np.copyto(buf, send)
        pg = process_group_of(group)
        if dtype in WIDENED:
            wide = buf.astype(WIDENED[dtype])
            tensor = self._tensor(wide)
            return collective_work(
                group,
                pg.allreduce([tensor], self._options[op]),
                tensor,
                partial(np.copyto, buf, wide, casting="unsafe"),
            )
        tensor = self._tensor(buf, dtype)
        return collective_work(group, pg.allreduce([tensor], self._options[op]), tensor)

    def start_allgather(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], group: Any
    ) -> TorchWork:
        pg = process_group_of(group)
        if send is None:
            index = pg.rank()
            start = int(sum(counts[:index]))
            send = recv[start : start + counts[index]].copy()
        byte_counts = [c * send.dtype.itemsize for c in counts]
        return collective_work(group, *start_gather(pg, self._bytes(send), self._bytes(recv), byte_counts))

    def start_broadcast(self, buf: np.ndarray, root: int, group: Any) -> TorchWork:
        tensor = self._bytes(buf)
        return collective_work(group, self._dist.broadcast(tensor, group_src=root, group=group, async_op=True), tensor)

    def start_alltoall(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int], group: Any
    ) -> TorchWork:
        itemsize = send.dtype.itemsize
        tensors = (self._bytes(recv), self._bytes(send))
        work = self._dist.all_to_all_single(
            *tensors,
            output_split_sizes=[c * itemsize for c in recv_counts],
            input_split_sizes=[c * itemsize for c in send_counts],
            group=group,
            async_op=True,
        )
        return collective_work(group, work, tensors)

    def start_reducescatter(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], dtype: str, op: ReduceOp, group: Any
    ) -> TorchWork:
        # Gloo's own reduce_scatter exists but measured about 3x slower than its allreduce here (64 MiB, 2 ranks:
        # 254 ms against 82 ms), so reduce everything and keep this rank's slice.
        if send is None:  # in place: this rank's slice of the reduced buffer is already at its offset
            return self.start_allreduce(recv, dtype, op, group)
        index = process_group_of(group).rank()
        start = int(sum(counts[:index]))
        reduced = send.copy()
        work = self.start_allreduce(reduced, dtype, op, group)
        return work.followed_by(partial(np.copyto, recv, reduced[start : start + counts[index]]))

    def start_barrier(self, group: Any) -> TorchWork:
        return collective_work(group, self._dist.barrier(group=group, async_op=True), None)

    def start_sendrecv(
        self, send: np.ndarray, recv: np.ndarray, peer: int, group: Any, source: int | None = None
    ) -> Completed:
        # Blocking: a timed wait that expires on a point-to-point work leaves it unusable (its transfer then never
        # completes), unlike a collective's.
        request = self._dist.isend(self._bytes(send), group=group, group_dst=peer)
        self._dist.recv(self._bytes(recv), group=group, group_src=peer if source is None else source)
        assert request is not None  # None only on a rank outside `group`
        request.wait()
        return _DONE

    def allgather_bytes(self, data: bytes, group: Any) -> list[bytes]:
        n = self._dist.get_world_size(group)
        sizes = self._torch.zeros(n, dtype=self._torch.int64)
        all_gather_single(self._dist)(sizes, self._torch.tensor([len(data)], dtype=self._torch.int64), group=group)
        counts = sizes.tolist()
        recv = np.empty(sum(counts), dtype=np.uint8)
        self.start_allgather(np.frombuffer(data, dtype=np.uint8).copy(), recv, counts, group).wait()
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return [recv[offsets[i] : offsets[i + 1]].tobytes() for i in range(n)]

    def run_watched(self, call: Callable[[], _T], alive: Callable[[], None] | None) -> _T:
        return call()  # Gloo groups are created with a timeout of their own

    def start_bitwise_and(self, words: np.ndarray, group: Any, spin_s: float = 0.0) -> GlooRound:
        out = words.copy()
        work = self._dist.all_reduce(
            self._torch.from_numpy(out), op=self._dist.ReduceOp.BAND, group=group, async_op=True
        )
        return GlooRound(work, out)

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
        # Not bounded by the stall shutdown time: a pipeline stage may wait long for its neighbour's activations.
        group = self._dist.new_group(list(range(self.size)), backend="gloo", timeout=self._timeout)
        return GlooChannel(self._dist, self._torch, group)

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


_DONE = Completed()


def _beacon_key(stream: int, rank: int) -> str:
    """The store key of a rank's latest beacon in the world's rounds (stream 0) or a process set's."""
    return f"hvdplus/beacon/{rank}" if stream == 0 else f"hvdplus/beacon/{stream}/{rank}"
