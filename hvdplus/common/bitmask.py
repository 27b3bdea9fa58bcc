"""Sets of small integers (ranks, response-cache bits) as Python ints: a union, intersection or subset test over
1024 members is a few machine-word operations, and the set travels as a handful of bytes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["mask_of", "bits"]


def mask_of(members: Iterable[int]) -> int:
    """The mask with the bits of `members` set."""
    mask = 0
    for member in members:
        mask |= 1 << member
    return mask


def bits(mask: int) -> Iterator[int]:
    """The set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
