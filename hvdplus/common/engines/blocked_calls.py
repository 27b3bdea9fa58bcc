"""Liveness for blocking waits that cannot call `alive` themselves: a thread calls it for them.

A control round's wait, a planned step's and a Gloo data call's call `alive` about once a second themselves
(handles.Work). MPI's blocking collectives cannot: a thread blocked in `MPI_Allreduce` with a frozen peer stays
there, and before this the rank neither answered the peers' beacons (so a live rank that waited in a control
round named it with the frozen one) nor ever gave up. A blocking call waited for with an `alive` (`CallAtWait`)
registers it for as long as the call lasts (`watch`), and this watcher calls it for each call blocked longer than
a second: it answers the peers' beacons, warns, and at HOROVOD_STALL_SHUTDOWN_TIME_SECONDS names the silent peers.
The blocked call cannot be released then, so `on_stuck` ends the process (the MPI engine aborts the job, as MPI
does on an error). Untimed torch waits (torch_collectives.py `TorchWork`: the planned groups', a device plane's)
sleep in torch for the same reason: there `on_stuck` logs the verdict, and the group's own timeout ends the wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hvdplus.common.handles import ALIVE_EVERY_S

__all__ = ["BlockedCalls", "CallAtWait"]

_T = TypeVar("_T")


class BlockedCalls:
    """The blocking calls each thread has in flight under `watch`, and the thread (started at the first watch)
    that calls their `alive` while they last; `on_stuck(error)` gets the error an `alive` raised, once a call
    (its `alive` is not called again)."""

    def __init__(self, name: str, on_stuck: Callable[[BaseException], None]) -> None:
        self._name, self._on_stuck = name, on_stuck
        self._calls: dict[int, tuple[Callable[[], None], float]] = {}  # thread -> (alive, since); dict ops are atomic
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._start_lock = threading.Lock()

    def watch(self, alive: Callable[[], None] | None) -> None:
        """The calling thread's blocking calls from now on, until watch(None), wait as `alive` allows."""
        ident = threading.get_ident()
        if alive is None:
            self._calls.pop(ident, None)
            return
        self._calls[ident] = (alive, time.monotonic())
        if self._thread is None:
            self._start()

    def run(self, call: Callable[[], _T], alive: Callable[[], None] | None) -> _T:
        """`call()` on this thread, watched with `alive` while it lasts (None: run as it is)."""
        if alive is None:
            return call()
        self.watch(alive)
        try:
            return call()
        finally:
            self.watch(None)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(ALIVE_EVERY_S):
            now = time.monotonic()
            for ident, call in list(self._calls.items()):
                if now - call[1] < ALIVE_EVERY_S:
                    continue
                try:
                    call[0]()
                except Exception as exc:
                    if self._calls.get(ident) is call:  # still blocked in the call the verdict is about
                        self._calls.pop(ident, None)
                        self._on_stuck(exc)

    def close(self) -> None:
        self._closed.set()
        self._calls.clear()


class CallAtWait:
    """A blocking engine call started on a negotiated group (a handles.Work): it runs on the thread that waits for
    it, watched by `calls` with the wait's `alive`. The negotiated path's rounds wait for each call as soon as they
    start it, so the call costs no thread hop; `done()` is False until it has run."""

    __slots__ = ("_call", "_calls", "_ran", "_error")

    def __init__(self, call: Callable[[], Any], calls: BlockedCalls) -> None:
        self._call, self._calls, self._ran = call, calls, False
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._ran

    def wait(self, alive: Callable[[], None] | None = None) -> None:
        if not self._ran:
            self._ran = True
            try:
                self._calls.run(self._call, alive)
            except BaseException as exc:  # a later wait raises it again, as every Work's does
                self._error = exc
        if self._error is not None:
            raise self._error
