"""The background thread rests while the lone lane runs the cycles (set_rounds.py: SetRounds._background_wait): it
then sleeps 20 cycle times (at most 1 s) instead of one, and a submit nobody waits for wakes it.

One rank (the one-rank engine) with a cycle time of 100 ms: a rest is 1 s, in which the thread runs no round, and
an asynchronous allreduce submitted during one completes within the test's 0.5 s only because its submit woke the
background thread."""

from __future__ import annotations

import time

import numpy as np

from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.engines.local import LocalEngine
from hvdplus.common.ops import OpKind, ReduceOp
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology


def _request(name: str) -> Request:
    return Request(name, OpKind.ALLREDUCE, 0, "float32", (4,), op=ReduceOp.SUM)


def test_the_background_thread_rests_beside_the_lone_lane_and_a_submit_wakes_it():
    coordinator = Coordinator(LocalEngine(), Settings(cycle_time_ms=100.0), Topology(0, ("host",)))
    try:
        data = np.ones(4, dtype=np.float32)
        # Blocking allreduces a millisecond apart (so that the background thread gets the cycle lock between them):
        # the first is checked and cached, the later ones take the lone lane, and meanwhile the background thread
        # wakes, finds the last cycle was the lane's and nothing of its own to run, and rests, 1 s at a time. The
        # calls go on until a rest has just begun (the second: the first may have begun before the lane ran).
        counters, until = coordinator.counters, time.monotonic() + 10.0
        while counters.background_rests < 2 and time.monotonic() < until:
            coordinator.allreduce_now(_request("rest.lone"), data, data)
            time.sleep(1e-3)
        assert counters.lone_runs >= 2, counters.lone_runs
        assert counters.background_rests >= 2, "the background thread never rested beside the lone lane"
        rounds = counters.rounds
        time.sleep(0.25)  # 2.5 cycle times: a thread that did not rest would have run its due round
        assert counters.rounds == rounds, "the background thread ran rounds while it should rest"
        start = time.monotonic()
        handle = coordinator.submit(_request("rest.async"), data, data)
        while not handle.done() and time.monotonic() < start + 0.5:  # a cycle time and some; the rest has 0.75 s left
            time.sleep(0.01)
        assert handle.done(), "the asynchronous allreduce waited for the background thread's rest to end"
    finally:
        coordinator.shutdown()
