"""Who runs the next negotiation cycle: the background thread, or a thread that waits for a collective.

Every rank runs the same sequence of control rounds, but which thread of a rank runs the next one does not
matter to the peers. Handing a blocking collective to the background thread and its result back costs two thread
wake-ups, ~50 us on these VMs (half of a lone 4 KiB allreduce). So while the ranks are busy (the last round
showed work in flight), a thread that waits for a collective runs the cycles itself until its collective is done
(`drive`), and the background thread runs the cycles nobody waits for: asynchronous work, and the rounds the
peers need. Only the background thread leaves an idle spell (it owns the doorbell), and cycles never overlap.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from hvdplus.common.handles import Handle

__all__ = ["Cycles"]


# A rank whose last submit came less than this long ago is in a burst of submits (a loop of asynchronous calls,
# ~10 us apart): the background thread's due cycle waits for its end, so that one round takes the whole burst
# instead of a part (the rest would wait a round, a cycle time, on every rank).
_BURST_GAP_S = 2e-4

# numpy 2 keeps its error state (np.seterr) in a context variable; numpy 1 keeps it per thread.
_STATE_IN_CONTEXT = int(np.__version__.split(".")[0]) >= 2


def _run_in_own_state(run: Callable[[], None]) -> None:
    """`run()` without the calling thread's context variables, numpy's error state among them (np.seterr(all=
    "raise") must not turn a float16 overflow inside a cycle into an engine failure, as it never does on the
    background thread): a fresh context (~0.1 us), or on numpy 1 numpy's default error state (~2 us)."""
    if _STATE_IN_CONTEXT:
        contextvars.Context().run(run)
    else:
        with np.errstate(divide="warn", over="warn", under="ignore", invalid="warn"):
            run()


class Cycles:
    """The cycle lock and the state every rank agrees on after each round: busy, idle, or stopped."""

    def __init__(
        self,
        cycle: Callable[[bool], bool | None],
        fail: Callable[[BaseException], None],
        inline: bool,
        period_s: Callable[[], float],
    ) -> None:
        """`cycle(spin)`: one cycle (whether any rank has work in flight, None once the job stops). `fail(exc)`:
        what a cycle's exception does to the job. `inline`: whether waiting threads may run cycles. `period_s()`:
        the cycle time, which paces the rounds of a thread whose collective is not done after its first."""
        self._cycle, self._fail, self._inline, self._period_s = cycle, fail, inline, period_s
        self._lock = threading.Lock()
        self.idle = False  # the last round showed no rank with work: no round runs until the doorbell
        self.stopped = False  # shut down, or failed: no round runs again
        self._spin = True
        self._last = 0.0  # when the last cycle ended (time.monotonic)
        self._last_submit = 0.0  # when this rank last submitted to these rounds (time.monotonic)
        self._owner: int | None = None  # the thread running a cycle now
        self.driven = 0  # cycles run by waiting threads so far (tests check that lone collectives ran them)
        self.last_lone = False  # whether the last cycle was a submitting thread's (run_now: the lone lane)

    @property
    def waiters_drive(self) -> bool:
        """Whether threads that wait for a collective run the cycles now: then a submit need not wake the background
        thread, which runs a cycle every cycle time for work nobody waits for (Horovod's HOROVOD_CYCLE_TIME)."""
        return self._inline and not self.idle and not self.stopped

    @property
    def in_cycle(self) -> bool:
        """Whether the calling thread is running a cycle (it cannot wait for one)."""
        return self._owner == threading.get_ident()

    def run(self) -> None:
        """Run the next cycle (the caller is the background thread, leaving an idle spell)."""
        with self._lock:
            if not self.stopped:
                self._run()

    def until_due(self) -> float:
        """Seconds until the background thread's next cycle is due (a cycle time after the last, whoever ran it)."""
        return max(0.0, self._last + self._period_s() - time.monotonic())

    def submitted(self) -> None:
        """A collective was submitted to these rounds (the background thread's cycle waits for a burst to end)."""
        self._last_submit = time.monotonic()

    def until_background_due(self) -> float:
        """Seconds until the background thread's next cycle is due: `until_due`, or later while this rank submits a
        burst (_BURST_GAP_S), by at most one more cycle time, so that a rank still submitting holds its peers up by
        no more than that."""
        due = self.until_due()
        if due > 0.0:
            return due
        now = time.monotonic()
        return max(0.0, min(self._last_submit + _BURST_GAP_S, self._last + 2 * self._period_s()) - now)

    def run_if_due(self, urgent: Callable[[], bool]) -> None:
        """The background thread's cycle while busy: due once the cycle time has passed since the last one (and any
        burst of submits has ended: until_background_due), or at once if `urgent()` (asked once the lock is
        held)."""
        with self._lock:
            if not (self.stopped or self.idle) and (urgent() or self.until_background_due() == 0.0):
                self._run()

    def drive(self, handle: Handle, again: bool) -> bool:
        """From a thread waiting for `handle`: run the next cycle here while the ranks are busy (after the one
        running now, if any). Whether it ran one; False: wait for the background thread (an idle spell, which only
        it leaves, or a stopped job). `again`: this thread's last cycle left `handle` pending (a peer has not
        submitted yet): the next one waits until due, as the background thread's would, unless `handle` completes
        meanwhile, so that a wait for a late peer does not run rounds back to back."""
        if not self.waiters_drive or self.in_cycle:  # a signal handler inside a cycle: the lock is this thread's
            return False
        if again and handle.completes_within(self.until_due()):
            return False
        with self._lock:
            if self.idle or self.stopped or handle.done():
                return False
            self.driven += 1
            _run_in_own_state(self._run)
            return True

    def run_now(self, ready: Callable[[], bool], cycle: Callable[[bool], bool | None]) -> bool:
        """From a thread that submits a collective: run `cycle(spin)` here in place of the next cycle, if the ranks
        are busy, no other thread runs one now, and `ready()` (asked once the lock is held) says it can (the lone
        lane: set_rounds.py). Whether it ran; a failure in it fails the job as a cycle's does."""
        if not self.waiters_drive or self.in_cycle or not self._lock.acquire(blocking=False):
            return False
        try:
            if self.idle or self.stopped or not ready():
                return False
            _run_in_own_state(partial(self._run, cycle))
            return True
        finally:
            self._lock.release()

    def _run(self, cycle: Callable[[bool], bool | None] | None = None) -> None:
        self._owner = threading.get_ident()
        try:
            busy = (cycle or self._cycle)(self._spin)
        except BaseException as exc:  # engine failure, a failed or frozen peer: every pending and future call fails
            try:
                self._fail(exc)
            finally:  # only then: the background thread, seeing it, releases the engine
                self.stopped = True
            if not isinstance(exc, Exception):  # a waiting user thread's KeyboardInterrupt goes on to the user
                raise
            return
        finally:
            self._owner = None
        self._last = time.monotonic()
        self.last_lone = cycle is not None
        if busy is None:
            self.stopped = True
        else:
            self.idle, self._spin = not busy, busy
