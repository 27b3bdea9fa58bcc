"""The unit of asynchrony: `Work`, what every layer returns at once and completes later, and the core's two kinds
of it: a collective's `Handle`, and an adapter's `Completion` of several."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Work", "Completed", "Handle", "Completion", "ALIVE_EVERY_S"]

ALIVE_EVERY_S = 1.0  # how often a wait given `alive` calls it

_Result = TypeVar("_Result", covariant=True)
_Next = TypeVar("_Next")


class Work(Protocol):
    """One completion protocol from the engines to the adapters: an engine's data call, transfer or control round
    (engines/base.py), the core's `Handle` of a collective, an adapter's `Completion` of several."""

    def done(self) -> bool:
        """Without blocking: whether it has completed. Testing also moves an engine's call along (MPI progresses a
        non-blocking call only inside its calls), and an engine's call may raise its error here already; a
        `Handle` or `Completion` keeps it for `wait`, as Horovod's poll() does."""

    def wait(self, alive: Callable[[], None] | None = None) -> Any:
        """Return its result once it has completed (None for a call whose result is in its buffers), or raise its
        error. `alive`, if given, is called about every `ALIVE_EVERY_S` while this waits and may raise to give up
        (a failed job, a stall); engines whose waits poll also spin briefly first, then sleep between tests."""


class Completed:
    """A `Work` complete from the start, with its result (a job of one rank, whose collectives are local)."""

    __slots__ = ("_result",)

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self, alive: Callable[[], None] | None = None) -> Any:
        return self._result


class Handle:
    """Completion of one submitted collective: its result, or the exception every rank raises.

    A held lock marks "not done" (lighter than threading.Event, which matters at one handle per tensor).
    `drive(handle, again)`, if given, runs the next cycle on the waiting thread when it can (control/cycles.py)."""

    __slots__ = ("name", "_pending", "_done", "_result", "_error", "_event", "_drive")

    def __init__(self, name: str, drive: Callable[[Handle, bool], bool] | None = None) -> None:
        self.name, self._drive = name, drive
        self._pending = threading.Lock()
        self._pending.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._event: Any = None

    def done(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._done

    def wait(self, alive: Callable[[], None] | None = None) -> Any:
        """Block until done (running cycles on this thread while it can), then return the result or raise the
        collective's error."""
        if not self._done and self._drive is not None:
            again = False
            while not self._done and self._drive(self, again):
                again = True
        if not self._done:
            if alive is None:
                self._pending.acquire()
            else:
                while not self._pending.acquire(timeout=ALIVE_EVERY_S):
                    alive()
            self._pending.release()  # let any other waiter through
        if self._error is not None:
            raise self._error
        if self._event is not None:  # a device result: the caller's stream waits for the work that wrote it
            self._event.wait()
        return self._result

    def completes_within(self, seconds: float) -> bool:
        """Whether it is done now or within `seconds` (waits for it no longer; never raises its error)."""
        if not self._done and seconds > 0 and self._pending.acquire(timeout=seconds):
            self._pending.release()
        return self._done

    def set_result(self, result: Any, event: Any = None) -> None:
        """Complete with `result`; `event` (a device event, common/buffer_ops.ReadyEvent) marks where the device
        work writing it ends, and every waiter's current stream waits for it instead of the host."""
        self._result, self._event = result, event
        self._complete()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._complete()

    def _complete(self) -> None:
        if not self._done:  # the first completion wins (a failing job may report an error twice)
            self._done = True
            self._pending.release()


class Completion(Generic[_Result]):
    """What an adapter's asynchronous call returns, and the only handle adapters and optimizers hold: the core
    handles of its collectives, and how to turn their results into the user's (a tensor, a group's list).

    `wait()` waits once and remembers, so a group shared by several gradients is finished once; Horovod's
    one-shot `synchronize(handle)` is the adapter's rule on top (`synchronized`)."""

    __slots__ = ("_handles", "_finish", "_result", "_finished", "synchronized")

    def __init__(self, handles: list[Handle], finish: Callable[[list[Any]], _Result]) -> None:
        self._handles, self._finish = handles, finish
        self._result: Any = None
        self._finished = False
        self.synchronized = False

    @property
    def collectives(self) -> int:
        """How many core requests it waits on (a packed group is one)."""
        return len(self._handles)

    def done(self) -> bool:
        """True once every collective behind it finished; never blocks."""
        return all(handle.done() for handle in self._handles)

    def wait(self, alive: Callable[[], None] | None = None) -> _Result:
        """Wait for the collectives, then return the finished result (the same object on every call)."""
        if not self._finished:
            self._result = self._finish([handle.wait(alive) for handle in self._handles])
            self._finished = True
        result: _Result = self._result  # what `finish` returned
        return result

    def then(self, step: Callable[[_Result], _Next]) -> Completion[_Next]:
        """The same collectives, with `step` applied to the finished result."""
        finish = self._finish
        return Completion(self._handles, lambda results: step(finish(results)))
