"""torch.distributed pieces that the Gloo engine and the NCCL engine share: the single-tensor allgather under its
name in each torch release, uneven allgathers, which Gloo runs only padded to equal
parts, and a collective (`TorchWork`) or point-to-point transfer in flight as a handles.Work, with the waits that
report a stall."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from hvdplus.common.engines.blocked_calls import BlockedCalls
from hvdplus.common.handles import ALIVE_EVERY_S

__all__ = [
    "WIDENED",
    "TensorTransfer",
    "TorchWork",
    "all_gather_single",
    "padded_parts",
    "reduce_options",
    "start_gather",
    "wait_work",
]

log = logging.getLogger("hvdplus")

# Gloo cannot reduce these; they are widened for the reduction and narrowed back.
WIDENED = {"int16": np.int32, "uint16": np.int32}


def all_gather_single(dist: Any) -> Any:
    """torch.distributed's allgather into one tensor: `all_gather_single` since torch 2.13, which deprecates
    the `all_gather_into_tensor` of earlier releases (2.11 on the GPU machines has only that one)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_gather(pg: Any, send: Any, recv: Any, counts: Sequence[int]) -> tuple[Any, Any, Callable[[], None] | None]:
    """Start an allgather of flat tensors on the process group `pg` (registered or a planned group's), counts[r]
    elements from rank r into `recv` end to end (`send` must not alias `recv`): (the work, the tensors it holds,
    what to run once it completed). Uneven parts travel padded to the longest: Gloo's allgather needs equal sizes."""
    if len(set(counts)) > 1:
        padded, gathered, unpad = padded_parts(send, recv, counts)
        return pg._allgather_base(gathered, padded), (padded, gathered, recv), unpad
    return pg._allgather_base(recv, send), (recv, send), None


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


class TorchWork:
    """A torch.distributed collective in flight (a handles.Work) and the tensors it reads or writes, alive until
    it completes; `then` runs once, after it has (a widened reduction narrowed back, an uneven gather unpadded).

    Over Gloo the host sleeps on it, no core spent, woken the moment it completes; over NCCL `wait` makes the
    caller's current stream wait for it and returns. How a long wait is reported: a `timed` wait (the negotiated
    path's host collectives) wakes each `ALIVE_EVERY_S` to call `alive`, which may raise to end it; an untimed one
    (a planned group's, and a device plane's, where NCCL's timed wait would block the host until the GPU drained)
    sleeps in torch while `_WATCHDOG` calls `alive` from the side and logs its verdict: the wait itself ends by the
    group's own timeout (a planned group's: the stall shutdown time; a device plane's: HVDPLUS_TIMEOUT) or a peer's
    error."""

    __slots__ = ("_work", "_tensors", "_then", "_timed")

    def __init__(self, work: Any, tensors: Any, then: Callable[[], None] | None = None, timed: bool = False) -> None:
        self._work, self._tensors, self._then, self._timed = work, tensors, then, timed

    def followed_by(self, step: Callable[[], None]) -> TorchWork:
        """This work, with `step` run once it completed, after its own `then`."""
        first = self._then
        self._then = step if first is None else partial(_in_turn, first, step)
        return self

    def done(self) -> bool:
        if not self._work.is_completed():
            return False
        self._work.wait()  # raises the collective's error, if it failed
        self._then_once()
        return True

    def wait(self, alive: Callable[[], None] | None = None) -> None:
        if self._timed:
            wait_work(self._work, alive)
        else:
            _WATCHDOG.run(self._work.wait, None if self._work.is_completed() else alive)
        self._then_once()

    def _then_once(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _in_turn(*steps: Callable[[], None]) -> None:
    for step in steps:
        step()


def reduce_options(make: Callable[[], Any], ops: dict[Any, Any]) -> dict[Any, Any]:
    """torch's options of a reduction (`make`: `AllreduceOptions`, `ReduceScatterOptions`) for each of an engine's
    reduce ops (`ops`: hvdplus's op -> torch's), made once: a process group's own calls take them, without
    torch.distributed's per-call checks."""
    options = {}
    for op, torch_op in ops.items():
        options[op] = make()
        options[op].reduceOp = torch_op
    return options


# Calls the `alive` of an untimed wait in progress once a second, so that a stall is still reported while the
# waiting thread sleeps in torch.
_WATCHDOG = BlockedCalls("hvdplus-torch-watchdog", lambda error: log.warning("%s", error))


def wait_work(work: Any, alive: Callable[[], None] | None) -> None:
    """Wait for a torch.distributed collective's work on Gloo: it sleeps on the completion, waking each
    `ALIVE_EVERY_S` to call `alive` if given; raises the collective's error. Collectives only: a timed wait that
    expires on a point-to-point work closes its connection ("Application timeout caused pair closure")."""
    if alive is not None:
        while not _completes_within(work, ALIVE_EVERY_S):
            alive()
    work.wait()  # returns at once once completed, or raises the collective's error


def _completes_within(work: Any, seconds: float) -> bool:
    try:  # Gloo's timed wait raises when the time is up, and leaves the collective running
        work.wait(datetime.timedelta(seconds=seconds))
    except RuntimeError:  # the time was up, or the collective failed (then it is completed)
        return bool(work.is_completed())
    return True
