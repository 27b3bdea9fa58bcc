"""The message table: which rank announced which collective, and which are ready to run.

Every rank holds an identical copy (each applies the same allgathered announcements in the same
order), so every rank reaches the same decisions, errors included, without a coordinator rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

from hvdplus.common.messages import Key, Request, Response
from hvdplus.common.ops import OpKind

__all__ = ["MessageTable", "Stall", "validate", "device_kind", "JOIN_KEY"]

JOIN_KEY: Key = (0, "__hvdplus_join__")

_SAME_SHAPE = (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER)
_REDUCING = (OpKind.ALLREDUCE, OpKind.REDUCESCATTER)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _disagreement(values: Mapping[int, object]) -> str:
    """'rank 0 has X; ranks [1, 2] have Y', grouping ranks by value."""
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(str(value), []).append(rank)
    parts = [f"{_ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}" for value, ranks in groups.items()]
    return "; ".join(parts)


def device_kind(device: str) -> str:
    """'cpu' or 'cuda' from 'cuda:1': ranks pinned to different GPUs of their hosts still agree (as in Horovod,
    which only requires every rank to be on CPU or every rank on GPU)."""
    return device.split(":", 1)[0]


def validate(requests: Mapping[int, Request], members: tuple[int, ...]) -> str | None:
    """Return why these per-rank requests for one name cannot run together, or None if they can.

    A broadcast's `root` is a global rank (Horovod's rule, process sets included); it must be in `members`."""
    first = next(iter(requests.values()))
    what = f"{first.name!r}"

    def check(label: str, value: Callable[[Request], object]) -> str | None:
        values = {rank: value(req) for rank, req in requests.items()}
        if len(set(map(str, values.values()))) > 1:
            return f"Mismatched {label} for collective {what}: {_disagreement(values)}."
        return None

    for label, getter in (("collective operations", lambda r: r.kind.name.lower()),
                          ("data types", lambda r: r.dtype),
                          ("devices (CPU or GPU)", lambda r: device_kind(r.device))):
        problem = check(label, getter)
        if problem:
            return problem
    kind = first.kind
    checks: list[tuple[str, Callable[[Request], object]]] = []
    if kind in _REDUCING:
        checks += [("reduction ops", lambda r: r.op.name), ("prescale factors", lambda r: r.prescale),
                   ("postscale factors", lambda r: r.postscale)]
    if kind == OpKind.BROADCAST:
        checks.append(("root ranks", lambda r: r.root))
    if kind in _SAME_SHAPE:
        checks += [("shapes", lambda r: r.shape), ("shapes of the grouped tensors", lambda r: r.parts)]
    elif kind in (OpKind.ALLGATHER, OpKind.ALLTOALL):
        checks += [("ranks (number of dimensions)", lambda r: len(r.shape)),
                   ("trailing dimensions (all but the first)", lambda r: r.shape[1:])]
    for label, getter in checks:
        problem = check(label, getter)
        if problem:
            return problem
    if kind == OpKind.BROADCAST and first.root not in members:
        return (f"Invalid root rank {first.root} for broadcast {what}: it is not a member of the process set, "
                f"whose global ranks are {list(members)}.")
    return None


@dataclass(frozen=True)
class Stall:
    """A collective some ranks submitted long ago while others have not."""

    key: Key
    description: str
    submitted: tuple[int, ...]
    missing: tuple[int, ...]
    seconds: float


class MessageTable:
    """Announcements received so far, keyed by (process set, name), in arrival order."""

    def __init__(self) -> None:
        self._pending: dict[Key, dict[int, Request]] = {}
        self._since: dict[Key, float] = {}

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def joined(self) -> tuple[int, ...]:
        """Ranks that have called join() and not yet been released."""
        return tuple(self._pending.get(JOIN_KEY, {}))

    def add(self, rank: int, request: Request) -> str | None:
        """Record one announcement; return an error if `rank` already announced this name."""
        entry = self._pending.setdefault(request.key, {})
        self._since.setdefault(request.key, time.monotonic())
        if rank in entry:
            return f"rank {rank} submitted {request.describe()} twice before it completed"
        entry[rank] = request
        return None

    def take_ready(self, members: Callable[[int], tuple[int, ...]]) -> list[Response]:
        """Remove and return every entry all its members announced (or errors), in arrival order."""
        joined = set(self.joined)
        ready = []
        for key, entry in list(self._pending.items()):
            response = self._decide(key, entry, members(key[0]), joined)
            if response is not None:
                ready.append(response)
        ready += self._deadlocks(members)
        for response in ready:
            self._pending.pop(response.key, None)
            self._since.pop(response.key, None)
        return ready

    def _decide(self, key: Key, entry: dict[int, Request], members: tuple[int, ...],
                joined: set[int]) -> Response | None:
        first = next(iter(entry.values()))
        if key == JOIN_KEY:
            if set(entry) != set(members):
                return None
            return Response(key, first.kind, tuple(entry[r] for r in members), join_last_rank=list(entry)[-1],
                            members=members)
        missing = [r for r in members if r not in entry]
        if missing and not set(missing) <= joined:
            return None
        requests = tuple(entry.get(r) for r in members)
        if missing and first.kind != OpKind.ALLREDUCE:
            return Response(key, first.kind, requests, members=members, error=(
                f"{first.describe()} cannot run: {_ranks_text(missing)} called join(), "
                f"and only allreduce supports ranks that have joined."))
        strangers = sorted(set(entry) - set(members))
        if strangers:
            return Response(key, first.kind, requests, members=members, error=(
                f"{first.describe()} was submitted by {_ranks_text(strangers)}, which are not in process set "
                f"{key[0]} (members {list(members)})."))
        return Response(key, first.kind, requests, error=validate(entry, members), members=members)

    def _deadlocks(self, members: Callable[[int], tuple[int, ...]]) -> list[Response]:
        """Errors for one name submitted on two process sets by ranks that wait on each other.

        A rank never has one name in flight on two sets, so if the entry on set A waits for a rank
        that holds the name on set B, and B waits for a rank holding it on A, neither can finish.
        """
        by_name: dict[str, list[Key]] = {}
        for key in self._pending:
            by_name.setdefault(key[1], []).append(key)
        errors = []
        for name, keys in by_name.items():
            for i, key_a in enumerate(keys):
                for key_b in keys[i + 1:]:
                    a, b = self._pending[key_a], self._pending[key_b]
                    a_waits_on_b = any(r not in a and r in b for r in members(key_a[0]))
                    b_waits_on_a = any(r not in b and r in a for r in members(key_b[0]))
                    if a_waits_on_b and b_waits_on_a:
                        used = {r: f"process set {key_a[0]}" for r in a}
                        used.update({r: f"process set {key_b[0]}" for r in b})
                        message = f"Mismatched process sets for collective {name!r}: {_disagreement(used)}."
                        for key, entry in ((key_a, a), (key_b, b)):
                            errors.append(Response(key, next(iter(entry.values())).kind,
                                                   tuple(entry.get(r) for r in members(key[0])), error=message,
                                                   members=members(key[0])))
        return errors

    def stalls(self, older_than: float, members: Callable[[int], tuple[int, ...]]) -> list[Stall]:
        """Entries waiting longer than `older_than` seconds, with the ranks that are missing."""
        now = time.monotonic()
        found = []
        for key, entry in self._pending.items():
            waited = now - self._since[key]
            if waited >= older_than:
                missing = tuple(r for r in members(key[0]) if r not in entry)
                found.append(Stall(key, next(iter(entry.values())).describe(), tuple(entry), missing, waited))
        return found

    def drop(self, keys: list[Key]) -> None:
        """Forget entries (used when the job shuts down)."""
        for key in keys:
            self._pending.pop(key, None)
            self._since.pop(key, None)
