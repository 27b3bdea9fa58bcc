"""Timelines replaced while collectives run: the coordinator thread makes every swap itself, between its cycles, so
it never writes a closed timeline (which raises) and no file it leaves is broken. Simulated ranks (threads) run
the real coordinator."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.engines.threads import ThreadWorld
from hvdplus.common.ops import OpKind, ReduceOp
from hvdplus.common.settings import Settings
from hvdplus.common.timeline import Timeline, TimelineSlot
from hvdplus.common.topology import Topology


def _coordinators(size: int) -> list[Coordinator]:
    world = ThreadWorld(size)
    return [Coordinator(engine, Settings(), Topology.single_host(engine.rank, engine.size)) for engine in world.engines]


def _allreduce(coordinator: Coordinator, name: str) -> tuple[object, np.ndarray]:
    output = np.empty(2, np.float32)
    handle = coordinator.submit(
        Request(name, OpKind.ALLREDUCE, 0, "float32", (2,), op=ReduceOp.SUM),
        np.full(2, coordinator.rank + 1.0, np.float32),
        output,
    )
    return handle, output


def test_a_closed_timeline_refuses_events_and_stays_valid_json(tmp_path):
    timeline = Timeline(str(tmp_path / "t.json"))
    timeline.begin("x", "ALLREDUCE")
    timeline.end("x")
    timeline.close()
    with pytest.raises(RuntimeError, match=r"t\.json is closed"):
        timeline.begin("x", "ALLREDUCE")
    timeline.close()  # idempotent
    assert [e["ph"] for e in json.loads((tmp_path / "t.json").read_text())] == ["M", "B", "E"]


def test_a_swap_waits_for_the_owner_and_closes_what_it_replaced(tmp_path):
    first, second = Timeline(str(tmp_path / "1.json")), Timeline(str(tmp_path / "2.json"))
    slot = TimelineSlot(first)
    swap = slot.replace(second)
    assert slot.replace(None) is not None  # queued behind the first: the owner applies both in order
    first.begin("x", "QUEUE")  # the owner still writes the first: the swap is not made yet
    assert slot.settle() is None and second.closed and first.closed
    swap.wait()
    assert slot.replace(None) is None  # nothing to stop
    slot.retire()
    third = Timeline(str(tmp_path / "3.json"))
    assert slot.replace(third) is None and slot.replace(None) is None and third.closed  # retired: at once
    for name in ("1", "2", "3"):
        json.loads((tmp_path / f"{name}.json").read_text())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_timelines_started_and_stopped_while_every_rank_runs_collectives(tmp_path, size):
    """Rank 0's user thread starts and stops 30 timelines while every rank keeps 4 allreduces in flight: no
    error, every result right, every file valid JSON, events on them, and the thread still runs at the end."""
    coordinators = _coordinators(size)
    expected = size * (size + 1) / 2
    swaps, toggling = 30, threading.Event()
    errors: list[BaseException] = []

    def toggle() -> None:
        try:
            for i in range(swaps):
                coordinators[0].set_timeline(Timeline(str(tmp_path / f"timeline{i}.json"), mark_cycles=i % 2 == 0))
                time.sleep(0.002 * (i % 3))
                coordinators[0].set_timeline(None)
        except BaseException as exc:
            errors.append(exc)
        finally:
            toggling.clear()

    def run_rank(coordinator: Coordinator) -> None:
        try:
            for step in range(10_000):  # until rank 0 says the swaps are over (agreed: a sum)
                pending = [_allreduce(coordinator, f"step{step}.{k}") for k in range(4)]
                go = np.array([1.0 if coordinator.rank == 0 and toggling.is_set() else 0.0], np.float32)
                handle = coordinator.submit(
                    Request(f"go{step}", OpKind.ALLREDUCE, 0, "float32", (1,), op=ReduceOp.SUM), go, go
                )
                for done, output in pending:
                    done.wait(30)
                    assert (output == expected).all(), output
                handle.wait(30)
                if go[0] == 0:
                    return
        except BaseException as exc:
            errors.append(exc)

    toggling.set()
    threads = [threading.Thread(target=toggle)] + [threading.Thread(target=run_rank, args=(c,)) for c in coordinators]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    try:
        assert not errors, errors
        assert all(c.running for c in coordinators)
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
    events = [json.loads((tmp_path / f"timeline{i}.json").read_text()) for i in range(swaps)]
    assert sum(e.get("name") == "NEGOTIATE_ALLREDUCE" for trace in events for e in trace) > 0


@pytest.mark.timeout(60)
def test_an_idle_job_swaps_without_a_round_and_a_stopped_one_at_once(tmp_path):
    coordinators = _coordinators(3)
    try:
        pending = [_allreduce(c, "x") for c in coordinators]
        for handle, _ in pending:
            handle.wait(10)
        time.sleep(0.3)  # the round after the last work finds nothing: every rank sleeps
        rounds = [c.counters.rounds for c in coordinators]
        coordinators[0].set_timeline(Timeline(str(tmp_path / "idle.json")))
        coordinators[0].set_timeline(None)
        assert [c.counters.rounds for c in coordinators] == rounds
        assert json.loads((tmp_path / "idle.json").read_text()) == []
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
    late = Timeline(str(tmp_path / "late.json"))
    coordinators[0].set_timeline(late)  # the thread has stopped: the swap happens here
    coordinators[0].set_timeline(None)
    assert late.closed
