"""horovod.torch's allreduce family on PyTorch tensors: one tensor, grouped (packed into one buffer when the tensors
allow), in place or into a new tensor, asynchronous or blocking, and differentiable.

CUDA tensors stay on the GPU when the job has a device plane for them (torch/device_plane.py); Adasum, and every
tensor without a plane, goes through host memory. The work itself is `hvdplus.common.collectives`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, runtime
from hvdplus.common.handles import Completion, Handle
from hvdplus.common.naming import group_size, member_names
from hvdplus.common.ops import ReduceOp
from hvdplus.torch.buffers import as_numpy, collective_buffers, device_label, dtype_name, plane_kind
from hvdplus.torch.compression import Compression, Compressor
from hvdplus.torch.op_base import differentiable, synchronize
from hvdplus.torch.packing import KeptBuffer, kept_buffers

__all__ = [
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
]


class _Started:
    """One submitted allreduce and how its result reaches the caller, in one object rather than closures (this runs
    once per tensor of every asynchronous call). Called with the core's results, as a `Completion`'s finish."""

    __slots__ = ("handle", "_tensor", "_output", "_inplace")

    def __init__(self, handle: Handle, tensor: torch.Tensor, output: torch.Tensor, inplace: bool) -> None:
        self.handle, self._tensor, self._output, self._inplace = handle, tensor, output, inplace

    def __call__(self, _results: list[Any] | None = None) -> torch.Tensor:
        """The result as the caller gets it (once the handle is done): `_result`."""
        return _result(self._tensor, self._output, self._inplace)

    result = __call__


def _start_allreduce(
    tensor: torch.Tensor,
    name: str | None,
    inplace: bool,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    group: int = 0,
) -> _Started:
    """Submit one allreduce (a member of a grouped call of `group` tensors, if not 0)."""
    # Adasum reduces tensor by tensor on the host engine (common/data/adasum.py)
    kind = None if op == ReduceOp.ADASUM else plane_kind(tensor)
    output, in_array, out_array, label = collective_buffers(tensor, inplace, kind)
    handle = core.submit_allreduce(
        in_array, out_array, dtype_name(tensor), name, op, prescale, postscale, process_set, label, group=group
    )
    return _Started(handle, tensor, output, inplace)


def _packable(tensors: Sequence[torch.Tensor], op: ReduceOp) -> bool:
    """Whether a group can travel as one flat buffer: several CPU tensors of one dtype, and not Adasum
    (which reduces tensor by tensor)."""
    if len(tensors) < 2 or op == ReduceOp.ADASUM or not isinstance(tensors[0], torch.Tensor):
        return False
    dtype = tensors[0].dtype  # is_cpu and one dtype object: ~0.4 us a tensor (device.type costs 4x more)
    if tensors[0].is_cpu:
        return all(isinstance(t, torch.Tensor) and t.is_cpu and t.dtype == dtype for t in tensors)
    device = tensors[0].device  # device tensors pack on their device when a device plane takes them
    return plane_kind(tensors[0]) is not None and all(
        isinstance(t, torch.Tensor) and t.device == device and t.dtype == dtype for t in tensors
    )


_Done = TypeVar("_Done")


class _Packed:
    """A packable group in one flat buffer, and how its results come back: views of the buffer, copied into the
    inputs when in place."""

    def __init__(self, tensors: Sequence[torch.Tensor], inplace: bool, keep: tuple[str, int] | None = None) -> None:
        """`keep`: the (name, process set id) under which an in-place group's buffer is kept for its next call
        (packing.py); None: a new buffer."""
        self.tensors, self.inplace = list(tensors), inplace
        self.parts = tuple(tuple(t.shape) for t in tensors)
        self.kept: KeptBuffer | None = None
        with torch.no_grad():  # no autograd record, and no detached copy of every tensor to make one
            if keep is None:
                self.flat = torch._utils._flatten_dense_tensors(tensors)
            else:
                self.kept = kept_buffers.borrow(keep, self.tensors, self.parts, runtime()) or kept_buffers.make(
                    keep, self.tensors, self.parts
                )
                torch._foreach_copy_(self.kept.views, self.tensors)
                self.flat = self.kept.flat
        self.kind = plane_kind(self.flat)
        # a device plane takes the tensor itself
        self.buffer: Any = as_numpy(self.flat) if self.kind is None else self.flat

    def reduce(
        self,
        call: Callable[..., _Done],
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
    ) -> _Done:
        """`call` (core.submit_allreduce or core.allreduce_now) on the buffer, as one request for the group."""
        return call(
            self.buffer,
            self.buffer,
            dtype_name(self.flat),
            name,
            op,
            prescale,
            postscale,
            process_set,
            device_label(self.flat, self.kind),
            parts=self.parts,
            group=len(self.tensors),
        )

    def result(self) -> list[torch.Tensor]:
        if self.kept is None:
            outputs = list(torch._utils._unflatten_dense_tensors(self.flat, self.tensors))
        else:
            outputs = self.kept.views
        if not self.inplace:
            return outputs
        with torch.no_grad():  # in place on the inputs, leaves that require grad included
            torch._foreach_copy_(self.tensors, outputs)
        if self.kept is not None:  # kept only once the call succeeded
            owner = runtime()
            kept_buffers.give_back(self.kept, owner.settings.fusion_threshold, owner)
        return self.tensors


def _start_packed_allreduce(
    tensors: Sequence[torch.Tensor],
    name: str | None,
    inplace: bool,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
) -> tuple[Handle, Callable[[], list[torch.Tensor]]]:
    """One request for the whole group: packed by one torch kernel, reduced in place in one engine call."""
    packed = _Packed(tensors, inplace)
    return packed.reduce(core.submit_allreduce, name, op, prescale, postscale, process_set), packed.result


def _packed_allreduce_now(
    tensors: Sequence[torch.Tensor],
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
) -> list[torch.Tensor]:
    """A blocking in-place grouped allreduce of host tensors: the core's blocking call (its lone lane), in the
    buffer kept for the group's name (packing.py)."""
    packed = _Packed(tensors, True, None if name is None else (name, process_set.process_set_id or 0))
    packed.reduce(core.allreduce_now, name, op, prescale, postscale, process_set)
    return packed.result()


