"""horovod.torch's collectives on PyTorch tensors: tensor <-> host buffer, handles and autograd.

Every op keeps Horovod's signature; the work itself is done by `hvdplus.common.collectives`.
CUDA tensors go to the core as they are when the job has a device plane for them (NCCL, torch/device_plane.py):
allreduce, allgather, broadcast and reduce-scatter then never leave the GPU. Adasum and alltoall, and every
op without a device plane (HOROVOD_GPU_OPERATIONS=mpi, torch without NCCL), stage through host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, rank
from hvdplus.common.handles import Completion
from hvdplus.common.naming import group_size, member_names
from hvdplus.common.ops import ReduceOp, reducescatter_grad_scale
from hvdplus.common.planned_steps import serve_joined

# HorovodAllreduce and HorovodGroupedAllreduce (autograd Functions) stay reachable here, as in horovod.torch.mpi_ops.
from hvdplus.torch.allreduce_ops import HorovodAllreduce as HorovodAllreduce
from hvdplus.torch.allreduce_ops import HorovodGroupedAllreduce as HorovodGroupedAllreduce
from hvdplus.torch.allreduce_ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from hvdplus.torch.buffers import (
    as_numpy,
    collective_buffers,
    collective_input,
    collective_result,
    dtype_name,
    from_numpy,
    host_tensor,
    plane_kind,
)
from hvdplus.torch.compression import Compression, Compressor
from hvdplus.torch.op_base import differentiable, first_result, poll, synchronize

__all__ = [
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_async",
    "broadcast_",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "poll",
    "synchronize",
    "join",
    "barrier",
]


# ----------------------------------------------------------------------------- allgather
def _allgather_members(
    tensors: Sequence[torch.Tensor], names: Sequence[str | None], process_set: ProcessSet, group: int
) -> Completion[list[torch.Tensor]]:
    """Start one allgather per tensor, each announcing the size of the grouped call it belongs to."""
    handles = []
    for t, n in zip(tensors, names):
        buffer, label = collective_input(t)
        handles.append(core.submit_allgather(buffer, dtype_name(t), n, process_set, label, group))
    return Completion(handles, lambda results: [collective_result(r, t) for r, t in zip(results, tensors)])


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> Completion[list[torch.Tensor]]:
    """Start allgathers of several tensors; `synchronize` returns the list of results."""
    return _allgather_members(tensors, member_names(name, len(tensors)), process_set, group_size(len(tensors)))


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Completion[torch.Tensor]:
    """Start concatenating every rank's `tensor` along dimension 0 (first dimensions may differ).

    Collective: every rank in the process set must call this, in the same order."""
    return _allgather_members([tensor], [name], process_set, 0).then(first_result)


class HorovodAllgather(torch.autograd.Function):
    """Allgather whose gradient is this rank's slice of the averaged gradient (as Horovod)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet, group: int) -> torch.Tensor:
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(_allgather_members([tensor], [name], process_set, group).then(first_result))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = synchronize(allreduce_async(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows]), process_set=ctx.process_set))
        offset = int(rows[: ctx.process_set.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0; differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    gathered: torch.Tensor = differentiable(HorovodAllgather, tensor, name, process_set, 0)
    return gathered


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Allgather a list of tensors; differentiable."""
    group = group_size(len(tensors))
    return [
        differentiable(HorovodAllgather, t, n, process_set, group)
        for t, n in zip(tensors, member_names(name, len(tensors)))
    ]


# ----------------------------------------------------------------------------- broadcast
def _broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet, inplace: bool
) -> Completion[torch.Tensor]:
    output, in_array, out_array, label = collective_buffers(tensor, inplace, plane_kind(tensor))
    handle = core.submit_broadcast(in_array, out_array, dtype_name(tensor), root_rank, name, process_set, label)

    def finish(_: list[Any]) -> torch.Tensor:
        if not inplace:
            return output if output.device == tensor.device else output.to(tensor.device)
        if output.data_ptr() != tensor.data_ptr():
            tensor.data.copy_(output)
        return tensor

    return Completion([handle], finish)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Completion[torch.Tensor]:
    """Start copying root's `tensor` to every rank; `synchronize` returns a new tensor.

    Collective: every rank in the process set must call this, in the same order."""
    return _broadcast_async(tensor, root_rank, name, process_set, inplace=False)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Completion[torch.Tensor]:
    """In-place `broadcast_async`: `tensor` itself receives root's values."""
    return _broadcast_async(tensor, root_rank, name, process_set, inplace=True)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast whose gradient is the averaged gradient on the root (a global rank) and zero elsewhere (as Horovod)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = synchronize(allreduce_async(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set))
        if rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Return root's `tensor` on every rank; differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    result: torch.Tensor = differentiable(HorovodBroadcast, tensor, root_rank, name, process_set)
    return result


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """In-place broadcast: `tensor` receives root's values and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------------------- alltoall
def _split_list(splits: Sequence[int] | torch.Tensor | None) -> Sequence[int] | None:
    """A splits tensor as a list, refused by its dtype before its values are read (Horovod's local check): a
    float tensor made with torch.empty holds different garbage on each rank, and reading it would let one rank
    submit while another raises."""
    if not isinstance(splits, torch.Tensor):
        return splits
    if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
        raise ValueError(
            f"alltoall expects splits to contain integers, got a {splits.dtype} tensor; pass an integer tensor "
            "(e.g. splits.to(torch.int32)) or a list of ints"
        )
    return splits.tolist()


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Completion[tuple[torch.Tensor, torch.Tensor]]:
    """Start an alltoall: rows splits[r] go to rank r (even split without `splits`).
    `synchronize` returns (output, received_splits).

    Collective: every rank in the process set must call this, in the same order."""
    handle = core.submit_alltoall(
        as_numpy(host_tensor(tensor)), dtype_name(tensor), _split_list(splits), name, process_set, str(tensor.device)
    )
    return Completion(
        [handle],
        lambda results: (from_numpy(results[0][0], tensor.dtype, tensor.device), torch.from_numpy(results[0][1])),
    )


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall whose gradient is the alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        output, _received = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return output, None, None, None


@overload
def alltoall(
    tensor: torch.Tensor, splits: None = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor: ...


@overload
def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scatter slices of `tensor` to every rank and gather theirs; differentiable.

    Returns the output, or (output, received_splits) when `splits` is given (as Horovod).
    Collective: every rank in the process set must call this, in the same order."""
    output, received = differentiable(HorovodAlltoall, tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ----------------------------------------------------------------------------- reducescatter
def _reducescatter_members(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str | None],
    op: ReduceOp,
    process_set: ProcessSet,
    prescale: float,
    postscale: float,
    group: int,
) -> Completion[list[torch.Tensor]]:
    """Start one reduce-scatter per tensor, each announcing the size of the grouped call it belongs to."""
    handles = []
    for t, n in zip(tensors, names):
        buffer, label = collective_input(t)
        handles.append(
            core.submit_reducescatter(
                buffer, dtype_name(t), n, core.resolve_op(None, op), prescale, postscale, process_set, label, group
            )
        )
    return Completion(handles, lambda results: [collective_result(r, t) for r, t in zip(results, tensors)])


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Completion[list[torch.Tensor]]:
    """Start reduce-scatters of several tensors; `synchronize` returns the list of this rank's shards."""
    return _reducescatter_members(
        tensors,
        member_names(name, len(tensors)),
        op,
        process_set,
        prescale_factor,
        postscale_factor,
        group_size(len(tensors)),
    )


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Completion[torch.Tensor]:
    """Start a reduce-scatter: rank r receives its rows of the reduction (Horovod's uneven split).

    Collective: every rank in the process set must call this, in the same order."""
    return _reducescatter_members([tensor], [name], op, process_set, prescale_factor, postscale_factor, 0).then(
        first_result
    )


class HorovodReducescatter(torch.autograd.Function):
    """Reduce-scatter whose gradient is the allgather of the shard gradients, scaled by Horovod's rule
    (`reducescatter_grad_scale`: the set's size for Sum, 1 for Average, times the scale factors)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        process_set: ProcessSet,
        prescale: float,
        postscale: float,
        group: int,
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        return synchronize(
            _reducescatter_members([tensor], [name], op, process_set, prescale, postscale, group).then(first_result)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scale = reducescatter_grad_scale(ctx.op, ctx.prescale, ctx.postscale, ctx.process_set.size())
        gathered = synchronize(allgather_async(grad.contiguous(), process_set=ctx.process_set))
        return gathered * scale, None, None, None, None, None, None


def _reducescatter(
    tensor: torch.Tensor,
    name: str | None,
    compression: Compressor,
    op: ReduceOp,
    process_set: ProcessSet,
    prescale: float,
    postscale: float,
    group: int,
) -> torch.Tensor:
    compressed, ctx = compression.compress(tensor)
    shard = differentiable(HorovodReducescatter, compressed, name, op, process_set, prescale, postscale, group)
    result: torch.Tensor = compression.decompress(shard, ctx)
    return result


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: Compressor = Compression.none,
    op: ReduceOp = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's rows of the result; differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    return _reducescatter(tensor, name, compression, op, process_set, prescale_factor, postscale_factor, 0)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: Compressor = Compression.none,
    op: ReduceOp = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reduce-scatter a list of tensors; differentiable."""
    group = group_size(len(tensors))
    return [
        _reducescatter(t, n, compression, op, process_set, prescale_factor, postscale_factor, group)
        for t, n in zip(tensors, member_names(name, len(tensors)))
    ]


# ----------------------------------------------------------------------------- join and barrier
def join(device: int = -1) -> int:
    """Declare that this rank has no more batches; block until every rank has joined.

    Meanwhile this rank contributes zeros to the allreduces of the ranks still training.
    Returns the rank that joined last. Collective: every rank must call it once per epoch. DistributedOptimizers
    on the planned path get their zeros from here too (common/planned_steps.py: serve_joined)."""
    handle = core.submit_join()
    serve_joined()
    last_rank: int = handle.wait()
    return last_rank


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of the process set reaches the barrier."""
    core.submit_barrier(process_set).wait()
