"""How a rank waits while no rank has work: once a round shows none, no round runs until a rank has work of its own
or a peer rings its doorbell (engines/base.py: Doorbell) for the next round, so an idle job, or one computing
between steps, costs its peers nothing. A rank woken by a peer gives its own work a moment to come (the grace),
unless its peers have worked without it lately."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hvdplus.common.engines.base import Doorbell

__all__ = ["IdleSpells"]

# How often a rank with no work looks at a doorbell that must be polled (MPI's): the wait doubles from 1 ms to
# 20 ms, so a rank that submits nothing joins a peer's work within 40 ms (two hops, through rank 0), and an idle
# process wakes 50 times a second (a timed wake-up costs ~100 us of CPU on these VMs), running no round.
_BELL_FIRST_POLL_S, _BELL_LAST_POLL_S = 1e-3, 2e-2
# How long a rank woken by a peer's ring waits for work of its own before it joins: data-parallel ranks submit
# their gradients within a few ms of each other, and joining at once would pull a rank still computing into
# rounds that find nothing (each a round trip, and CPU taken from the compute on a shared host).
_BELL_GRACE_S = 5e-3
# A rank whose last graces all passed without work of its own (one outside the process set its peers work on, or
# idle while they work) skips the grace, since the peers' collective waits for its round; it gives one again every
# _GRACE_RETEST-th ring, to notice that it works with them again (Gloo, 3 ranks, a lone allreduce on a set without
# the idle rank 0 after an idle spell: 5.3-5.9 ms with the grace).
_GRACES_BEFORE_SKIP, _GRACE_RETEST = 3, 16
# Such a rank polls a doorbell at most every 2 ms for the first 0.1 s of an idle spell: its peers' next collective
# is likely to need it soon (MPI, the same set, a call every 20 ms: ~15 ms a call polling up to 20 ms). Then, as the
# job may have gone idle, it slows down as any rank does (~50 extra wake-ups a spell, ~5 ms of CPU).
_PEER_POLL_S, _PEER_POLL_FOR_S = 2e-3, 0.1


class IdleSpells:
    """One rank's idle spells: the doorbell, the wait for work or a ring, and the grace."""

    def __init__(
        self,
        doorbell: Doorbell,
        wake: threading.Event,
        rank: int,
        has_own_work: Callable[[], bool],
        between_wakes: Callable[[], object],
    ) -> None:
        """`wake`: set by a submit, a shutdown or a ring; `has_own_work()`: whether this rank has something for the
        next round; `between_wakes()`: what an idle rank does at each wake-up that needs no round (a timeline swap)."""
        self._doorbell, self._wake, self._rank = doorbell, wake, rank
        self._has_own_work, self._between_wakes = has_own_work, between_wakes
        self._graces_missed = 0  # rings in a row since this rank last had work of its own when one woke it
        self.graces_skipped = 0  # rings this rank joined at once, having had no work of its own lately (tests)

    def wait_for_work(self, next_round: int) -> None:
        """Run no round until this rank has work of its own or a peer rings for round `next_round`. Rank 0 passes
        every wake-up on to all ranks; the others tell rank 0 of their own (engines/base.py: bell_targets)."""
        delay = _BELL_FIRST_POLL_S if self._doorbell.polled else None
        slow_from = time.monotonic() + (_PEER_POLL_FOR_S if self._left_out else 0.0)
        while not (own := self._has_own_work()) and not self._doorbell.rung(next_round):
            self._wake.wait(delay)
            self._wake.clear()
            self._between_wakes()
            if delay is not None:
                delay = min(2 * delay, _BELL_LAST_POLL_S if time.monotonic() >= slow_from else _PEER_POLL_S)
        if own or self._rank == 0:
            self._doorbell.ring(next_round)
        if own:
            self._graces_missed = 0
        else:
            self._grace_for_own_work()

    def _grace_for_own_work(self) -> None:
        """Woken by a peer's ring with no work of its own: give that work _BELL_GRACE_S to come, so that
        data-parallel ranks, whose gradients come within milliseconds of each other, meet in one round; unless the
        last graces all passed without any (see _GRACES_BEFORE_SKIP)."""
        self._graces_missed += 1
        if self._left_out and self._graces_missed % _GRACE_RETEST:
            self.graces_skipped += 1
            return
        if self._wake.wait(_BELL_GRACE_S):
            self._wake.clear()
        if self._has_own_work():
            self._graces_missed = 0

    @property
    def _left_out(self) -> bool:
        """Whether the last graces all passed without work of this rank's own: its peers work without it."""
        return self._graces_missed > _GRACES_BEFORE_SKIP
