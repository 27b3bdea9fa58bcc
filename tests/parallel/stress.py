"""The worker suites' stress mode: ranks that submit at random moments, beside processes that keep every core busy.

Quiet, the ranks of a job submit each collective within microseconds of each other, so code that only goes wrong when
one rank is far ahead of a peer (a rank deciding alone, an outcome that depends on timing) passes by luck. Under
load they drift apart. `jobs.stress_job` runs a job that way: it sets HVDPLUS_TEST_STRESS=1, on which the worker
conftests' `jitter_if_requested` makes each rank sleep a random time before each collective reaches the core
(`Coordinator.submit` and `Coordinator.allreduce_now`, which every negotiated collective goes through; the planned
path's steps are not delayed), and it keeps one more busy process than the machine has cores beside the ranks
(`cpu_hogs`), which end with the job (and by themselves at its timeout). This is a test-side hook: the library has
no such setting."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STRESS_ENV = "HVDPLUS_TEST_STRESS"
# Each submit sleeps up to JITTER_S; one in LONG_EVERY sleeps up to LONG_S instead, which leaves a peer waiting in
# the negotiation for many control rounds (and the cached path for a partial hit).
JITTER_S, LONG_S, LONG_EVERY = 0.003, 0.1, 40
_HOG = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


class Jitter:
    """What `jitter_submits` did on this rank: how many submits it delayed, for how long in all."""

    def __init__(self) -> None:
        self.submits, self.slept_s = 0, 0.0

    def summary(self) -> str:
        """The line a stress job's ranks print, which its test checks (the sleeps did happen)."""
        return f"stress mode: {self.submits} submits delayed, {self.slept_s:.2f} s in all"


def jitter_submits(rng: random.Random | None = None) -> Jitter:
    """From now on, sleep a random time before each collective this process submits (each rank draws its own)."""
    from hvdplus.common.control.coordinator import Coordinator

    draw, done = rng or random.Random(), Jitter()

    def late(call: Callable[..., Any]) -> Callable[..., Any]:
        def late_call(self: Coordinator, *args: Any, **kwargs: Any) -> Any:
            pause = draw.uniform(0.0, LONG_S if draw.randrange(LONG_EVERY) == 0 else JITTER_S)
            time.sleep(pause)
            done.submits, done.slept_s = done.submits + 1, done.slept_s + pause
            return call(self, *args, **kwargs)

        return late_call

    Coordinator.submit = late(Coordinator.submit)  # type: ignore[method-assign]
    Coordinator.allreduce_now = late(Coordinator.allreduce_now)  # type: ignore[method-assign]
    return done


_installed: list[Jitter] = []


def stressed() -> bool:
    """Whether this process is a rank of a stress job: its collectives are not back to back, on purpose, so a test
    of an optimisation for back-to-back calls checks the values only."""
    return os.environ.get(STRESS_ENV) == "1"


def jitter_if_requested() -> None:
    """In a rank of a stress job (HVDPLUS_TEST_STRESS=1), jitter its submits: what the worker conftests call."""
    if stressed() and not _installed:
        _installed.append(jitter_submits())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """A pytest hook the worker conftests import: a stress job's ranks end their summary with `Jitter.summary()`."""
    for jitter in _installed:
        terminalreporter.write_line(jitter.summary())


def hog_count(ranks: int) -> int:
    """How many busy processes beside `ranks` ranks leave one more runnable process than the machine has cores."""
    return max(1, (os.cpu_count() or 1) + 1 - ranks)


@contextmanager
def cpu_hogs(count: int, seconds: float) -> Iterator[None]:
    """`count` processes that spin on a core each while the block runs (for `seconds` at most)."""
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(seconds)]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
