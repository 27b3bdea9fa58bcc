"""The planned path's agreements: freezing a step plan once, then one consistency word with every planned step.

Negotiation (coordinator.py) lets ranks submit any collectives in any order, at the price of a control round and
a hand-off to the background thread for each. A training step repeats the same collectives every time, so once
every rank has seen the same step, the ranks freeze it in one agreement (`agreement_words`: each rank's plan
digest, through one negotiated MIN allreduce) and from then on start each bucket's collective themselves, in
plan order, on a communicator of their own (engines/base.py `PlannedGroup`).

The agreement must keep holding. Every planned step ends with one small SUM allreduce on the same communicator,
started after the buckets (so that it never delays them), carrying each rank's `consistency_words`: its digest,
whether it is still training (a rank in `join()` runs the same collectives with zeros) and whether its step
differs from the plan (a changed model). `read_consistency` turns the sum back into who joined and who differs;
a rank that differs makes the step fail with the same error on every rank, never a wrong sum or a hang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "PlanMismatchError",
    "Consistency",
    "plan_digest",
    "agreement_words",
    "agreed",
    "consistency_words",
    "read_consistency",
]

_DIGEST_BITS = 40  # a sum over up to 2**23 ranks of 40-bit digests fits an int64
_BITS_PER_WORD = 62


class PlanMismatchError(RuntimeError):
    """A planned step differed between ranks: raised on every rank of the process set, for the same step."""


def plan_digest(parts: Iterable[object]) -> int:
    """A digest of everything the ranks must agree on (names, shapes, dtypes, buckets, op, scales), as a
    non-negative 40-bit integer."""
    text = "\x1f".join(map(repr, parts)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> (64 - _DIGEST_BITS)


def agreement_words(eligible: bool, digest: int) -> np.ndarray:
    """This rank's part of the freeze agreement, reduced with MIN across the process set (`agreed`). A rank in
    `join()` contributes zeros, which refuses the plan, as does any rank that cannot take the planned path."""
    return np.array([1, digest, -digest] if eligible else [0, 0, 0], dtype=np.int64)


def agreed(minimum: np.ndarray, digest: int) -> bool:
    """Whether every rank was eligible and had this digest (the MIN of `agreement_words`)."""
    return bool(minimum[0] == 1 and minimum[1] == digest and -minimum[2] == digest)


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

    @property
    def everyone_joined(self) -> bool:
        return not self.training

    @property
    def ok(self) -> bool:
        return not self.differing and self.digests_agree


def read_consistency(summed: np.ndarray, size: int, digest: int) -> Consistency:
    """Decode the SUM of every rank's `consistency_words`."""
    n = _words(size)
    training = tuple(_ranks(summed, 1, size))
    return Consistency(training, tuple(_ranks(summed, 1 + n, size)), int(summed[0]) == len(training) * digest)
