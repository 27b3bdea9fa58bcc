"""Idle coordinators run no control round, and a doorbell wakes them: simulated ranks (threads) running the real
coordinator, so that every rank of a 3- and a 5-rank job can be watched."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.engines.base import bell_targets
from hvdplus.common.engines.threads import ThreadWorld
from hvdplus.common.ops import OpKind, ReduceOp
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology


def test_rings_go_through_rank_0():
    assert list(bell_targets(0, 4)) == [1, 2, 3]
    assert list(bell_targets(2, 4)) == [0]
    assert list(bell_targets(0, 1)) == []


def test_a_thread_doorbell_hears_the_latest_round_and_wakes_its_rank():
    world = ThreadWorld(3)
    woken = []
    bells = [engine.open_doorbell(lambda rank=rank: woken.append(rank)) for rank, engine in enumerate(world.engines)]
    bells[2].ring(7)  # a rank other than 0 reaches rank 0 only
    assert woken == [0] and bells[0].rung(7) and not bells[1].rung(7)
    bells[0].ring(7)
    assert woken == [0, 1, 2] and bells[1].rung(7) and bells[2].rung(5) and not bells[2].rung(8)
    bells[2].ring(3)  # a stale ring does not lower what rank 0 heard
    assert bells[0].rung(7)


def _request(name: str) -> Request:
    return Request(name, OpKind.ALLREDUCE, 0, "float32", (2,), op=ReduceOp.SUM)


@pytest.fixture(params=[3, 5])
def coordinators(request):
    world = ThreadWorld(request.param)
    ranks = [
        Coordinator(engine, Settings(), Topology.single_host(engine.rank, engine.size)) for engine in world.engines
    ]
    yield ranks
    for coordinator in ranks:
        coordinator.shutdown()


def _wait_until_idle(coordinators: list[Coordinator]) -> list[int]:
    """Rounds of every rank once they stop changing (the round after the last work finds nothing in flight)."""
    rounds, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = [c.counters.rounds for c in coordinators]
        if now == rounds:
            return now
        rounds = now
    raise AssertionError(f"the ranks kept running rounds: {rounds}")


def test_idle_ranks_run_no_rounds_until_the_last_rank_submits(coordinators):
    idle = _wait_until_idle(coordinators)
    time.sleep(0.3)
    assert [c.counters.rounds for c in coordinators] == idle
    outputs = [np.empty(2, np.float32) for _ in coordinators]

    def submit(c: Coordinator):
        return c.submit(_request("x"), np.full(2, c.rank + 1.0, np.float32), outputs[c.rank])

    handles = [submit(coordinators[-1])]  # not rank 0: its ring reaches the others through rank 0
    time.sleep(0.1)  # the others join the round the ring names, and keep rounds running until they submit
    assert all(c.counters.rounds > r for c, r in zip(coordinators, idle))
    handles += [submit(c) for c in coordinators[:-1]]
    for handle in handles:
        handle.wait(10)
    n = len(coordinators)
    assert all((out == n * (n + 1) / 2).all() for out in outputs)


def test_a_shutdown_on_one_idle_rank_reaches_the_others(coordinators):
    _wait_until_idle(coordinators)
    coordinators[1].shutdown()
    deadline = time.monotonic() + 5
    while any(c.running for c in coordinators) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(c.running for c in coordinators)
