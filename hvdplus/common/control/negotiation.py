"""The message table: which rank announced which collective, and which are ready to run.

Every rank holds an identical copy (each applies the same allgathered announcements in the same
order), so every rank reaches the same decisions, errors included, without a coordinator rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hvdplus.common.bitmask import bits, mask_of
from hvdplus.common.control.messages import Key, Request, Response, SameRequest
from hvdplus.common.ops import OpKind

__all__ = [
    "MessageTable",
    "Stall",
    "validate",
    "device_kind",
    "disagreement",
    "JOIN_KEY",
    "NOT_WITH_JOIN",
    "is_join",
    "join_key",
]

JOIN_KEY: Key = (0, "__hvdplus_join__")  # join() on the whole job; a process set's rounds join under its own id


def join_key(set_id: int) -> Key:
    """The key of join in the rounds of `set_id`: JOIN_KEY in the whole job's, a name of its own in a process
    set's (this rank's join() is in flight in both at once, and names are unique on a rank)."""
    return JOIN_KEY if set_id == 0 else (set_id, f"{JOIN_KEY[1]}.{set_id}")


def is_join(key: Key) -> bool:
    """Whether `key` is a join's, in the whole job's rounds or a process set's."""
    return key == join_key(key[0])


_SAME_SHAPE = (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER)
# Horovod's words (controller.cc, ConstructResponse) for the collectives that fail while a member has joined.
NOT_WITH_JOIN = {
    OpKind.ALLGATHER: "Allgather is not supported with Join at this time. "
    "Specify sparse_to_dense=True if using DistributedOptimizer",
    OpKind.ALLTOALL: "Alltoall is not supported with Join at this time.",
    OpKind.REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
    OpKind.BROADCAST: "Broadcast is not supported with Join at this time.",
}
_REDUCING = (OpKind.ALLREDUCE, OpKind.REDUCESCATTER)


def _ranks_of(mask: int) -> list[int]:
    return list(bits(mask))


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def disagreement(values: Mapping[int, object]) -> str:
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


def validate(variants: Mapping[Request, int], members: tuple[int, ...]) -> str | None:
    """Return why these announcements of one name cannot run together, or None if they can.

    `variants` maps each distinct request to the mask of ranks that announced it; ranks that agree share one
    entry, so the usual case (one variant) costs the same at any job size. A broadcast's `root` is a global rank
    (Horovod's rule, process sets included); it must be in `members`."""
    first = next(iter(variants))
    what = f"{first.name!r}"

    def check(label: str, value: Callable[[Request], object]) -> str | None:
        values = {request: str(value(request)) for request in variants}
        if len(set(values.values())) > 1:
            by_rank = {rank: values[request] for request, mask in variants.items() for rank in _ranks_of(mask)}
            return f"Mismatched {label} for collective {what}: {disagreement(dict(sorted(by_rank.items())))}."
        return None

    checks: list[tuple[str, Callable[[Request], object]]] = [
        ("numbers of tensors in the grouped call", lambda r: r.group),
        ("subjects", lambda r: r.tag),
        ("collective operations", lambda r: r.kind.name.lower()),
        ("data types", lambda r: r.dtype),
        ("devices (CPU or GPU)", lambda r: device_kind(r.device)),
    ]
    kind = first.kind
    if kind in _REDUCING:
        checks += [
            ("reduction ops", lambda r: r.op.name),
            ("prescale factors", lambda r: r.prescale),
            ("postscale factors", lambda r: r.postscale),
        ]
    if kind == OpKind.BROADCAST:
        checks.append(("root ranks", lambda r: r.root))
    if kind in _SAME_SHAPE:
        checks += [("shapes", lambda r: r.shape), ("shapes of the grouped tensors", lambda r: r.parts)]
    elif kind in (OpKind.ALLGATHER, OpKind.ALLTOALL):
        checks += [
            ("ranks (number of dimensions)", lambda r: len(r.shape)),
            ("trailing dimensions (all but the first)", lambda r: r.shape[1:]),
        ]
    if kind in (OpKind.REDUCESCATTER, OpKind.ALLGATHER):
        checks.append(("per-rank counts", lambda r: r.splits))
    if len(variants) > 1:
        for label, getter in checks:
            problem = check(label, getter)
            if problem:
                return problem
    if kind == OpKind.ALLGATHER and first.splits is not None:
        sent = {rank: request.nelements for request, mask in variants.items() for rank in _ranks_of(mask)}
        wrong = {rank: n for rank, n in sorted(sent.items()) if n != first.splits[members.index(rank)]}
        if wrong:
            return (
                f"Mismatched counts for allgather {what}: the counts are {list(first.splits)}, but "
                + "; ".join(f"rank {rank} sent {n} elements" for rank, n in wrong.items())
                + "."
            )
    if kind == OpKind.BROADCAST and first.root not in members:
        return (
            f"Invalid root rank {first.root} for broadcast {what}: it is not a member of the process set, "
            f"whose global ranks are {list(members)}."
        )
    return None


