"""Exception types shared by every adapter (Horovod's names, so `except` clauses keep working)."""

from __future__ import annotations

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "CollectiveMismatchError",
    "PlanMismatchError",
    "NotInitializedError",
]


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer disagreed, died, or the engine raised."""


class CollectiveMismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same collective with different shapes, dtypes, ops or roots."""


class PlanMismatchError(RuntimeError):
    """A planned DistributedOptimizer step differed between ranks (common/plans/step_plan.py): raised on every rank of
    the process set, for the same step; the next step negotiates again."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: the job's hosts changed; raised on every rank at the same commit or check_host_updates().
    `skip_sync`: only hosts were removed, so the survivors' states already agree (Horovod's meaning)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__(
            "the job's hosts changed: the workers reset to the next generation of the job"
            + (" (hosts removed only)" if skip_sync else "")
        )
        self.skip_sync = skip_sync


class NotInitializedError(ValueError):
    """An hvdplus function that needs `init()` was called before it (Horovod raises ValueError too)."""

    def __init__(self, what: str = "this function") -> None:
        super().__init__(f"hvdplus has not been initialized; call hvd.init() before {what}.")
