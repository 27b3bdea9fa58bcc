"""Handles: the unit of asynchrony. A collective returns one at once and completes it later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Handle", "Completion"]

_Result = TypeVar("_Result", covariant=True)
_Next = TypeVar("_Next")


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

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done, then return the result or raise the collective's error."""
        if not self._done and timeout is None and self._drive is not None:
            again = False
            while not self._done and self._drive(self, again):
                again = True
        if not self._done:
            if not self._pending.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s")
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

    `result()` waits once and remembers, so a group shared by several gradients is finished once; Horovod's
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

    def result(self) -> _Result:
        """Wait for the collectives, then return the finished result (the same object on every call)."""
        if not self._finished:
            self._result = self._finish([handle.wait() for handle in self._handles])
            self._finished = True
        result: _Result = self._result  # what `finish` returned
        return result

    def then(self, step: Callable[[_Result], _Next]) -> Completion[_Next]:
        """The same collectives, with `step` applied to the finished result."""
        finish = self._finish
        return Completion(self._handles, lambda results: step(finish(results)))
