"""Handles: the unit of asynchrony. A collective returns one at once and completes it later."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Handle"]


class Handle:
    """Completion of one submitted collective: its result, or the exception every rank raises."""

    __slots__ = ("name", "_event", "_result", "_error")

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done, then return the result or raise the collective's error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"collective {self.name!r} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def set_result(self, result: Any) -> None:
        self._result = result
        self._event.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._event.set()
