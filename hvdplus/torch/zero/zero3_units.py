"""A ZeRO-3 unit: the parameters one module owns, flattened per (dtype, trainable) and split over the ranks, with
the flat buffers a gather fills and a release frees (zero3.py decides when).

Between uses a parameter's `.data` is an empty tensor. A gather allgathers every rank's shard into one flat buffer
per dtype and points the parameters at views of it; a release resizes that buffer's storage to 0, so that tensors
autograd saved from it stay valid views, which the next gather fills again.

The shards and the flat buffers live on the unit's `device` (the model's: a GPU, or the CPU); with
`offload="parameters"` the shards live in (pinned) host memory instead, and a gather first copies this rank's shard
to the device on a side stream. On a device plane (NCCL; Gloo on CPU tensors under HVDPLUS_DEVICE_PATH_ON_CPU=1)
the gather takes the tensors themselves; on the host plane, numpy views of host memory (a GPU buffer without a
plane is staged through pinned host memory). Stream order on CUDA: the core's handle makes the compute stream wait
for the gather, and a buffer is only released (its storage freed on the compute stream) after that wait, so the
caching allocator never hands out memory a collective still writes."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, runtime
from hvdplus.common.plans.sharding import DtypePartition, partition
from hvdplus.torch.buffers import as_numpy, collective_input, dtype_name, in_host_memory, plane_kind
from hvdplus.torch.streams import SideStream, host_empty, wait_for

__all__ = ["Unit", "ROOT", "PERSISTENT", "OFFLOADS", "empty_like_dtype", "add_gradient"]

ROOT, PERSISTENT = "<root>", "<persistent>"  # the model's own unit; the parameters kept whole on every rank
OFFLOADS = (None, "parameters")  # what shard_parameters(offload=...) takes

_CPU = torch.device("cpu")


class Unit:
    """The parameters one module owns, flattened per (dtype, trainable) and split over the ranks.

    `device`: where the unit computes (its flat buffers `full`, and its shards unless offloaded). `offload`:
    "parameters" keeps the shards in host memory (pinned for a GPU), copied to `device` on `copies` at each gather;
    the persistent unit is never offloaded (its parameters are small, and whole on the device anyway)."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module | None,
        named: list[tuple[str, torch.nn.Parameter]],
        size: int,
        index: int,
        param_dtype: torch.dtype | None,
        persistent: bool,
        device: torch.device = _CPU,
        offload: str | None = None,
        copies: SideStream | None = None,
    ) -> None:
        self.name, self.module, self.persistent = name, module, persistent
        self.device = device
        self.offload = None if persistent else offload
        self.copies = copies if copies is not None else SideStream(device)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.plan: list[DtypePartition] = partition(
            [p.numel() for p in self.params], [(p.dtype, p.requires_grad) for p in self.params], size
        )
        self.index = index
        self.shards = [
            host_empty(part.counts[index], part.kind[0], device)
            if self.offload
            else torch.empty(part.counts[index], dtype=part.kind[0], device=device)
            for part in self.plan
        ]
        compute = [
            param_dtype if param_dtype is not None and part.kind[0].is_floating_point else part.kind[0]
            for part in self.plan
        ]
        # Sized at the first gather (a GPU allocates at once what the CPU only reserves).
        self.full = [torch.empty(0, dtype=dtype, device=device) for dtype in compute]
        self.gathered = False
        self.pending: list[tuple[int, Any, Any, torch.Tensor | None]] = []  # (k, handle, sent, staged) in flight

    @property
    def is_root(self) -> bool:
        """The model's own unit: parameters no other unit owns, or that several share."""
        return self.name == ROOT

    def nbytes(self) -> int:
        """Bytes of this rank's shards."""
        return sum(s.numel() * s.element_size() for s in self.shards)

    def fill_from_parameters(self) -> None:
        """Copy the parameters' current (whole) values into `full`, and point the parameters at it."""
        for k in range(len(self.plan)):
            self._allocate(k)
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
        autograd saved stay valid and see the next gather). Never while a gather is in flight (`pending`): the
        collective still writes into that storage."""
        if self.persistent or not self.gathered:
            return
        for p in self.params:
            p._hvdplus_released_grad, p.grad = p.grad, None  # type: ignore[attr-defined]
        self.empty_parameters()
        for buffer in self.full:
            buffer.untyped_storage().resize_(0)
        self.gathered = False

    def empty_parameters(self) -> None:
        """Point every parameter at an empty tensor of the dtype a gather gives it, on the unit's device."""
        for k, part in enumerate(self.plan):
            for i in part.params:
                self.params[i].data = empty_like_dtype(self.full[k].dtype, self.device)

    # ------------------------------------------------------------------ gathers
    def start_gather(self, names: Callable[[], str], process_set: ProcessSet) -> None:
        """Allgather every rank's shards into `full` (non-blocking; `finish_gather` waits), each partition under
        the next positional name. Out of memory: every rank raises (see `_fail_gather`), none waits."""
        for k in range(len(self.plan)):
            try:
                sent = self._sendable(k)
                self._allocate(k)
            except torch.OutOfMemoryError as error:
                self._fail_gather(k, names, process_set, error)
            self.pending.append(self._submit(k, sent, names(), process_set))

    def _sendable(self, k: int) -> torch.Tensor:
        """This rank's shard of partition `k` on the device, in the compute dtype: the shard itself when it is
        one; offloaded, a copy made on the side stream, which the compute stream (and so the collective submitted
        from it) waits for."""
        shard, dtype = self.shards[k], self.full[k].dtype
        if not self.offload:
            return shard if shard.dtype == dtype else shard.to(dtype)
        sent = torch.empty(shard.numel(), dtype=dtype, device=self.device)
        with self.copies.after_current():
            sent.copy_(shard, non_blocking=True)
        wait_for(self.copies.record(), self.device)
        return sent

    def _allocate(self, k: int) -> None:
        """Give `full[k]` its storage back (and, the first time, its size)."""
        buffer, total = self.full[k], self.plan[k].total
        storage = buffer.untyped_storage()
        if storage.nbytes() != total * buffer.element_size():
            storage.resize_(total * buffer.element_size())
        if buffer.numel() != total:
            with torch.no_grad():
                buffer.set_(storage, 0, (total,), (1,))

    def _submit(self, k: int, sent: torch.Tensor, name: str, process_set: ProcessSet) -> tuple:
        """Submit partition `k`'s allgather: tensors on a device plane, numpy views of host memory otherwise."""
        part, full = self.plan[k], self.full[k]
        send, device = collective_input(sent)
        staged = None
        if plane_kind(full) is not None:
            output: Any = collective_input(full)[0]
        elif in_host_memory(full):
            output = _unguarded_numpy(full)
        else:  # a GPU without a device plane (HOROVOD_GPU_OPERATIONS=mpi): through host memory
            staged = host_empty(part.total, full.dtype, full.device)
            output = as_numpy(staged)
        handle = core.submit_allgather(
            send,
            dtype_name(full),
            name,
            process_set=process_set,
            counts=part.counts,
            output=output,
            device=device,
            tag=f"gather of unit {self.name!r}",
        )
        return k, handle, sent, staged

    def finish_gather(self) -> None:
        """Wait for the gather in flight and point the parameters at the whole values (on CUDA the compute stream
        waits for the collective, not the host)."""
        pending, self.pending = self.pending, []
        for k, handle, _sent, staged in pending:
            handle.wait()
            if staged is not None:
                self.full[k].copy_(staged, non_blocking=True)
        self.point_at_full()

    def _fail_gather(self, k: int, names: Callable[[], str], process_set: ProcessSet, error: BaseException) -> NoReturn:
        """Out of memory before partition `k`'s gather: submit it and the rest under their names, empty and tagged
        as failed, so that every rank's gather of this unit raises (the tags differ) instead of waiting for this
        rank; then raise the OutOfMemoryError naming the unit."""
        tag = f"gather of unit {self.name!r} (out of memory on rank {runtime().rank})"
        for j in range(k, len(self.plan)):
            send, device = collective_input(torch.empty(0, dtype=self.full[j].dtype, device=self.device))
            core.submit_allgather(
                send,
                dtype_name(self.full[j]),
                names(),
                process_set=process_set,
                counts=self.plan[j].counts,
                device=device,
                tag=tag,
            )
        self.pending = []  # the partitions before `k` complete unwaited; `full` is kept (they write into it)
        whole = sum(part.total * buffer.element_size() for part, buffer in zip(self.plan, self.full))
        raise torch.OutOfMemoryError(
            f"out of memory while gathering ZeRO-3 unit {self.name!r} ({whole} bytes on {self.device}); the "
            f"other ranks raise too. Lower max_live_units or prefetch, shard smaller units, or keep the shards in "
            f"host memory (hvd.shard_parameters(..., offload='parameters')). {error}"
        ) from error


def empty_like_dtype(dtype: torch.dtype, device: torch.device = _CPU) -> torch.Tensor:
    """An empty tensor of `dtype` on `device`: what a released parameter's `.data` is."""
    return torch.empty(0, dtype=dtype, device=device)


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
