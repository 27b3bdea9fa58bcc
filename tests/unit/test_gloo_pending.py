"""A Gloo collective that finishes just as a timed wait gives up must be returned, not failed.

c10d's timed `Work.wait` raises "Operation timed out!" when the time is up; the work can complete before
`is_completed()` is asked. CI hit that window on a loaded 2-core machine and the background thread died.
The race cannot be produced on demand with real Gloo, so a work object replays c10d's sequence."""

import numpy as np
import pytest

from hvdplus.common.engines.gloo_channels import GlooPending


class _WorkThatFinishesDuringTheTimeout:
    """Replays c10d: the timed wait times out, then the work completes before anyone checks."""

    def __init__(self, error: Exception | None = None) -> None:
        self.completed, self.error, self.untimed_waits = False, error, 0

    def wait(self, timeout=None):
        if timeout is not None:
            self.completed = True  # completes right after the timed wait gave up
            raise RuntimeError("Operation timed out!")
        self.untimed_waits += 1
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.completed


def test_work_completed_after_the_timeout_is_returned() -> None:
    out = np.arange(3.0)
    work = _WorkThatFinishesDuringTheTimeout()
    assert GlooPending(work, out).wait(timeout_s=1.0) is out
    assert work.untimed_waits == 1


def test_work_that_failed_after_the_timeout_raises_its_own_error() -> None:
    work = _WorkThatFinishesDuringTheTimeout(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        GlooPending(work, np.zeros(1)).wait(timeout_s=1.0)


def test_work_still_running_after_the_timeout_is_waited_for_again() -> None:
    class StillRunning:
        def wait(self, timeout=None):
            raise RuntimeError("Operation timed out!")

        def is_completed(self) -> bool:
            return False

    assert GlooPending(StillRunning(), np.zeros(1)).wait(timeout_s=0.1) is None
