"""The planned path's communicators over torch.distributed (Gloo's, and NCCL's for engines/nccl.py): where a job's
groups meet in the store, the meeting itself (so a member that died before arriving costs no timeout), the group's
asynchronous collectives and the watchdog that reports a stall while a wait sleeps in Gloo."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from hvdplus.common.engines.blocked_calls import BlockedCalls
from hvdplus.common.engines.torch_collectives import WIDENED, padded_parts
from hvdplus.common.ops import ReduceOp

__all__ = ["PlannedMeeting", "TorchPlannedGroup", "meet_in_store", "store_incarnation"]

log = logging.getLogger("hvdplus")

_PLANNED_TIMEOUT = datetime.timedelta(days=365)  # the planned path's groups: stalls are watched, not timed out


def store_incarnation(store: Any, size: int) -> int:
    """How many jobs of `size` ranks counted themselves in `store` before this one. A job's groups meet under it, so
    that a job started after `hvd.shutdown()` never reads its predecessor's keys from a store that outlived it
    (hvdplusrun's, a rendezvous file, or the user's torch.distributed store): each job's ranks all count before the
    next job's can, since shutdown is collective."""
    return (int(store.add("hvdplus/planned/incarnations", 1)) - 1) // size


@dataclasses.dataclass(frozen=True)
class PlannedMeeting:
    """Where a job's planned-path groups ('gloo' or 'nccl') meet: the job's `store`, under its `incarnation`
    (`store_incarnation`). `ops`: the engine's map from hvdplus's reduce ops to torch's; `tensor_of(buf, dtype)`:
    the caller's buffer as a tensor."""

    dist: Any
    backend: str
    store: Any
    incarnation: int
    rank: int
    ops: dict[ReduceOp, Any]
    tensor_of: Callable[[Any, str], Any]

    def open(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> TorchPlannedGroup:
        """A group of `ranks` only, under a prefix of its own: the other ranks take no part (torch's new_group would
        need every rank of the job). A step's buckets start while a peer may still be busy (a checkpoint, say): no
        timeout but the stall shutdown time, if set; a long wait is reported as a stall (_TorchPlannedWork).
        The members meet in the store first (meet_in_store): without it, torch's constructor would wait for a
        member that died before arriving as long as the group's timeout, a year without a stall limit."""
        dist = self.dist
        prefix = dist.PrefixStore(
            f"hvdplus/planned/{self.backend}/{self.incarnation}/{key}/{'.'.join(map(str, ranks))}/", self.store
        )
        timeout = _PLANNED_TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        group = meet_in_store(dist, self.backend, prefix, list(ranks).index(self.rank), len(ranks), timeout, alive)
        return TorchPlannedGroup(dist, group, len(ranks), self.ops, self.tensor_of)


def meet_in_store(
    dist: Any, backend: str, prefix: Any, index: int, size: int, timeout: datetime.timedelta, alive: Callable[[], None]
) -> Any:
    """A process group of `size` members only (this one member `index`), met under the `prefix` store: each says
    it is here and waits for the others with `alive()` between short waits (torch's constructor would wait for a
    member that died before arriving as long as the group's timeout), then builds the group on `backend`."""
    prefix.set(f"here/{index}", "1")
    _await_keys(prefix, [f"here/{member}" for member in range(size)], alive)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, index, size, options)
    import torch

    group = dist.ProcessGroupGloo(prefix, index, size, timeout)
    # Gloo's constructor can return on one rank while a peer still connects to it: a group dropped at once (an
    # optimizer made for one step) would close that connection under the peer. Leave once every pair is up.
    group.allreduce([torch.zeros(1)]).wait()
    return group


