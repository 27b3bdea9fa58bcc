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
# Python prints a chained exception's cause first: the exception the rank raised follows one of these lines.
_CHAINED = re.compile(
    r"^(?:\[rank\d+\]: )?(?:The above exception was the direct cause of the following exception|"
    r"During handling of the above exception, another exception occurred):$"
)
_BLANK = re.compile(r"^(?:\[rank\d+\]:)?\s*$")
# Errors a rank raises because a peer failed: the peer shut down, or the transport to it broke.
_CONSEQUENCE = re.compile(
    r"HorovodInternalError: .*(was shut down on rank|collective failed on rank|"
    r"did not answer (?:a control round|a planned step))"
)
# A peer's error that names a frozen or hung rank, which prints nothing itself: in the control rounds, or in the
# collectives of a frozen step plan (common/planned_steps.py).
_SILENT = re.compile(r"(?:rank (\d+)|ranks \[(\d+)[^\]]*\]) did not answer (a control round|a planned step)")


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
        self._chained: set[int] = set()  # ranks whose first traceback goes on with the exception its cause led to
        self._last_line_raised: set[int] = set()  # ranks whose last lines were their failure, then blank ones

    def observe(self, rank: int, line: bytes) -> None:
        """Look at one line of rank `rank`'s stderr. A rank's failure is the exception its first traceback ends
        with (a peer's stall verdict raised from Gloo's timeout, say, rather than the timeout printed above it)."""
        raised = rank in self._last_line_raised
        if not raised and rank in self._first and rank not in self._chained:
            return  # its failure is known: later lines are not read
        text = line.decode(errors="replace").rstrip()
        if raised:  # right after the exception: blank lines, or the chain going on
            if _CHAINED.match(text):
                with self._lock:
                    self._chained.add(rank)
            if _BLANK.match(text) is None:
                self._last_line_raised.discard(rank)
            return
        match = _EXCEPTION.match(text)
        if match:
            with self._lock:
                earlier = self._first.get(rank)
                seen_at = time.monotonic() if earlier is None else earlier.seen_at
                self._first[rank] = Failure(rank, match.group(1)[:300], seen_at)
                self._chained.discard(rank)
                self._last_line_raised.add(rank)

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
                unanswered = "the control rounds" if silent.group(3) == "a control round" else "a planned step"
                return Failure(rank, f"frozen or hung: no answer to {unanswered}", failure.seen_at, frozen=True)
        return failures[0] if failures else None

    def consequences(self, cause: Failure) -> list[int]:
        """The other ranks that printed an exception."""
        with self._lock:
            return sorted(rank for rank in self._first if rank != cause.rank)
