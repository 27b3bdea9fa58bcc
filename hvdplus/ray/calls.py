"""Waiting for one call on every rank: values in rank order, or the error that failed the job, fast.

When a rank fails, its runtime is shut down (worker.py) and its peers' collectives fail within about a second;
the driver waits `grace_s` more for them, then reports the root error: the first one that is not only a
consequence (HorovodInternalError) of another rank's failure. Ranks still running by then are stuck (in user code,
or waiting at a rendezvous for the failed rank) and are named, for the executor to end them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from hvdplus.common.exceptions import HorovodInternalError

__all__ = ["Outcome", "wait_all", "FAILURE_GRACE_S"]

FAILURE_GRACE_S = 5.0


@dataclass
class Outcome:
    """What one call on every rank gave: `values[r]` (rank r), the ranks' errors in the order they came, and
    the ranks still running `grace_s` after the first error."""

    values: list[Any]
    errors: dict[int, BaseException] = field(default_factory=dict)
    stuck: list[int] = field(default_factory=list)

    @property
    def lost(self) -> list[int]:
        """Ranks whose actor is gone (died, or must be ended because it is stuck)."""
        return sorted({r for r, e in self.errors.items() if isinstance(e, RayActorError)} | set(self.stuck))

    def root_error(self) -> tuple[int, BaseException]:
        """The rank and error that failed the call: the first error that is not a peer's HorovodInternalError."""
        for rank, error in self.errors.items():
            if not isinstance(error, HorovodInternalError):
                return rank, error
        return next(iter(self.errors.items()))


def wait_all(refs: list[Any], grace_s: float = FAILURE_GRACE_S) -> Outcome:
    """Wait for `refs` (one per rank, in rank order) until all are done, or `grace_s` after the first error."""
    pending = {ref: rank for rank, ref in enumerate(refs)}
    outcome = Outcome([None] * len(refs))
    deadline: float | None = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
        if not ready:
            break
        for ref in ready:
            rank = pending.pop(ref)
            try:
                outcome.values[rank] = ray.get(ref)
            except Exception as exc:
                outcome.errors[rank] = exc
                if deadline is None:
                    deadline = time.monotonic() + grace_s
    outcome.stuck = sorted(pending.values())
    return outcome
