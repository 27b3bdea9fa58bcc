"""A ZeRO-3 unit: the parameters one module owns, flattened per (dtype, trainable) and split over the ranks, with
the flat buffers a gather fills and a release frees (zero3.py decides when).

Between uses a parameter's `.data` is an empty tensor. A gather allgathers every rank's shard into one flat buffer
per dtype and points the parameters at views of it; a release resizes that buffer's storage to 0, so that tensors
autograd saved from it stay valid views, which the next gather fills again."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet
from hvdplus.common.sharding import DtypePartition, partition
from hvdplus.torch.buffers import as_numpy, dtype_name

__all__ = ["Unit", "ROOT", "PERSISTENT", "empty_like_dtype", "add_gradient"]

ROOT, PERSISTENT = "<root>", "<persistent>"  # the model's own unit; the parameters kept whole on every rank


class Unit:
    """The parameters one module owns, flattened per (dtype, trainable) and split over the ranks."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module | None,
        named: list[tuple[str, torch.nn.Parameter]],
        size: int,
        index: int,
        param_dtype: torch.dtype | None,
        persistent: bool,
    ) -> None:
        self.name, self.module, self.persistent = name, module, persistent
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.plan: list[DtypePartition] = partition(
            [p.numel() for p in self.params], [(p.dtype, p.requires_grad) for p in self.params], size
        )
        self.index = index
        self.shards = [torch.empty(part.counts[index], dtype=part.kind[0]) for part in self.plan]
        compute = [
            param_dtype if param_dtype is not None and part.kind[0].is_floating_point else part.kind[0]
            for part in self.plan
        ]
        self.full = [torch.empty(part.total, dtype=dtype) for part, dtype in zip(self.plan, compute)]
        for buffer in self.full:  # never touched: no page of it was resident
            buffer.untyped_storage().resize_(0)
        self.gathered = False
        self.pending: list[Any] = []  # (handle, sent) of a gather in flight

    @property
    def is_root(self) -> bool:
        """The model's own unit: parameters no other unit owns, or that several share."""
        return self.name == ROOT

    def nbytes(self) -> int:
        """Bytes of this rank's shards."""
        return sum(s.numel() * s.element_size() for s in self.shards)

    def fill_from_parameters(self) -> None:
        """Copy the parameters' current (whole) values into `full`, and point the parameters at it."""
        for buffer in self.full:
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                for i, offset, numel in zip(part.params, part.offsets, part.numels):
                    self.full[k][offset : offset + numel].copy_(self.params[i].detach().reshape(-1))
        self.point_at_full()

    def point_at_full(self) -> None:
        """Make the parameters views of `full`, with the gradients they held when released."""
        for k, part in enumerate(self.plan):
            for i, offset, numel in zip(part.params, part.offsets, part.numels):
                p = self.params[i]
                p.data = self.full[k][offset : offset + numel].view(self.shapes[i])
                p.grad = getattr(p, "_hvdplus_released_grad", None)
                p._hvdplus_released_grad = None  # type: ignore[attr-defined]
        self.gathered = True

    def take_own_slices(self) -> None:
        """Copy this rank's range of the parameters' whole values (in their own dtype) into the shards."""
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                start, end = part.shard(self.index)
                for piece in part.pieces(start, end):
                    source = self.params[piece.param].detach().reshape(-1)[piece.start : piece.start + piece.length]
                    self.shards[k][piece.offset - start : piece.offset - start + piece.length].copy_(source)

    def keep_own_slices(self) -> None:
        """Copy this rank's range of `full` into the shards (after `full` holds the whole unit)."""
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                start, end = part.shard(self.index)
                self.shards[k].copy_(self.full[k][start:end])

    def release(self) -> None:
        """Free the gathered buffer: the parameters become empty tensors, the storage is resized to 0 (views that
        autograd saved stay valid and see the next gather)."""
        if self.persistent or not self.gathered:
            return
        for p in self.params:
            p._hvdplus_released_grad, p.grad = p.grad, None  # type: ignore[attr-defined]
        self.empty_parameters()
        for buffer in self.full:
            buffer.untyped_storage().resize_(0)
        self.gathered = False

    def empty_parameters(self) -> None:
        """Point every parameter at an empty tensor of the dtype a gather gives it."""
        for k, part in enumerate(self.plan):
            for i in part.params:
                self.params[i].data = empty_like_dtype(self.full[k].dtype)

    def start_gather(self, names: Callable[[], str], process_set: ProcessSet) -> None:
        """Allgather every rank's shards into `full` (non-blocking; `finish_gather` waits), each partition under
        the next positional name."""
        for k, part in enumerate(self.plan):
            buffer = self.full[k]
            buffer.untyped_storage().resize_(part.total * buffer.element_size())
            sent = self.shards[k] if self.shards[k].dtype == buffer.dtype else self.shards[k].to(buffer.dtype)
            handle = core.submit_allgather(
                as_numpy(sent),
                dtype_name(buffer),
                names(),
                process_set=process_set,
                counts=part.counts,
                output=_unguarded_numpy(buffer),
                tag=f"gather of unit {self.name!r}",
            )
            self.pending.append((handle, sent))

    def finish_gather(self) -> None:
        """Wait for the gather in flight and point the parameters at the whole values."""
        pending, self.pending = self.pending, []
        for handle, _ in pending:
            handle.wait()
        self.point_at_full()


def empty_like_dtype(dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of `dtype`: what a released parameter's `.data` is."""
    return torch.empty(0, dtype=dtype)


def add_gradient(p: torch.Tensor, grad: torch.Tensor) -> None:
    """p.grad += grad outside autograd (a pipeline's earlier micro-batches), also while `p` is a released ZeRO-3
    parameter: its gradient then waits beside it until the unit is gathered again."""
    with torch.no_grad():
        if getattr(p, "_hvdplus_zero3", None) is not None and p.numel() != grad.numel():
            held = getattr(p, "_hvdplus_released_grad", None)
            p._hvdplus_released_grad = grad if held is None else held.add_(grad)  # type: ignore[attr-defined]
        elif p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)


def _unguarded_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor that leaves its storage resizable (`Tensor.numpy()` pins it
    for good). Only for buffers whose storage stays put while the view is in use: a gather in flight."""
    kind = as_numpy(torch.empty(0, dtype=tensor.dtype)).dtype
    raw = (ctypes.c_byte * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return np.frombuffer(memoryview(raw), dtype=kind)