def _await_keys(store: Any, keys: list[str], alive: Callable[[], None]) -> None:
    """Return once every key is in `store`, checking it at growing intervals (1 ms to 50 ms: members usually
    arrive within milliseconds of each other) and calling `alive()` once a second. (`store.wait` with a timeout
    raises a different error for each kind of store, some only a RuntimeError saying "Wait timeout".)"""
    pause, last_alive = 1e-3, time.monotonic()
    while not store.check(keys):
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
        if time.monotonic() - last_alive >= 1.0:
            alive()
            last_alive = time.monotonic()


class TorchPlannedGroup:
    """The planned path's communicator: torch.distributed's asynchronous allreduce on a group of its own (Gloo's
    threads move it; NCCL, on a stream of its own)."""

    def __init__(
        self, dist: Any, group: Any, size: int, ops: dict[ReduceOp, Any], tensor_of: Callable[[Any, str], Any]
    ) -> None:
        """`ops`: the engine's map from hvdplus's reduce ops to torch's."""
        self._group, self.size, self._tensor_of = group, size, tensor_of
        self._options: dict[ReduceOp, Any] = {}
        for op, torch_op in ops.items():
            self._options[op] = dist.AllreduceOptions()
            self._options[op].reduceOp = torch_op

    def start_allreduce(self, buf: Any, dtype: str, op: ReduceOp) -> _TorchPlannedWork:
        if dtype in WIDENED:
            raise TypeError(f"the planned path does not reduce {dtype} over torch.distributed")
        tensor = self._tensor_of(buf, dtype)
        return _TorchPlannedWork(self._group.allreduce([tensor], self._options[op]), tensor)

    def start_reducescatter(self, buf: Any, dtype: str, counts: Sequence[int]) -> _TorchPlannedWork:
        """An allreduce of which this rank keeps its run: Gloo's reduce-scatter measured 3x slower than its
        allreduce here (TorchDistEngine.reducescatter)."""
        return self.start_allreduce(buf, dtype, ReduceOp.SUM)

    def start_allgather(self, buf: Any, dtype: str, counts: Sequence[int]) -> _TorchPlannedWork:
        """Each member's run travels padded to the longest (gather_bytes), and the runs move back into `buf` once
        complete."""
        tensor, index = self._tensor_of(buf, dtype), self._group.rank()
        start = int(sum(counts[:index]))
        padded, gathered, unpad = padded_parts(tensor[start : start + counts[index]], tensor, counts)
        return _TorchPlannedWork(self._group._allgather_base(gathered, padded), (tensor, padded, gathered), unpad)

    def close(self) -> None:
        self._group = None  # the group's threads and connections go with its last reference


class _TorchPlannedWork:
    """A planned allreduce in flight. Over Gloo, `wait` sleeps on it (no core spent, woken the moment it
    completes); over NCCL, it makes the caller's current stream wait for it and returns. A wait that lasts is
    watched from the side (`_WATCHDOG`): Gloo's timed wait, the other way to look up now and then, costs ~0.4 ms
    more per wait here, and polling more still on a busy host."""

    def __init__(self, work: Any, tensors: Any, then: Callable[[], None] | None = None) -> None:
        """`tensors` stay alive until the work completes; `then` runs once, after it has."""
        self._work, self._tensors, self._then = work, tensors, then

    def done(self) -> bool:
        if not self._work.is_completed():
            return False
        self._work.wait()  # raises the collective's error, if it failed
        self._then_once()
        return True

    def wait(self, alive: Callable[[], None] | None = None) -> None:
        if alive is None or self._work.is_completed():
            self._work.wait()
        else:
            _WATCHDOG.watch(alive)
            try:
                self._work.wait()
            finally:
                _WATCHDOG.watch(None)
        self._then_once()

    def _then_once(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()


# Calls the `alive` of a planned wait in progress once a second, so that a stall is still reported while the waiting
# thread sleeps in Gloo. Its verdict is logged, once a wait: the wait itself ends by Gloo's own timeout
# (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) or a peer's error.
_WATCHDOG = BlockedCalls("hvdplus-planned-watchdog", lambda error: log.warning("%s", error))
