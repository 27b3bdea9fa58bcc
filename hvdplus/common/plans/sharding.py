"""ZeRO partition plans: which rank owns which elements of the parameters (pure functions, no framework).

The trainable parameters of one dtype, in optimizer order, are laid end to end as one flat sequence and cut
into N contiguous ranges whose lengths differ by at most one element. A parameter may therefore span two (or
more) ranks: the balance is exact, not greedy per tensor. Every rank computes the same plan from the same
parameter list, so no plan is ever exchanged."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hvdplus.common.control.negotiation import disagreement
from hvdplus.common.plans.grouping import bucket_indices

__all__ = [
    "Piece",
    "DtypePartition",
    "partition",
    "balanced_bounds",
    "counts_within",
    "bucket_ranges",
    "parameter_mismatch",
]


def balanced_bounds(total: int, size: int) -> tuple[int, ...]:
    """The `size + 1` boundaries of `size` contiguous ranges of `total` elements; the first `total % size` ranges
    hold one element more than the others."""
    if size <= 0:
        raise ValueError(f"size must be a positive number of ranks, got {size}")
    quotient, remainder = divmod(total, size)
    return tuple(r * quotient + min(r, remainder) for r in range(size + 1))


def counts_within(bounds: Sequence[int], start: int, end: int) -> list[int]:
    """How many elements of the flat range [start, end) each rank owns (0 for most ranks of a small range)."""
    return [max(0, min(end, bounds[r + 1]) - max(start, bounds[r])) for r in range(len(bounds) - 1)]


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in a flat range: elements [start, start + length) of parameter
    `param` (an index into the plan's parameter list) sit at `offset` of the flat sequence."""

    param: int
    start: int
    length: int
    offset: int


_Kind = TypeVar("_Kind", bound=Hashable)


@dataclass(frozen=True)
class DtypePartition(Generic[_Kind]):
    """The flat sequence of one dtype's parameters and its cut into per-rank ranges."""

    kind: _Kind
    params: tuple[int, ...]  # indices into the plan's parameter list, in order
    offsets: tuple[int, ...]  # where each of them starts in the flat sequence
    numels: tuple[int, ...]
    bounds: tuple[int, ...]  # rank r owns [bounds[r], bounds[r + 1])

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def counts(self) -> list[int]:
        """Elements owned by each rank."""
        return [self.bounds[r + 1] - self.bounds[r] for r in range(len(self.bounds) - 1)]

    def shard(self, rank: int) -> tuple[int, int]:
        """The flat range [start, end) that `rank` (an index in the process set) owns."""
        return self.bounds[rank], self.bounds[rank + 1]

    def pieces(self, start: int, end: int) -> list[Piece]:
        """The parameter pieces that make up the flat range [start, end), in order."""
        found = []
        for param, offset, numel in zip(self.params, self.offsets, self.numels):
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                found.append(Piece(param, lo - offset, hi - lo, lo))
        return found


def partition(numels: Sequence[int], kinds: Sequence[_Kind], size: int) -> list[DtypePartition[_Kind]]:
    """One partition per kind (dtype), in order of first appearance: parameter i has `numels[i]` elements of
    kind `kinds[i]`. Every element has exactly one owner among the `size` ranks."""
    if len(numels) != len(kinds):
        raise ValueError(f"numels and kinds must have one entry per parameter, got {len(numels)} and {len(kinds)}")
    by_kind: dict[_Kind, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    plans = []
    for kind, params in by_kind.items():
        offsets, total = [], 0
        for index in params:
            offsets.append(total)
            total += int(numels[index])
        plans.append(
            DtypePartition(
                kind, tuple(params), tuple(offsets), tuple(int(numels[i]) for i in params), balanced_bounds(total, size)
            )
        )
    return plans


def bucket_ranges(
    plan: DtypePartition[Any], element_bytes: int, bucket_bytes: int
) -> list[tuple[int, int, tuple[int, ...]]]:
    """The reduce-scatter buckets of one partition as (flat start, flat end, parameter indices): DistributedOptimizer's
    buckets (grouping.bucket_indices: whole parameters in reverse order, at most `bucket_bytes` each, a larger
    parameter a bucket of its own) over the partition's parameters; 0 makes every parameter its own bucket."""
    sizes = [numel * element_bytes for numel in plan.numels]
    runs = bucket_indices(sizes, [plan.kind] * len(sizes), max(bucket_bytes, 1), None)
    return [
        (plan.offsets[run[0]], plan.offsets[run[-1]] + plan.numels[run[-1]], tuple(plan.params[k] for k in run))
        for run in runs
    ]


def parameter_mismatch(described: Sequence[Sequence[tuple]], ranks: Sequence[int]) -> str | None:
    """Why the ranks' parameter lists cannot be sharded together, or None. `described[i]` is rank `ranks[i]`'s
    list of (name, shape, dtype); every rank must list the same parameters in the same order."""
    numbers = {rank: len(listed) for rank, listed in zip(ranks, described)}
    if len(set(numbers.values())) > 1:
        return f"Mismatched numbers of parameters to shard: {disagreement(numbers)}."
    for position in range(len(described[0]) if described else 0):
        entries = {rank: listed[position] for rank, listed in zip(ranks, described)}
        if len(set(entries.values())) > 1:
            shown = {
                rank: f"{name!r} of shape {tuple(shape)} and dtype {dtype}"
                for rank, (name, shape, dtype) in entries.items()
            }
            return f"Mismatched parameter {position} to shard: {disagreement(shown)}."
    return None