def _member_index(key: Key) -> int:
    """The index of a grouped call's member from its name (naming.member_names: '<call>.<index>')."""
    return int(key[1].rsplit(".", 1)[1])


def _join_error(request: Request, joined: int) -> str:
    """Why a collective other than allreduce fails while the ranks of mask `joined` have joined (Horovod's
    message first, so that code matching it keeps working)."""
    who = f"{_ranks_text(_ranks_of(joined))} called join(), and only allreduce runs while ranks have joined"
    known = NOT_WITH_JOIN.get(request.kind)
    if known is not None:
        return f"{known} ({request.describe()}: {who})."
    return f"{request.describe()} cannot run: {who}."


@dataclass(frozen=True)
class Stall:
    """A collective some ranks submitted long ago while others have not."""

    key: Key
    description: str
    submitted: tuple[int, ...]
    missing: tuple[int, ...]
    seconds: float


class MessageTable:
    """Announcements received so far, keyed by (process set, name), in arrival order.

    Each entry maps every distinct request to the bit mask of the ranks that announced it, so an entry that
    all N ranks agree on is one request and one integer, and readiness is a mask test: the table's cost
    follows the number of names, not the number of ranks."""

    def __init__(self, join_key: Key = JOIN_KEY) -> None:
        """`join_key`: the key of join in the rounds this table serves (the world's, or a process set's own)."""
        self._join_key = join_key
        self._pending: dict[Key, dict[Request, int]] = {}
        self._announced: dict[Key, int] = {}
        self._latest: dict[Key, int] = {}  # the ranks of each entry's most recent announcement
        self._since: dict[Key, float] = {}
        self._member_masks: dict[int, int] = {}
        # Grouped calls whose ranks grouped different numbers of tensors: (set, call) -> (the error, indices of the
        # members only some ranks submitted, not failed yet). Those members fail too, now or when announced, so
        # that none is left waiting for ranks that grouped fewer tensors.
        self._failed_calls: dict[tuple[int, str], tuple[str, set[int]]] = {}
        # This round's shadows: a rank missing from an entry that holds the entry's name on another process set
        # says so (Request.shadow), so that `_deadlocks` can see both sets' entries although each set's rounds
        # keep a table of their own. Shadows are never run, and are dropped at the end of the round.
        self._shadows: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, key: Key) -> bool:
        return key in self._pending

    @property
    def joined(self) -> tuple[int, ...]:
        """Ranks that have called join() and not yet been released."""
        return tuple(_ranks_of(self._announced.get(self._join_key, 0)))

    def missing_here(self, rank: int, waited_s: float = 0.0) -> list[Key]:
        """The entries that have waited at least `waited_s` for `rank`: announced by other ranks, not by it."""
        now = time.monotonic()
        return [
            key
            for key, announced in self._announced.items()
            if not announced >> rank & 1 and now - self._since[key] >= waited_s
        ]

    def add(self, request: Request, ranks: int) -> str | None:
        """Record that the ranks of the bit mask `ranks` announced `request`; return an error if one of them
        already announced this name."""
        key = request.key
        if request.shadow:
            self._shadows[key] = self._shadows.get(key, 0) | request.shadow
            return None
        announced = self._announced.get(key, 0)
        if announced & ranks:
            again = _ranks_of(announced & ranks)
            return f"{_ranks_text(again)} submitted {request.describe()} twice before it completed"
        variants = self._pending.get(key)
        if variants is None:
            variants = self._pending[key] = {}
            self._since[key] = time.monotonic()
        variants[request] = variants.get(request, 0) | ranks
        self._announced[key] = announced | ranks
        self._latest[key] = ranks
        return None

    def _members_mask(self, set_id: int, members: tuple[int, ...]) -> int:
        """Set ids are never reused, so each set's mask is computed once."""
        mask = self._member_masks.get(set_id)
        if mask is None:
            mask = self._member_masks[set_id] = mask_of(members)
        return mask

    def take_ready(self, members: Callable[[int], tuple[int, ...]]) -> list[Response]:
        """Remove and return every entry all its members announced (or errors), in arrival order."""
        joined = self._announced.get(self._join_key, 0)
        ready = []
        for key in list(self._pending):
            response = self._decide(key, members(key[0]), joined)
            if response is not None:
                ready.append(response)
        ready += self._deadlocks(members)
        ready += self._members_of_failed_calls(ready, members)
        for response in ready:
            self._forget(response.key)
        self._shadows.clear()
        return ready

    def _members_of_failed_calls(
        self, decided: list[Response], members: Callable[[int], tuple[int, ...]]
    ) -> list[Response]:
        """Errors for the members that only some ranks submitted of grouped calls whose ranks grouped different
        numbers of tensors (this round or before): the members every rank submitted fail with the mismatch."""
        for response in decided:
            if response.error and response.first.call:
                sizes = {request.group for request in response.requests if request is not None}
                if len(sizes) > 1:
                    extra = set(range(min(sizes), max(sizes)))
                    self._failed_calls.setdefault((response.key[0], response.first.call), (response.error, extra))
        errors = []
        decided_keys = {response.key for response in decided}
        for key in list(self._pending):
            first = next(iter(self._pending[key]))
            failed = self._failed_calls.get((key[0], first.call)) if first.call else None
            if failed is not None and _member_index(key) in failed[1] and key not in decided_keys:
                requests = self._requests(key, members(key[0]))
                errors.append(Response(key, first.kind, requests, error=failed[0], members=members(key[0])))
                failed[1].discard(_member_index(key))
        for failed_call, (_, left) in list(self._failed_calls.items()):
            if not left:
                del self._failed_calls[failed_call]
        return errors

    def _forget(self, key: Key) -> None:
        for entries in (self._pending, self._announced, self._latest, self._since):
            entries.pop(key, None)

    def _requests(self, key: Key, members: tuple[int, ...]) -> Sequence[Request | None]:
        """One request per member in set order, None for a member that did not announce (it joined)."""
        variants = self._pending[key]
        if len(variants) == 1 and self._announced[key] == self._members_mask(key[0], members):
            return SameRequest(next(iter(variants)), len(members))
        by_rank = {rank: request for request, mask in variants.items() for rank in _ranks_of(mask)}
        return tuple(by_rank.get(rank) for rank in members)

    def _decide(self, key: Key, members: tuple[int, ...], joined: int) -> Response | None:
        variants, announced = self._pending[key], self._announced[key]
        first = next(iter(variants))
        member_mask = self._members_mask(key[0], members)
        missing = member_mask & ~announced
        if key == self._join_key:
            if missing or announced & ~member_mask:
                return None
            last = _ranks_of(self._latest[key])[-1]
            return Response(key, first.kind, self._requests(key, members), join_last_rank=last, members=members)
        if missing & ~joined:
            return None
        requests = self._requests(key, members)
        if missing and first.kind != OpKind.ALLREDUCE:
            return Response(key, first.kind, requests, members=members, error=_join_error(first, missing))
        strangers = announced & ~member_mask
        if strangers:
            return Response(
                key,
                first.kind,
                requests,
                members=members,
                error=(
                    f"{first.describe()} was submitted by {_ranks_text(_ranks_of(strangers))}, which are not in "
                    f"process set {key[0]} (members {list(members)})."
                ),
            )
        return Response(key, first.kind, requests, error=validate(variants, members), members=members)

    def _deadlocks(self, members: Callable[[int], tuple[int, ...]]) -> list[Response]:
        """Errors for one name submitted on two process sets by ranks that wait on each other.

        A rank never has one name in flight on two sets, so if the entry on set A waits for a rank
        that holds the name on set B, and B waits for a rank holding it on A, neither can finish.
        """
        by_name: dict[str, list[Key]] = {}
        for key in [*self._pending, *self._shadows]:
            by_name.setdefault(key[1], []).append(key)
        announced = {**self._shadows, **self._announced}
        errors = []
        for name, keys in by_name.items():
            for i, key_a in enumerate(keys):
                for key_b in keys[i + 1 :]:
                    a, b = announced[key_a], announced[key_b]
                    set_a, set_b = (self._members_mask(key[0], members(key[0])) for key in (key_a, key_b))
                    if set_a & ~a & b and set_b & ~b & a:
                        used = {r: f"process set {key_a[0]}" for r in _ranks_of(a)}
                        used.update({r: f"process set {key_b[0]}" for r in _ranks_of(b)})
                        message = (
                            f"Mismatched process sets for collective {name!r}: "
                            f"{disagreement(dict(sorted(used.items())))}."
                        )
                        for key in (key for key in (key_a, key_b) if key in self._pending):
                            errors.append(
                                Response(
                                    key,
                                    next(iter(self._pending[key])).kind,
                                    self._requests(key, members(key[0])),
                                    error=message,
                                    members=members(key[0]),
                                )
                            )
        return errors

    def stalls(self, older_than: float, members: Callable[[int], tuple[int, ...]]) -> list[Stall]:
        """Entries waiting longer than `older_than` seconds, with the ranks that are missing."""
        now = time.monotonic()
        found = []
        for key, variants in self._pending.items():
            waited = now - self._since[key]
            if waited >= older_than:
                announced = self._announced[key]
                missing = tuple(r for r in members(key[0]) if not announced >> r & 1)
                found.append(Stall(key, next(iter(variants)).describe(), tuple(_ranks_of(announced)), missing, waited))
        return found
