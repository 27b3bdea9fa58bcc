"""The planned path's communicators over torch.distributed (Gloo's, and NCCL's for engines/nccl.py): where a job's
groups meet in the store, and the meeting itself (so a member that died before arriving costs no timeout)."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

from hvdplus.common.engines.torch_collectives import TorchWork

__all__ = [
    "PlannedMeeting",
    "TorchPlannedGroup",
    "collective_work",
    "meet_in_store",
    "process_group_of",
    "store_incarnation",
]

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
    (`store_incarnation`)."""

    dist: Any
    backend: str
    store: Any
    incarnation: int
    rank: int

    def open(
        self, ranks: Sequence[int], key: int, timeout_s: float | None, alive: Callable[[], None]
    ) -> TorchPlannedGroup:
        """A group of `ranks` only, under a prefix of its own: the other ranks take no part (torch's new_group would
        need every rank of the job). A step's buckets start while a peer may still be busy (a checkpoint, say): no
        timeout but the stall shutdown time, if set; a long wait is reported as a stall (torch_collectives.py
        `TorchWork`). The members meet in the store first (meet_in_store): without it, torch's constructor would wait
        for a member that died before arriving as long as the group's timeout, a year without a stall limit."""
        dist = self.dist
        prefix = dist.PrefixStore(
            f"hvdplus/planned/{self.backend}/{self.incarnation}/{key}/{'.'.join(map(str, ranks))}/", self.store
        )
        timeout = _PLANNED_TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        group = meet_in_store(dist, self.backend, prefix, list(ranks).index(self.rank), len(ranks), timeout, alive)
        return TorchPlannedGroup(group, len(ranks))


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
    """The planned path's communicator: a process group of its own, apart from torch.distributed's registry (Gloo's
    threads move its collectives; NCCL, a stream of its own). The engine's data calls run on `pg`."""

    def __init__(self, pg: Any, size: int) -> None:
        self.pg, self.size = pg, size

    def close(self) -> None:
        self.pg = None  # the group's threads and connections go with its last reference


def process_group_of(group: Any) -> Any:
    """The process group an engine's collective runs on: a registered group itself, or a planned group's own."""
    return group.pg if isinstance(group, TorchPlannedGroup) else group


def collective_work(
    group: Any, work: Any, tensors: Any, then: Callable[[], None] | None = None, timed: bool = True
) -> TorchWork:
    """The `Work` of a collective an engine started on `group`. A negotiated group's wait calls `alive` itself when
    `timed` (the engine's waits may block the host: Gloo's); a planned group's always sleeps, watched from the side
    (torch_collectives.py `TorchWork`)."""
    return TorchWork(work, tensors, then, timed=timed and not isinstance(group, TorchPlannedGroup))
