"""Device engine: the data collectives on torch tensors through torch.distributed, NCCL for CUDA tensors (Gloo
runs the same code on CPU tensors, which is how it is tested without a GPU). torch is imported when it is built.

It carries data only: negotiation, cache bits and stall checks stay on the job's host engine, which also finds
the rendezvous when torch.distributed is not initialised (a job started by mpirun).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from hvdplus.common.engines.base import Engine
from hvdplus.common.engines.torch_collectives import TensorTransfer, TorchWork, reduce_options, start_gather
from hvdplus.common.engines.torch_planned import (
    PlannedMeeting,
    TorchPlannedGroup,
    collective_work,
    meet_in_store,
    process_group_of,
    store_incarnation,
)
from hvdplus.common.ops import ReduceOp

__all__ = ["TorchTensorEngine", "TensorChannel"]

# NCCL and Gloo cannot reduce these; they are widened for the reduction and narrowed back.
_WIDENED = {"int16": "int32", "uint16": "int32"}


class TorchTensorEngine:
    """Runs allreduce, allgather, broadcast, reduce-scatter and barrier on torch tensors with `backend` ('nccl',
    or 'gloo': CUDA tensors on a GPU that several ranks share, or CPU tensors on the test path), on process groups
    of its own beside the host engine's."""

    def __init__(self, host: Engine, backend: str, timeout_seconds: float, address: str, name: str) -> None:
        """`address`: where rank 0 serves the rendezvous when torch.distributed is not initialised yet. `name`: the
        plane's (counters and messages)."""
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self.backend = torch, dist, backend
        self.name = name
        self.rank, self.size = host.rank, host.size
        self._timeout = datetime.timedelta(seconds=timeout_seconds)
        self._owns_default = not dist.is_initialized()
        if self._owns_default:  # started by mpirun: no torch.distributed yet, so rendezvous over the host engine
            self._store = self._store_over(host, address)
            dist.init_process_group(
                backend,
                store=self._store,
                rank=self.rank,
                world_size=self.size,
                timeout=self._timeout,
            )
        else:
            self._store = dist.distributed_c10d._get_default_store()
        self.world = self.new_group(range(self.size))
        self._ops = {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
        }
        self._options = reduce_options(dist.AllreduceOptions, self._ops)
        # Over Gloo (CPU tensors, or CUDA tensors of ranks sharing a GPU) a wait blocks the host and may call
        # `alive` itself; NCCL's timed wait would hold the host until the GPU drained (torch_planned.py
        # `collective_work`).
        self._host_waits = backend == "gloo"
        self._scatter_options = reduce_options(dist.ReduceScatterOptions, self._ops)
        incarnation = store_incarnation(self._store, self.size)
        self.planned_meeting = PlannedMeeting(dist, backend, self._store, incarnation, self.rank)

    def _store_over(self, host: Engine, address: str) -> Any:
        """A TCP store served by rank 0 on a free port; its address reaches the others over the host engine."""
        store = None
        if self.rank == 0:
            store = self._dist.TCPStore(
                "0.0.0.0", 0, self.size, is_master=True, timeout=self._timeout, wait_for_workers=False
            )
            served = f"{address}:{store.port}".encode()
        else:
            served = b""
        host_name, port = host.allgather_bytes(served, host.world)[0].decode().rsplit(":", 1)
        if store is None:
            store = self._dist.TCPStore(host_name, int(port), self.size, is_master=False, timeout=self._timeout)
        return store

    def new_group(self, ranks: Sequence[int]) -> Any:
        ranks = sorted(ranks)
        group = self._dist.new_group(ranks, backend=self.backend, timeout=self._timeout)
        return group if self.rank in ranks else None

    def open_planned(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> TorchPlannedGroup:
        """The planned path's group of `ranks` on this engine's backend: its buffers are the tensors themselves."""
        return self.planned_meeting.open(ranks, key, timeout_s, alive)

    def start_allreduce(self, buf: Any, dtype: str, op: ReduceOp, group: Any, send: Any | None = None) -> TorchWork:
        if send is not None:  # both backends reduce in place
            buf.copy_(send)
        pg = process_group_of(group)
        if dtype in _WIDENED:
            wide = buf.to(getattr(self._torch, _WIDENED[dtype]))
            return collective_work(
                group, pg.allreduce([wide], self._options[op]), wide, partial(buf.copy_, wide), timed=self._host_waits
            )
        return collective_work(group, pg.allreduce([buf], self._options[op]), buf, timed=self._host_waits)

    def start_allgather(self, send: Any | None, recv: Any, counts: Sequence[int], group: Any) -> TorchWork:
        """Bytes move as uint8: neither backend gathers every dtype (Gloo has no int16, NCCL no bool)."""
        pg, width = process_group_of(group), recv.element_size()
        if send is None:
            index = pg.rank()
            start = int(sum(counts[:index])) * width
            send_bytes = _bytes(recv)[start : start + counts[index] * width].clone()
        else:
            send_bytes = _bytes(send)
        return collective_work(
            group, *start_gather(pg, send_bytes, _bytes(recv), [c * width for c in counts]), timed=self._host_waits
        )

    def start_broadcast(self, buf: Any, root: int, group: Any) -> TorchWork:
        tensor = _bytes(buf)
        return collective_work(
            group,
            self._dist.broadcast(tensor, group_src=root, group=group, async_op=True),
            tensor,
            timed=self._host_waits,
        )

    def start_reducescatter(
        self, send: Any | None, recv: Any, counts: Sequence[int], dtype: str, op: ReduceOp, group: Any
    ) -> TorchWork:
        """NCCL's reduce-scatter for even slices of a type it reduces; otherwise an allreduce that keeps this
        rank's slice (Gloo's reduce-scatter measured 3x slower than its allreduce, engines/torch_dist.py)."""
        pg = process_group_of(group)
        index = pg.rank()
        start, count = int(sum(counts[:index])), counts[index]
        if self.backend == "nccl" and dtype not in _WIDENED and len(set(counts)) == 1:
            options = self._scatter_options[op]
            if send is None:  # in place: the output must not alias the input, so reduce into a copy of the slice
                mine = recv[start : start + count].clone()
                work = pg._reduce_scatter_base(mine, recv, options)
                return collective_work(
                    group, work, (mine, recv), partial(recv[start : start + count].copy_, mine), timed=self._host_waits
                )
            return collective_work(
                group, pg._reduce_scatter_base(recv, send, options), (recv, send), timed=self._host_waits
            )
        if send is None:  # in place: this rank's slice of the reduced buffer is already at its offset
            return self.start_allreduce(recv, dtype, op, group)
        reduced = send.clone()
        work = self.start_allreduce(reduced, dtype, op, group)
        return work.followed_by(partial(recv.copy_, reduced[start : start + count]))

    def start_barrier(self, group: Any) -> TorchWork:
        return collective_work(group, self._dist.barrier(group=group, async_op=True), None, timed=self._host_waits)

    # Point-to-point transfers started on this engine's channels so far (tests check the device path ran).
    p2p_transfers = 0

    def open_p2p(self, ranks: Sequence[int], key: str, alive: Callable[[], None]) -> TensorChannel:
        """A point-to-point channel between two ranks (global, this one of them) on a process group of its own on
        this engine's backend. Only they take part, from any thread: they meet in the job's store under `key`
        (the same on both, unique in the job), each calling `alive()` while it waits for the other. NCCL ignores
        tags: receives match sends in the order they were started. On NCCL the pair connects here, on the
        current CUDA device (NCCL would connect at the first transfer, which would then wait for the peer's)."""
        if len(set(ranks)) != 2 or self.rank not in ranks:
            raise ValueError(f"a point-to-point channel joins this rank ({self.rank}) and one other, got {list(ranks)}")
        dist, ranks = self._dist, sorted(ranks)
        index = ranks.index(self.rank)
        prefix = dist.PrefixStore(f"hvdplus/p2p/{self.backend}/{self.planned_meeting.incarnation}/{key}/", self._store)
        group = meet_in_store(dist, self.backend, prefix, index, len(ranks), self._timeout, alive)
        if self.backend == "nccl":
            probe = self._torch.zeros(1, device=self._torch.device("cuda", self._torch.cuda.current_device()))
            (group.send([probe], 1, 0) if index == 0 else group.recv([probe], 0, 0)).wait()
        return TensorChannel(self, group, ranks)

    def shutdown(self) -> None:
        """Destroy this engine's groups (and the default group, when this engine made it)."""
        if self._dist.is_initialized():
            self._dist.destroy_process_group(None if self._owns_default else self.world)
        self.world = self._store = None


class TensorChannel:
    """Point to point on torch tensors (of the engine's device kind) among a few ranks, on a process group of
    its own: isend/irecv of whole contiguous tensors, as `engines.base.Channel` moves arrays. Gloo moves host
    memory only: over Gloo a CUDA tensor is staged through pinned host memory here (ranks sharing a GPU)."""

    max_tag = 2**31 - 1

    def __init__(self, engine: TorchTensorEngine, group: Any, ranks: Sequence[int]) -> None:
        self._engine, self._group = engine, group
        self._index = {rank: i for i, rank in enumerate(ranks)}

    def _staged(self, tensor: Any) -> bool:
        return self._engine.backend != "nccl" and tensor.device.type != "cpu"

    def isend(self, tensor: Any, peer: int, tag: int) -> TensorTransfer:
        """Start sending the contiguous `tensor` (kept alive until the transfer completes) to global rank `peer`."""
        self._engine.p2p_transfers += 1
        wire = tensor
        if self._staged(tensor):  # copied before the send starts: Gloo's threads read it
            wire = _pinned_like(tensor)
            wire.copy_(tensor)
        return TensorTransfer(self._group.send([wire], self._index[peer], tag), wire)

    def irecv(self, tensor: Any, peer: int, tag: int) -> TensorTransfer:
        """Start receiving a message of exactly `tensor`'s size from global rank `peer` into `tensor`."""
        self._engine.p2p_transfers += 1
        if not self._staged(tensor):
            return TensorTransfer(self._group.recv([tensor], self._index[peer], tag), tensor)
        wire = _pinned_like(tensor)
        return TensorTransfer(self._group.recv([wire], self._index[peer], tag), wire, tensor)

    def close(self) -> None:
        self._group = None  # the group's threads and connections go with its last reference


def _pinned_like(tensor: Any) -> Any:
    """An empty pinned host tensor of `tensor`'s shape and dtype."""
    import torch

    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


def _bytes(tensor: Any) -> Any:
    """A flat contiguous tensor's bytes, as a uint8 view (no copy)."""
    import torch

    return tensor.view(-1).view(torch.uint8)
