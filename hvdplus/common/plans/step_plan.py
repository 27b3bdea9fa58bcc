"""The planned path's agreements: freezing a step plan once, then one consistency word with every planned step.

Negotiation (coordinator.py) lets ranks submit any collectives in any order, at the price of a control round and
a hand-off to the background thread for each. A training step repeats the same collectives every time, so once
every rank has seen the same step, the ranks freeze it in one agreement (`agreement_words`: each rank's plan
digest, through one negotiated MIN allreduce after each negotiated step, `decide`) and from then on start each
bucket's collective themselves, in plan order, on a communicator of their own (engines/base.py `PlannedGroup`).

The agreement must keep holding, at no extra collective. The last bucket of every planned step carries one more
element, the guard: 1 from a rank that trains, 0 from a rank in `join()` (which runs the same collectives with
zeros) and NaN from a rank whose step differs from the plan (a changed model, noticed locally before the last
bucket starts). Every rank reads the same sum (`read_guard`): NaN makes every rank exchange one
`consistency_words` allreduce, learn who differs, and raise the same error, never a wrong sum or a hang; 0 tells
the ranks in `join()` that every rank has joined.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Guard",
    "GUARD_TRAINING",
    "GUARD_DIFFERS",
    "read_guard",
    "Consistency",
    "plan_digest",
    "Decision",
    "agreement_words",
    "decide",
    "consistency_words",
    "read_consistency",
]

_DIGEST_BITS = 40  # a sum over up to 2**23 ranks of 40-bit digests fits an int64
_BITS_PER_WORD = 62


def plan_digest(parts: Iterable[object]) -> int:
    """A digest of everything the ranks must agree on (names, shapes, dtypes, buckets, op, scales), as a
    non-negative 40-bit integer."""
    text = "\x1f".join(map(repr, parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> (64 - _DIGEST_BITS)


class Decision(enum.Enum):
    """What the freeze agreement decided, identically on every rank."""

    FREEZE = "freeze"  # every rank can take the planned path, with the same plan
    RETRY = "retry"  # a rank is in join() (its zeros): agree again after the next negotiated step
    NEVER = "never"  # a rank cannot take the planned path, or the plans differ: stay on negotiation


_ELIGIBLE, _INELIGIBLE = 2, 1  # a rank in join() contributes 0


def agreement_words(eligible: bool, digest: int) -> np.ndarray:
    """This rank's part of the freeze agreement, reduced with MIN across the process set (`decide`)."""
    return np.array([_ELIGIBLE if eligible else _INELIGIBLE, digest, -digest], dtype=np.int64)


def decide(minimum: np.ndarray, digest: int) -> Decision:
    """The decision of the MIN of every rank's `agreement_words`."""
    if minimum[0] == 0:
        return Decision.RETRY
    if minimum[0] == _ELIGIBLE and minimum[1] == digest and -minimum[2] == digest:
        return Decision.FREEZE
    return Decision.NEVER


GUARD_TRAINING, GUARD_DIFFERS = 1.0, math.nan  # a rank in join() sends 0


class Guard(enum.Enum):
    """What a planned step's summed guard says, identically on every rank."""

    TRAINING = "training"  # at least one rank trains, none differs
    EVERYONE_JOINED = "everyone joined"
    DIFFERS = "differs"


def read_guard(summed: float) -> Guard:
    """Decode the sum of every rank's guard (exact: 0 and NaN survive any float type and any rounding)."""
    if math.isnan(summed):
        return Guard.DIFFERS
    return Guard.EVERYONE_JOINED if summed == 0 else Guard.TRAINING


def _words(size: int) -> int:
    return -(-size // _BITS_PER_WORD)


def _bit(words: np.ndarray, offset: int, index: int) -> None:
    words[offset + index // _BITS_PER_WORD] += 1 << (index % _BITS_PER_WORD)


def _ranks(words: np.ndarray, offset: int, size: int) -> list[int]:
    return [i for i in range(size) if int(words[offset + i // _BITS_PER_WORD]) >> (i % _BITS_PER_WORD) & 1]


def consistency_words(set_rank: int, size: int, digest: int, training: bool, differs: bool) -> np.ndarray:
    """This rank's consistency word for one planned step, reduced with SUM: [digest sum, training-rank bits,
    differing-rank bits] (bits by position in the process set; each rank sets only its own, so the sum is an OR)."""
    n = _words(size)
    words = np.zeros(1 + 2 * n, dtype=np.int64)
    if training:
        words[0] = digest
        _bit(words, 1, set_rank)
    if differs:
        _bit(words, 1 + n, set_rank)
    return words


@dataclass(frozen=True)
class Consistency:
    """What a planned step's summed consistency words say, identically on every rank."""

    training: tuple[int, ...]  # positions in the process set of the ranks that were not in join()
    differing: tuple[int, ...]  # positions of the ranks whose step differed from the plan
    digests_agree: bool  # every training rank ran the plan with the same digest


def read_consistency(summed: np.ndarray, size: int, digest: int) -> Consistency:
    """Decode the SUM of every rank's `consistency_words`."""
    n = _words(size)
    training = tuple(_ranks(summed, 1, size))
    return Consistency(training, tuple(_ranks(summed, 1 + n, size)), int(summed[0]) == len(training) * digest)