def _grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    inplace: bool,
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> Completion[list[torch.Tensor]]:
    op = core.resolve_op(average, op)
    tensors = list(tensors)
    if _packable(tensors, op):
        handle, result = _start_packed_allreduce(
            tensors, name, inplace, op, prescale_factor, postscale_factor, process_set
        )
        return Completion([handle], lambda _: result())
    group = group_size(len(tensors))
    started = [
        _start_allreduce(tensor, tensor_name, inplace, op, prescale_factor, postscale_factor, process_set, group)
        for tensor, tensor_name in zip(tensors, member_names(name, len(tensors)))
    ]
    return Completion([one.handle for one in started], lambda _: [one.result() for one in started])


def _allreduce_async(
    tensor: torch.Tensor,
    inplace: bool,
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> Completion[torch.Tensor]:
    """One tensor: the grouped path without its lists (this runs once per gradient per step)."""
    started = _start_allreduce(
        tensor, name, inplace, core.resolve_op(average, op), prescale_factor, postscale_factor, process_set
    )
    return Completion([started.handle], started)


def _allreduce_now(
    tensor: torch.Tensor,
    inplace: bool,
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
) -> torch.Tensor:
    """A blocking allreduce: host tensors take the core's blocking call (its lone lane, with no handle), device
    tensors the asynchronous path without the handle a caller would hold."""
    if plane_kind(tensor) is None:
        output, in_array, out_array, label = collective_buffers(tensor, inplace, None)
        core.allreduce_now(in_array, out_array, dtype_name(tensor), name, op, prescale, postscale, process_set, label)
        return _result(tensor, output, inplace)
    started = _start_allreduce(tensor, name, inplace, op, prescale, postscale, process_set)
    started.handle.wait()
    return started.result()


def _result(tensor: torch.Tensor, output: torch.Tensor, inplace: bool) -> torch.Tensor:
    """An allreduce's result as the caller gets it: `tensor` itself when in place (its values copied in unless
    `output` shares its memory), else `output` on `tensor`'s device."""
    if inplace:
        if output is not tensor and output.data_ptr() != tensor.data_ptr():
            tensor.data.copy_(output)
        return tensor
    # is_cpu first: reading .device costs 6x more
    same_device = (output.is_cpu and tensor.is_cpu) or output.device == tensor.device
    return output if same_device else output.to(tensor.device)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Completion[list[torch.Tensor]]:
    """Start allreduces of several tensors; `synchronize` returns the list of results.

    Collective: every rank in the process set must call this, in the same order."""
    return _grouped_allreduce_async(tensors, False, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Completion[list[torch.Tensor]]:
    """In-place `grouped_allreduce_async`: the inputs receive the results."""
    return _grouped_allreduce_async(tensors, True, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Completion[torch.Tensor]:
    """Start an allreduce of `tensor`; `synchronize(handle)` returns a new tensor with the result.

    Collective: every rank in the process set must call this, in the same order."""
    return _allreduce_async(tensor, False, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> Completion[torch.Tensor]:
    """In-place `allreduce_async`: `tensor` itself receives the result."""
    return _allreduce_async(tensor, True, average, name, op, prescale_factor, postscale_factor, process_set)


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the allreduce of the gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        return _allreduce_now(tensor, False, name, op, prescale, postscale, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _allreduce_now(grad, False, None, ctx.op, ctx.prescale, ctx.postscale, ctx.process_set)
        return reduced, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` over all ranks (Average by default) and return the result; differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    op = core.resolve_op(average, op)
    compressed, ctx = compression.compress(tensor)
    reduced = differentiable(HorovodAllreduce, compressed, name, op, prescale_factor, postscale_factor, process_set)
    result: torch.Tensor = compression.decompress(reduced, ctx)
    return result


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """In-place allreduce: `tensor` receives the result and is returned."""
    op = core.resolve_op(average, op)
    return _allreduce_now(tensor, True, name, op, prescale_factor, postscale_factor, process_set)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce whose gradients are the grouped allreduce of the gradients (as Horovod)."""

    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.prescale, ctx.postscale, ctx.process_set = op, prescale, postscale, process_set
        return tuple(
            synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale, postscale, process_set))
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], None, None, ctx.op, ctx.prescale, ctx.postscale, ctx.process_set
            )
        )
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Compressor = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allreduce a list of tensors together (one flat buffer when they share a dtype); differentiable.

    Collective: every rank in the process set must call this, in the same order."""
    op = core.resolve_op(average, op)
    compressed, contexts = zip(*(compression.compress(t) for t in tensors)) if tensors else ((), ())
    reduced = differentiable(
        HorovodGroupedAllreduce, name, op, prescale_factor, postscale_factor, process_set, *compressed
    )
    return [compression.decompress(r, ctx) for r, ctx in zip(reduced, contexts)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """In-place grouped allreduce."""
    tensors = list(tensors)
    resolved = core.resolve_op(average, op)
    if _packable(tensors, resolved) and tensors[0].is_cpu and plane_kind(tensors[0]) is None:
        return _packed_allreduce_now(tensors, name, resolved, prescale_factor, postscale_factor, process_set)
    if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):  # a group of one is named as a plain call
        return [_allreduce_now(tensors[0], True, name, resolved, prescale_factor, postscale_factor, process_set)]
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )
