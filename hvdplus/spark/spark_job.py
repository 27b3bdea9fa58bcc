"""One Spark job run in a thread of the driver under a job group of its own, so the driver can watch the store
while Spark runs it, and cancel it."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["SparkJob"]

_ids = itertools.count()


class SparkJob:
    """Runs `action()` (an RDD's collect) in a daemon thread, in job group `hvdplus.spark.<kind>.<n>`."""

    def __init__(self, context: SparkContext, kind: str, action: Callable[[], list[Any]]) -> None:
        self.context, self.group = context, f"hvdplus.spark.{kind}.{next(_ids)}"
        self.result: list[Any] | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._action = action
        self._thread = threading.Thread(target=self._run, name=self.group, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.context.setJobGroup(self.group, f"hvdplus.spark: {self.group}", interruptOnCancel=True)
            self.result = self._action()
        except BaseException as exc:  # noqa: B902 - handed to the driver's thread
            self.error = exc
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Cancel the job's running stages (their tasks are killed); a job still waiting for barrier slots is not
        cancellable in Spark and is left to fail by itself."""
        self.context.cancelJobGroup(self.group)
