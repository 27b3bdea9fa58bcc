"""Which rank failed first: the root cause of a failed job, from the exceptions its ranks printed.

When one rank raises inside a collective, its peers fail a few milliseconds later with a HorovodInternalError
that names it ("hvdplus was shut down on rank 1"). They may even exit first, since the failing rank still runs
its shutdown. So the supervisor does not blame the first process to exit: it blames the first rank whose
exception is not such a consequence, and falls back to the first exception of all.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

__all__ = ["Blame", "Failure"]

# The last line of a Python traceback: "RuntimeError: ...", "hvdplus.common.exceptions.HorovodInternalError: ..."
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]: )?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b.*)$")
# Errors a rank raises because a peer failed: the peer shut down, or the transport to it broke.
_CONSEQUENCE = re.compile(
    r"HorovodInternalError: .*(was shut down on rank|collective failed on rank|"
    r"did not answer a control round)"
)
# A peer's error that names a frozen or hung rank, which prints nothing itself.
_SILENT = re.compile(r"(?:rank (\d+)|ranks \[(\d+)[^\]]*\]) did not answer a control round")


@dataclass(frozen=True)
class Failure:
    """A rank's first exception line, and when the launcher read it."""

    rank: int
    line: str
    seen_at: float
    frozen: bool = False  # the rank printed nothing: its peers named it as not answering (it may still run)

    @property
    def consequence(self) -> bool:
        return bool(_CONSEQUENCE.search(self.line))


class Blame:
    """Collects each rank's first exception line as the output pumps relay it (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[int, Failure] = {}

    def observe(self, rank: int, line: bytes) -> None:
        """Look at one line of rank `rank`'s stderr."""
        if rank in self._first:
            return
        match = _EXCEPTION.match(line.decode(errors="replace").rstrip())
        if match:
            with self._lock:
                self._first.setdefault(rank, Failure(rank, match.group(1)[:300], time.monotonic()))

    def root_cause(self) -> Failure | None:
        """The first failure that is not a consequence of another's; else a rank the others name as frozen;
        else the first failure; else None."""
        with self._lock:
            failures = sorted(self._first.values(), key=lambda failure: failure.seen_at)
        causes = [failure for failure in failures if not failure.consequence]
        if causes:
            return causes[0]
        for failure in failures:
            silent = _SILENT.search(failure.line)
            if silent:
                rank = int(silent.group(1) or silent.group(2))
                return Failure(rank, "frozen or hung: no answer to the control rounds", failure.seen_at, frozen=True)
        return failures[0] if failures else None

    def consequences(self, cause: Failure) -> list[int]:
        """The other ranks that printed an exception."""
        with self._lock:
            return sorted(rank for rank in self._first if rank != cause.rank)
