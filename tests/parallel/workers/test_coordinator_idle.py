"""The background thread of an idle job: it runs no control round, and work still starts promptly, on ranks that
submit it and on ranks that must only join it."""

from __future__ import annotations

import time

import pytest
import torch

from hvdplus.torch.device_plane import CPU_TEST_KIND
from tests.parallel.stress import stressed


def test_idle_ranks_run_no_control_rounds(hvd):
    """Once a round shows no rank has work, no round runs until one does (1 ms cycles would be ~1000 a second; at
    most one stray round is allowed); a submit after the idle spell still completes on every rank.

    Every rank watches the same second of wall-clock time (the ranks share this host's clock), which starts 1 s after
    rank 0's broadcast of it: time for the round after the broadcast's, which may come late on a loaded machine.
    Windows of each rank's own choosing were not enough: on 2 cores one of 3 ranks could start its window 0.1 s or
    more after the others, which then ended theirs and started the next allreduce, whose rounds it counted."""
    from hvdplus.common.basics import runtime

    counters = runtime().coordinator.counters
    start = hvd.broadcast_object(time.time() + 1.0, root_rank=0)
    time.sleep(max(0.0, start - time.time()))
    before = counters.rounds
    time.sleep(max(0.0, start + 1.0 - time.time()))
    # One late ring (a peer slowed on 2 shared cores) may still cost one round.
    assert counters.rounds - before <= 1, f"{counters.rounds - before} control rounds in an idle second"
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.idle").item() == hvd.size()
    assert counters.rounds > before


@pytest.mark.parametrize("left_out", ["last", "first"])
def test_a_rank_without_work_is_woken_for_its_peers(hvd, left_out):
    """One rank sleeps and submits nothing while the others reduce on a process set without it: their collective
    needs its control round, so its doorbell must wake it (otherwise they would wait 2 s for its next submit).
    Left out: the last rank, or rank 0, which relays every ring and here has none of its own to send."""
    idle = hvd.size() - 1 if left_out == "last" else 0
    others = hvd.add_process_set([rank for rank in range(hvd.size()) if rank != idle])
    try:
        hvd.barrier()
        time.sleep(0.1)  # every rank idle: nobody runs rounds
        if hvd.rank() == idle:
            time.sleep(2.0)
        else:
            started = time.monotonic()
            total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"without.{left_out}", process_set=others)
            elapsed = time.monotonic() - started
            assert total.item() == hvd.size() - 1
            assert elapsed < 1.0, f"the idle rank joined after {elapsed:.2f} s"
        hvd.barrier()
    finally:
        hvd.remove_process_set(others)


def test_a_rank_left_out_of_its_peers_collectives_stops_holding_them_back(hvd):
    """Rank 0 submits nothing while the others reduce on a set without it, each call after an idle spell.

    Host tensors go to the set's own rounds (common/control/set_rounds.py): rank 0 runs no round at all. Device tensors
    (HVDPLUS_DEVICE_PATH_ON_CPU=1 here) travel in the whole job's rounds, which need rank 0: every call's ring
    wakes it, and after a few rings whose grace passed without work of its own it stops waiting that grace (5 ms,
    for a data-parallel peer's gradients to come) and joins at once. The members' sums stay right either way."""
    from hvdplus.common.basics import runtime

    counters = runtime().coordinator.counters
    in_world_rounds = CPU_TEST_KIND in runtime().coordinator.device_kinds  # CPU tensors on a device plane
    others = hvd.add_process_set(list(range(1, hvd.size())))
    try:
        hvd.barrier()
        calls = 10
        skipped, rounds = counters.graces_skipped, counters.rounds
        if hvd.rank() == 0:
            time.sleep(calls * 0.03)  # while the members still work (then they wait in the barrier, which needs it)
            ran = counters.rounds - rounds
            time.sleep(calls * 0.05)
        else:
            for step in range(calls):
                time.sleep(0.05)  # every rank idle: the call's first round needs the doorbell
                total = hvd.allreduce(torch.full((2,), float(step)), op=hvd.Sum, name="left.out", process_set=others)
                assert total.tolist() == [float(step * (hvd.size() - 1))] * 2
        hvd.barrier()
        if hvd.rank() == 0 and in_world_rounds:  # rings that came while rank 0 slept still woke it one by one
            assert counters.graces_skipped - skipped >= 2, counters.graces_skipped - skipped
        elif hvd.rank() == 0:
            assert ran <= 1, f"rank 0 ran {ran} rounds for a set it is not in"  # 1: the barrier's last (idle) one
    finally:
        hvd.remove_process_set(others)


def test_a_blocking_collective_runs_its_cycle_on_the_callers_thread(hvd):
    """While the ranks are busy, a thread that waits for a collective runs the cycles itself (common/control/cycles.py):
    back-to-back blocking broadcasts are driven by their callers, not handed to the background thread and back (a
    blocking allreduce of a host tensor takes the lone lane instead: test_lone_lane.py). Each gives every rank the
    right values."""
    from hvdplus.common.basics import runtime

    counters = runtime().coordinator.counters
    hvd.broadcast(torch.ones(1), root_rank=0, name="driven.warmup")  # negotiated once; busy from here on
    driven = counters.driven_cycles
    calls = 50
    for step in range(calls):
        got = hvd.broadcast(torch.full((4,), float(step + hvd.rank())), root_rank=0, name="driven")
        assert got.tolist() == [float(step)] * 4
    # A call after an idle spell (a peer descheduled on 2 shared cores for longer than the cycle time) goes
    # through the background thread's doorbell; most must not. Stress mode sleeps before each submit, on purpose.
    if not stressed():
        assert counters.driven_cycles - driven >= calls // 2, counters.driven_cycles - driven
