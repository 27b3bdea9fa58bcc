"""The background thread rests while the threads that call collectives run the cycles (set_rounds.py:
SetRounds._background_wait): it then sleeps 20 cycle times instead of one, and a submit nobody waits for wakes it.

One rank (the one-rank engine) with a cycle time of 1 s: a rest is 20 s, so an asynchronous allreduce submitted
during one completes within the test's few seconds only because its submit woke the background thread."""

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


def test_an_asynchronous_submit_wakes_a_resting_background_thread():
    coordinator = Coordinator(LocalEngine(), Settings(cycle_time_ms=1000.0), Topology(0, ("host",)))
    try:
        data = np.ones(4, dtype=np.float32)
        # Blocking allreduces for longer than a cycle time, a millisecond apart (so that the background thread gets
        # the cycle lock between them): the first is checked and cached, the later ones take the lone lane, and
        # meanwhile the background thread wakes, finds the last cycle was the caller's and nothing of its own to
        # run, and rests.
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            coordinator.allreduce_now(_request("rest.lone"), data, data)
            time.sleep(1e-3)
        assert coordinator.counters.lone_runs >= 2, coordinator.counters.lone_runs
        handle = coordinator.submit(_request("rest.async"), data, data)
        deadline = time.monotonic() + 5.0  # a cycle time and some; a rest would be 20 s
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.done(), "the asynchronous allreduce waited for the background thread's rest to end"
    finally:
        coordinator.shutdown()
