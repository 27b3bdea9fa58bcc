"""Single-process engine: every collective of a job of one rank is a local copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import numpy as np

from hvdplus.common.handles import Completed
from hvdplus.common.ops import ReduceOp

__all__ = ["LocalEngine"]

_T = TypeVar("_T")

_COMPLETE = Completed()  # every collective of one rank: its buffers hold the result once it is started


class LocalEngine:
    """The engine of a job with one rank (a script run without a launcher, as Horovod allows)."""

    name = "local"
    alone_bytes: int | None = 1 << 20  # one rank: nothing travels, so nothing is worth a copy
    bucket_bytes = 1 << 20
    rank = 0
    size = 1
    world = "world"

    def new_group(self, ranks: Sequence[int]) -> str:
        return "world"

    def start_allreduce(
        self, buf: np.ndarray, dtype: str, op: ReduceOp, group: object, send: np.ndarray | None = None
    ) -> Completed:
        if send is not None:
            np.copyto(buf, send)
        return _COMPLETE

    def start_allgather(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], group: object
    ) -> Completed:
        if send is not None:  # None: in place, this rank's part (all of it) is already in recv
            recv[...] = send
        return _COMPLETE

    def start_broadcast(self, buf: np.ndarray, root: int, group: object) -> Completed:
        return _COMPLETE

    def start_alltoall(
        self, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray, recv_counts: Sequence[int], group: object
    ) -> Completed:
        recv[...] = send
        return _COMPLETE

    def start_reducescatter(
        self, send: np.ndarray | None, recv: np.ndarray, counts: Sequence[int], dtype: str, op: ReduceOp, group: object
    ) -> Completed:
        if send is not None:  # None: in place, recv holds the input and this rank's slice is all of it
            recv[...] = send
        return _COMPLETE

    def start_barrier(self, group: object) -> Completed:
        return _COMPLETE

    def start_sendrecv(
        self, send: np.ndarray, recv: np.ndarray, peer: int, group: object, source: int | None = None
    ) -> Completed:
        recv[...] = send
        return _COMPLETE

    def allgather_bytes(self, data: bytes, group: str) -> list[bytes]:
        return [data]

    def run_watched(self, call: Callable[[], _T], alive: Callable[[], None] | None) -> _T:
        return call()  # one rank: nothing waits for a peer

    def start_bitwise_and(self, words: np.ndarray, group: str, spin_s: float = 0.0) -> Completed:
        return Completed(words.copy())

    def send_beacon(self, round_number: int, stream: int = 0, peers: Sequence[int] | None = None) -> None:
        return None

    def beacons(self, stream: int = 0, peers: Sequence[int] | None = None) -> dict[int, int]:
        return {}

    def announce_failure(self, message: str) -> None:
        return None

    def failures(self) -> dict[int, str]:
        return {}

    def open_doorbell(self, on_ring: Callable[[], None], ranks: Sequence[int] | None = None) -> LocalDoorbell:
        return LocalDoorbell()

    def open_channel(self) -> LocalChannel:
        return LocalChannel()

    def open_planned(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> LocalPlannedGroup:
        return LocalPlannedGroup()

    def shutdown(self) -> None:
        return None


class LocalDoorbell:
    """A one-rank job's doorbell: no peer ever rings, and ringing reaches nobody."""

    polled = False

    def ring(self, round_number: int) -> None:
        return None

    def rung(self, round_number: int) -> bool:
        return False

    def close(self) -> None:
        return None


class LocalChannel:
    """The channel of a one-rank job: there is nobody to send to."""

    max_tag = 2**31 - 1

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> NoReturn:
        raise ValueError(f"a job of one rank has no rank {peer} to send to")

    irecv = isend

    def close(self) -> None:
        return None


class LocalPlannedGroup:
    """A one-rank planned group: the engine's collectives on it leave every buffer as it is, complete at once."""

    size = 1

    def close(self) -> None:
        return None
