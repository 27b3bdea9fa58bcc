"""torch.distributed collective helpers that the Gloo engine, the NCCL engine and the planned groups share: the
single-tensor allgather and reduce-scatter under their names in each torch release, uneven allgathers, which
Gloo runs only padded to equal parts, and a point-to-point transfer in flight as an engines.base.Work."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["WIDENED", "TensorTransfer", "all_gather_single", "gather_bytes", "padded_parts", "reduce_scatter_single"]

# Gloo cannot reduce these; they are widened for the reduction and narrowed back.
WIDENED = {"int16": np.int32, "uint16": np.int32}


def all_gather_single(dist: Any) -> Any:
    """torch.distributed's allgather into one tensor: `all_gather_single` since torch 2.13, which deprecates
    the `all_gather_into_tensor` of earlier releases (2.11 on the GPU machines has only that one)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single(dist: Any) -> Any:
    """Likewise `reduce_scatter_single` (torch 2.13), else `reduce_scatter_tensor`."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_bytes(
    dist: Any, send: Any, recv: Any, byte_counts: Sequence[int], group: Any, wait: Callable[[Any], None] | None = None
) -> None:
    """Allgather of flat uint8 tensors, byte_counts[r] bytes from rank r into `recv` end to end (`send` must not
    alias `recv`). Uneven parts travel padded to the longest: Gloo's allgather needs equal sizes. `wait`, if given,
    waits for the collective started asynchronously (else it blocks)."""
    uneven = len(set(byte_counts)) > 1
    if uneven:
        send, gathered, unpad = padded_parts(send, recv, byte_counts)
    into = gathered if uneven else recv
    if wait is None:
        all_gather_single(dist)(into, send, group=group)
    else:
        wait(all_gather_single(dist)(into, send, group=group, async_op=True))
    if uneven:
        unpad()


def padded_parts(send: Any, recv: Any, counts: Sequence[int]) -> tuple[Any, Any, Callable[[], None]]:
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


class TensorTransfer:
    """A torch.distributed send or receive and the tensor it reads or writes (a handles.Work). `wait` returns
    once it completed (Gloo: the host sleeps on a condition, no core spent, up to the engine's timeout) or, on NCCL,
    once the caller's current stream waits for it."""

    def __init__(self, work: Any, wire: Any, into: Any | None = None) -> None:
        """`into`: the device tensor a receive staged through host memory lands in, copied from `wire` once it has
        arrived."""
        self._work, self._wire, self._into = work, wire, into

    def done(self) -> bool:
        if not self._work.is_completed():
            return False
        self._finish()
        return True

    def wait(self, alive: Callable[[], None] | None = None) -> None:
        self._finish()

    def _finish(self) -> None:
        self._work.wait()  # raises the transfer's error; Gloo's timed wait would close the connection at its time
        if self._into is not None:
            into, self._into = self._into, None
            into.copy_(self._wire, non_blocking=True)  # the pinned block is kept until the copy ran
