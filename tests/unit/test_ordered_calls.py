"""OrderedCalls: blocking calls run in the order started, each a Work; a failure fails every later call."""

from __future__ import annotations

import threading
import time

import pytest

from hvdplus.common.engines.ordered_calls import OrderedCalls


def test_calls_run_in_order_on_one_other_thread():
    calls = OrderedCalls("test-calls")
    ran: list[tuple[int, int]] = []
    release = threading.Event()

    def call(i: int) -> None:
        if i == 0:
            release.wait(5)  # the first call blocks: the others queue behind it
        ran.append((i, threading.get_ident()))

    works = [calls.start(lambda i=i: call(i)) for i in range(5)]
    assert not any(work.done() for work in works)
    release.set()
    for work in works:
        work.wait(lambda: None)
    assert [i for i, _ in ran] == list(range(5))
    assert {thread for _, thread in ran} != {threading.get_ident()} and len({t for _, t in ran}) == 1
    assert calls.calls_run == 5 and all(work.done() for work in works)
    assert calls.close()


def test_a_failed_call_fails_it_and_every_later_one():
    calls = OrderedCalls("test-calls")

    def fail() -> None:
        raise RuntimeError("peer gone")

    first = calls.start(lambda: None)
    failed = calls.start(fail)
    later = calls.start(lambda: None)
    first.wait(lambda: None)
    for work in (failed, later):
        with pytest.raises(RuntimeError, match="peer gone"):
            work.wait(lambda: None)
        with pytest.raises(RuntimeError, match="peer gone"):
            work.done()
    assert calls.calls_run == 1
    assert calls.close()


def test_a_long_wait_calls_alive_which_may_give_up():
    calls = OrderedCalls("test-calls")
    release = threading.Event()
    work = calls.start(lambda: release.wait(10))
    checks: list[float] = []

    def alive() -> None:
        checks.append(time.monotonic())
        raise TimeoutError("stalled")

    with pytest.raises(TimeoutError, match="stalled"):
        work.wait(alive)
    assert len(checks) == 1
    assert not calls.close()  # a call still blocked: the caller must keep its communicator
    release.set()
    work.wait(lambda: None)


def test_closing_unused_calls_starts_no_thread():
    assert OrderedCalls("test-calls").close()
