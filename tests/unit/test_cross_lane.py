"""A process set's cross lane runs its steps one after another, in the order queued, off the calling thread,
and hands a step's result, or its exception, to the thread that waits for it."""

import threading

import pytest

from hvdplus.common.data.cross_lane import CrossLane


def test_steps_run_in_order_on_one_daemon_thread_while_the_caller_goes_on():
    lane, ran, threads = CrossLane("test-lane"), [], set()
    release = threading.Event()

    def step(i):
        if i == 0:
            assert release.wait(5)  # the caller queues every step and goes on while the first still runs
        ran.append(i)
        threads.add(threading.current_thread())

    steps = [lane.start(lambda i=i: step(i)) for i in range(5)]
    assert ran == []
    release.set()
    for s in steps:
        s.wait()
    assert ran == [0, 1, 2, 3, 4]
    (thread,) = threads
    assert thread is not threading.current_thread() and thread.daemon
    assert lane.start(lambda: "halving-doubling").wait() == "halving-doubling"  # what the step returned


def test_a_failed_step_raises_in_its_waiter_and_later_steps_still_run():
    lane = CrossLane("test-lane")

    def fail():
        raise RuntimeError("peer 3 is gone")

    failed, after = lane.start(fail), lane.start(lambda: None)
    with pytest.raises(RuntimeError, match="peer 3 is gone"):
        failed.wait()
    after.wait()
