"""Handles: the unit of asynchrony. A collective returns one at once and completes it later."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Handle"]


class Handle:
    """Completion of one submitted collective: its result, or the exception every rank raises.

    A held lock marks "not done" (lighter than threading.Event, which matters at one handle per tensor)."""

    __slots__ = ("name", "_pending", "_done", "_result", "_error")

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending = threading.Lock()
        self._pending.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done, then return the result or raise the collective's error."""
        if not self._done:
            if not self._pending.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s")
            self._pending.release()  # let any other waiter through
        if self._error is not None:
            raise self._error
        return self._result

    def set_result(self, result: Any) -> None:
        self._result = result
        self._complete()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._complete()

    def _complete(self) -> None:
        if not self._done:  # the first completion wins (a failing job may report an error twice)
            self._done = True
            self._pending.release()
