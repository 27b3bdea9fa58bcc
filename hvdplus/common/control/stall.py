"""Stalled collectives: ones that only some ranks submitted. The first rank of the rounds (rank 0 in the whole job's,
a process set's first member in its own) warns after HOROVOD_STALL_CHECK_TIME_SECONDS, naming the missing ranks;
after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS every rank fails with the same message.

A collective that is in the response cache is announced by a bit, not by name, so it never reaches the message
table that names missing ranks. A cached collective that only some ranks keep announcing for many cycles is
evicted on every rank alike (`stale_partials`), which sends it back to full negotiation, where it is named.
(Frozen ranks, which answer no control round at all, are frozen.py's.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hvdplus.common.bitmask import bits
from hvdplus.common.control.negotiation import MessageTable, is_join
from hvdplus.common.settings import Settings

__all__ = ["StallInspector"]

log = logging.getLogger("hvdplus")


class StallInspector:
    """Watches a control plane's message table and its partially announced cache bits (agreement.py)."""

    def __init__(
        self, rank: int, settings: Settings, table: MessageTable, members: Callable[[int], tuple[int, ...]]
    ) -> None:
        """`rank`: this rank's place among the ranks of the rounds (0 warns and flags the abort)."""
        self._rank, self._settings, self._table, self._members = rank, settings, table, members
        self._partial_cycles: dict[int, int] = {}
        self._last_warning = 0.0

    def stale_partials(self, all_hit: int, any_hit: int) -> int:
        """Cached collectives only some ranks announced for many cycles: the bits to evict (on every rank alike,
        so full negotiation can name the missing ranks). Bit masks in, bit mask out."""
        limit = max(10, int(self._settings.stall_check_time_seconds * 250 / self._settings.cycle_time_ms))
        partial, stale = any_hit & ~all_hit, 0
        for bit in list(self._partial_cycles):
            if not partial >> bit & 1:
                del self._partial_cycles[bit]
        for bit in bits(partial):
            count = self._partial_cycles.get(bit, 0) + 1
            self._partial_cycles[bit] = count
            if count >= limit:
                stale |= 1 << bit
        return stale

    @property
    def counting(self) -> bool:
        """Whether a cached collective only some ranks announced is being counted."""
        return bool(self._partial_cycles)

    def forget(self, bit: int) -> None:
        """A cache bit was evicted: stop counting its partial announcements."""
        self._partial_cycles.pop(bit, None)

    def abort_due(self) -> bool:
        """On the rounds' first rank: whether a collective (not a join, which may wait for long, as Horovod's does)
        has stalled past the shutdown time (the flag it sets in the round)."""
        limit = self._settings.stall_shutdown_time_seconds
        if self._rank != 0 or limit <= 0:
            return False
        return any(not is_join(stall.key) for stall in self._table.stalls(limit, self._members))

    def warn(self) -> None:
        """On the rounds' first rank, at most once per check time: log the collectives only some ranks submitted."""
        if self._rank != 0 or self._settings.stall_check_disable or len(self._table) == 0:
            return
        threshold = self._settings.stall_check_time_seconds
        now = time.monotonic()
        if now - self._last_warning < threshold:
            return
        stalls = [s for s in self._table.stalls(threshold, self._members) if not is_join(s.key)]
        if stalls:
            self._last_warning = now
            lines = [
                f"  {s.description} on process set {s.key[0]}: submitted by ranks {list(s.submitted)}, "
                f"missing ranks {list(s.missing)} (waiting {s.seconds:.0f} s)"
                for s in stalls
            ]
            log.warning(
                "One or more collectives were submitted by only some ranks; the others may be "
                "stuck or running a different code path:\n%s",
                "\n".join(lines),
            )

    def abort_reason(self) -> str:
        """The error every rank raises when the rounds' first rank flagged a stall abort. Every rank holds the same
        table, so every rank can name what stalled and who is missing (at half the limit: each rank dates an entry
        by its own clock)."""
        limit = self._settings.stall_shutdown_time_seconds
        stalled = "; ".join(
            sorted(
                f"{s.description} (missing ranks {list(s.missing)})"  # same text everywhere
                for s in self._table.stalls(limit / 2, self._members)
                if not is_join(s.key)
            )
        )
        return f"a collective stalled longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={limit:g}" + (
            f": {stalled}" if stalled else ""
        )
