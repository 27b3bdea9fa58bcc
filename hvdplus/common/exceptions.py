"""Exception types shared by every adapter (Horovod's names, so `except` clauses keep working)."""

from __future__ import annotations

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "CollectiveMismatchError", "NotInitializedError"]


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer disagreed, died, or the engine raised."""


class CollectiveMismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same collective with different shapes, dtypes, ops or roots."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by elastic training when the set of hosts changed (kept for Horovod compatibility)."""


class NotInitializedError(ValueError):
    """An hvdplus function that needs `init()` was called before it (Horovod raises ValueError too)."""

    def __init__(self, what: str = "this function") -> None:
        super().__init__(f"hvdplus has not been initialized; call hvd.init() before {what}.")
