"""A Gloo control round that finishes just as a timed wait gives up must be returned, not failed; one that goes on
calls `alive` between timed waits, which may give it up.

c10d's timed `Work.wait` raises "Operation timed out!" when the time is up; the work can complete before
`is_completed()` is asked. CI hit that window on a loaded 2-core machine and the background thread died.
The race cannot be produced on demand with real Gloo, so a work object replays c10d's sequence."""

import numpy as np
import pytest

from hvdplus.common.engines.gloo_channels import GlooRound


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


def _never_called() -> None:
    raise AssertionError("alive() was called although the round had completed")


def test_work_completed_after_the_timeout_is_returned() -> None:
    out = np.arange(3.0)
    work = _WorkThatFinishesDuringTheTimeout()
    assert GlooRound(work, out).wait(_never_called) is out
    assert work.untimed_waits == 1


def test_work_that_failed_after_the_timeout_raises_its_own_error() -> None:
    work = _WorkThatFinishesDuringTheTimeout(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        GlooRound(work, np.zeros(1)).wait(_never_called)


def test_work_still_running_after_the_timeout_calls_alive_and_is_waited_for_again() -> None:
    class RunningForTwoTimeouts:
        timed_waits = 0

        def wait(self, timeout=None):
            if timeout is not None:
                self.timed_waits += 1
                if self.timed_waits <= 2:
                    raise RuntimeError("Operation timed out!")
            return True

        def is_completed(self) -> bool:
            return self.timed_waits > 2

    calls: list[int] = []
    out = np.zeros(1)
    assert GlooRound(RunningForTwoTimeouts(), out).wait(lambda: calls.append(1)) is out
    assert len(calls) == 2


def test_alive_gives_up_a_round_that_does_not_complete() -> None:
    class StillRunning:
        def wait(self, timeout=None):
            raise RuntimeError("Operation timed out!")

        def is_completed(self) -> bool:
            return False

    def give_up() -> None:
        raise TimeoutError("a peer is frozen")

    with pytest.raises(TimeoutError, match="a peer is frozen"):
        GlooRound(StillRunning(), np.zeros(1)).wait(give_up)
