"""The Engine protocol: the few collectives hvdplus composes, over a maintained library.

Buffers are flat, C-contiguous numpy arrays in host memory; `dtype` names the logical type
(bfloat16 travels as uint16 storage). Ranks and roots are indices within `group`.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from hvdplus.common.ops import ReduceOp

__all__ = ["Engine", "Group"]

Group = Any  # an engine-specific communicator handle


@runtime_checkable
class Engine(Protocol):
    """A transport for collectives among the ranks of a job."""

    name: str
    rank: int
    size: int
    world: Group

    def new_group(self, ranks: Sequence[int]) -> Group:
        """Collective over all ranks: a communicator of `ranks` (None on ranks outside it)."""

    def allreduce(self, buf: np.ndarray, dtype: str, op: ReduceOp, group: Group,
                  send: np.ndarray | None = None) -> None:
        """Reduce `send` (default: `buf` itself) across `group` into `buf` (op is SUM, MIN, MAX or PRODUCT)."""

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], group: Group) -> None:
        """Concatenate every rank's `send` (counts[r] elements from rank r) into `recv`."""

    def broadcast(self, buf: np.ndarray, root: int, group: Group) -> None:
        """Copy root's `buf` into `buf` on every rank."""

    def alltoall(self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
                 recv_counts: Sequence[int], group: Group) -> None:
        """Send send_counts[r] elements to rank r and receive recv_counts[r] from it."""

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], dtype: str,
                      op: ReduceOp, group: Group) -> None:
        """Reduce `send` across `group`; rank r keeps the counts[r] elements of its slice in `recv`."""

    def barrier(self, group: Group) -> None:
        """Return once every rank of `group` has entered."""

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group) -> None:
        """Point to point: send `send` to rank `peer` of `group` and receive its buffer into `recv` (same size)."""

    def allgather_bytes(self, data: bytes, group: Group) -> list[bytes]:
        """Control plane: every rank's `data`, in rank order."""

    def bitwise_and(self, words: np.ndarray, group: Group) -> np.ndarray:
        """Control plane: the bitwise AND of an int64 vector across `group`."""

    def shutdown(self) -> None:
        """Release the engine's resources (process groups, communicators)."""
