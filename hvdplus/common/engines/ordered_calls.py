"""Blocking engine calls run in the order they were started, on a thread of their own: a `Work` for each.

Why the MPI engine's planned groups start their collectives this way rather than with MPI's non-blocking ones.
Open MPI's non-blocking collectives (libnbc) pick their own algorithms: for an in-place `MPI_Iallreduce` on fewer
than 4 ranks a binomial reduce then broadcast, which measured 2x slower than the blocking `MPI_Allreduce` at 1 MiB
and 2.5-4x at 4 and 16 MiB (2 ranks, this project's 2-core VM). And MPI moves a non-blocking collective only inside
MPI calls, so a bucket started from a backward hook progressed only when the training thread tested it. A blocking
call on a thread of its own uses the library's tuned algorithm and progresses all the time, while the training
thread computes (Horovod's background thread and DDP's communication threads do the same). Every member starts the
same calls in the same order, and one thread per communicator runs them in that order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from hvdplus.common.handles import ALIVE_EVERY_S

__all__ = ["OrderedCalls", "CallWork"]

log = logging.getLogger("hvdplus")

_CLOSE_WAIT_S = 1.0


class CallWork:
    """One call started on `OrderedCalls` (a handles.Work): done once the thread has run it."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, alive: Callable[[], None] | None = None) -> None:
        if alive is None:
            self._done.wait()
        else:
            while not self._done.wait(ALIVE_EVERY_S):
                alive()
        if self._error is not None:
            raise self._error

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class OrderedCalls:
    """A thread that runs blocking calls one after another, in the order `start` got them (started at the first)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], CallWork] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self.calls_run = 0  # calls the thread ran (tests check the planned path's MPI calls went this way)

    def start(self, call: Callable[[], None]) -> CallWork:
        """Queue `call`; its work completes once it has run (or fails with its error, and so does every later
        call: the communicator is not usable after a failed collective)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        work = CallWork()
        self._queue.put((call, work))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, work = item
            if self._failed is not None:
                work.finish(self._failed)
                continue
            try:
                call()
            except BaseException as exc:
                self._failed = exc
                work.finish(exc)
            else:
                self.calls_run += 1
                work.finish(None)

    def close(self) -> bool:
        """Stop the thread once the calls queued have run; whether it stopped within a second (a call still
        blocked, say for a peer that stalled, keeps its communicator: the caller must not free it then)."""
        if self._thread is None:
            return True
        self._queue.put(None)
        if self._thread is threading.current_thread():
            return False
        self._thread.join(_CLOSE_WAIT_S)
        stopped = not self._thread.is_alive()
        if not stopped:
            log.debug("%s is still in a call at close: its communicator is left to the process's exit", self._name)
        return stopped
