"""A thread that runs one process set's cross-host steps, one after another, while the rounds' thread goes on.

A pipelined hierarchical allreduce (hierarchical.py) keeps one chunk's cross-host allreduce in flight while
the next chunk is reduced within the host. Engines' own non-blocking allreduces do not serve: Open MPI's picks a
reduce-then-broadcast for in-place calls on fewer than 4 ranks, which uses one direction of the link at a time,
and hvdplus's own cross-host algorithms are sequences of blocking exchanges. So the steps run, blocking, on a
thread of their own, on the cross-host group, which no other thread uses; the engines allow that (MPI is
initialised THREAD_MULTIPLE, and Gloo's groups are independent). One lane per process set: two sets sharing one
thread could queue their steps in different orders on different ranks and wait on each other.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from hvdplus.common.handles import Handle

__all__ = ["CrossLane"]


class CrossLane:
    """A daemon thread, started at the first step (a step that waits on a peer that died never returns, and must
    not hold the process's exit)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._steps: queue.SimpleQueue[tuple[Callable[[], Any], Handle]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, run: Callable[[], Any]) -> Handle:
        """Queue `run()` behind the steps queued before it; the handle's `wait` returns what it returned once it has
        run, or raises what it raised."""
        handle = Handle(self._name)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._steps.put((run, handle))
        return handle

    def _loop(self) -> None:
        while True:
            run, handle = self._steps.get()
            try:
                result = run()
            except BaseException as exc:  # handed to the thread that waits for the step
                handle.set_error(exc)
            else:
                handle.set_result(result)
