"""Who runs the coordinator's cycles (common/control/cycles.py): waiting threads while the ranks are busy, never two at
once, never out of an idle spell; and how long a rank spins for a control round."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hvdplus.common.control import cycles as cycles_module
from hvdplus.common.control.coordinator import control_spin_s
from hvdplus.common.control.cycles import Cycles
from hvdplus.common.handles import Handle


class Script:
    """A cycle function that returns the scripted outcomes in turn and records who ran each cycle."""

    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)
        self.threads: list[int] = []
        self.spins: list[bool] = []
        self.cycles: Cycles | None = None
        self.inside: list[bool] = []

    def __call__(self, spin: bool) -> bool | None:
        self.threads.append(threading.get_ident())
        self.spins.append(spin)
        assert self.cycles is not None
        self.inside.append(self.cycles.in_cycle)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome  # type: ignore[return-value]


def cycles_for(script: Script, inline: bool = True, period_s: float = 0.0) -> tuple[Cycles, list[BaseException]]:
    failures: list[BaseException] = []
    cycles = Cycles(script, failures.append, inline, lambda: period_s)
    script.cycles = cycles
    return cycles, failures


def test_a_waiting_thread_runs_cycles_while_busy_and_stops_when_the_round_shows_no_work():
    script = Script(True, True, False)
    cycles, _ = cycles_for(script)
    handle = Handle("x")
    assert cycles.waiters_drive
    assert cycles.drive(handle, False) and cycles.drive(handle, False) and cycles.drive(handle, False)
    assert script.threads == [threading.get_ident()] * 3 and script.inside == [True] * 3
    assert not cycles.in_cycle
    # The third round showed no work: idle, which only the background thread leaves.
    assert cycles.idle and not cycles.waiters_drive
    assert not cycles.drive(handle, False)
    assert cycles.driven == 3
    # A busy round lets the next one spin; the round after an idle spell does not.
    cycles.run()
    assert script.spins == [True, True, True, False]


def test_a_finished_handle_or_a_stopped_job_runs_no_cycle():
    script = Script(None)
    cycles, _ = cycles_for(script)
    done = Handle("done")
    done.set_result(1)
    assert not cycles.drive(done, False) and script.threads == []
    assert cycles.drive(Handle("x"), False)  # the job shuts down in this cycle
    assert cycles.stopped and not cycles.drive(Handle("y"), False)
    cycles.run()  # nothing runs after a stop
    assert len(script.threads) == 1


def test_without_inline_cycles_only_the_background_thread_runs_them():
    script = Script(True)
    cycles, _ = cycles_for(script, inline=False)
    assert not cycles.waiters_drive and not cycles.drive(Handle("x"), False)
    cycles.run_if_due(lambda: False)
    assert len(script.threads) == 1


def test_the_background_cycle_waits_its_period_unless_urgent():
    script = Script(True, True)
    cycles, _ = cycles_for(script, period_s=60.0)
    cycles.drive(Handle("x"), False)
    assert 0.0 < cycles.until_due() <= 60.0
    cycles.run_if_due(lambda: False)  # a waiting thread ran the last cycle just now: not due
    assert len(script.threads) == 1
    cycles.run_if_due(lambda: True)  # a shutdown, say
    assert len(script.threads) == 2


def test_the_background_cycle_waits_for_a_burst_of_submits_to_end_for_at_most_one_more_period(monkeypatch):
    """A rank still submitting (its last submit under 0.2 ms ago) holds the background thread's due cycle, so that
    one round takes the whole burst; never beyond two cycle times after the last cycle."""
    now = [100.0]
    monkeypatch.setattr(cycles_module.time, "monotonic", lambda: now[0])
    script = Script(True, True)
    cycles, _ = cycles_for(script, period_s=0.05)
    cycles.drive(Handle("x"), False)  # the last cycle ends at 100.0
    now[0] = 100.06  # due
    assert cycles.until_due() == 0.0 and cycles.until_background_due() == 0.0
    cycles.submitted()
    now[0] += 1e-4
    assert cycles.until_background_due() == pytest.approx(1e-4)
    cycles.run_if_due(lambda: False)  # the burst goes on: not yet
    assert len(script.threads) == 1
    now[0] = 100.1  # two cycle times after the last cycle: a burst that never ends is held no longer
    cycles.submitted()
    assert cycles.until_background_due() == 0.0
    cycles.run_if_due(lambda: False)
    assert len(script.threads) == 2


def test_a_collective_still_pending_after_its_cycle_waits_for_the_next_due_one():
    """A waiter whose collective a round left pending (a peer has not submitted) runs its next round a cycle time
    after the last one, not at once; if the collective completes meanwhile (the background thread's round), it
    runs none."""
    script = Script(True, True)
    cycles, _ = cycles_for(script, period_s=0.2)
    pending = Handle("pending")
    assert cycles.drive(pending, False)
    threading.Timer(0.05, pending.set_result, args=(1,)).start()
    assert not cycles.drive(pending, True)  # completed during the pause
    assert len(script.threads) == 1
    later = Handle("later")
    assert cycles.drive(later, True)  # not completed: the next round runs once due
    assert len(script.threads) == 2


def test_a_failing_cycle_stops_the_job_and_reports_once():
    error = RuntimeError("engine failed")
    script = Script(error)
    cycles, failures = cycles_for(script)
    assert cycles.drive(Handle("x"), False)  # the failure reaches the handles through `fail`, not as a raise here
    assert failures == [error] and cycles.stopped and not cycles.in_cycle


def test_an_interrupt_in_a_waiting_thread_stops_the_job_and_reaches_the_user():
    interrupt = KeyboardInterrupt()
    script = Script(interrupt)
    cycles, failures = cycles_for(script)
    with pytest.raises(KeyboardInterrupt):
        cycles.drive(Handle("x"), False)
    assert failures == [interrupt] and cycles.stopped


def test_cycles_never_overlap():
    """A waiting thread that finds a cycle running waits for it, then runs the next one itself."""
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def cycle(spin: bool) -> bool:
        order.append("start")
        if len(order) == 1:
            started.set()
            release.wait(5)
        order.append("end")
        return True

    cycles = Cycles(cycle, lambda exc: None, True, lambda: 0.0)
    background = threading.Thread(target=cycles.run)
    background.start()
    assert started.wait(5)
    waiter = threading.Thread(target=cycles.drive, args=(Handle("x"), False))
    waiter.start()
    release.set()
    background.join(5)
    waiter.join(5)
    assert order == ["start", "end", "start", "end"]


def test_a_short_spin_on_a_host_with_more_ranks_than_cores():
    cores = os.cpu_count() or 1
    assert control_spin_s(cores + 1) < control_spin_s(cores)


@pytest.mark.parametrize("state_in_context", [True, False], ids=["numpy-2", "numpy-1-way"])
def test_a_cycle_run_by_a_waiting_thread_does_not_take_its_numpy_error_state(monkeypatch, state_in_context):
    """A user thread's np.seterr(all="raise") would turn a float16 overflow inside a cycle (a scaled gradient)
    into an engine failure that ends the job; the background thread's cycles never see it. Both ways of
    keeping it out: a fresh context (numpy 2), and numpy's default error state (numpy 1, per thread)."""
    import hvdplus.common.control.cycles as cycles_module

    monkeypatch.setattr(cycles_module, "_STATE_IN_CONTEXT", state_in_context)
    seen: list[dict[str, str]] = []

    def cycle(spin: bool) -> bool:
        seen.append(np.geterr())
        np.float16(6e4) * np.float16(2)  # overflows: a warning by numpy's defaults
        return True

    failures: list[BaseException] = []
    cycles = Cycles(cycle, failures.append, True, lambda: 0.0)
    with np.errstate(all="raise"), pytest.warns(RuntimeWarning, match="overflow"):
        assert cycles.drive(Handle("x"), False)
    assert failures == [] and not cycles.stopped
    assert seen == [{"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}]


def test_a_submitting_thread_runs_a_lone_cycle_only_when_the_lane_is_open():
    """run_now: the lane's cycle runs on the calling thread while the ranks are busy, its outcome settling the
    state as a cycle's does; not when `ready()` says no (nothing runs), in an idle spell, once stopped, or while
    another thread holds the cycle lock. A failure in it fails the job."""
    script = Script()
    cycles, failures = cycles_for(script)
    lane = Script(True, False, RuntimeError("peer lost"))
    lane.cycles = cycles
    assert not cycles.run_now(lambda: False, lane) and lane.threads == []
    assert cycles.run_now(lambda: True, lane) and lane.inside == [True] and not cycles.idle
    assert cycles.run_now(lambda: True, lane) and cycles.idle  # its round showed no work: an idle spell
    assert not cycles.run_now(lambda: True, lane) and len(lane.threads) == 2
    cycles.idle = False
    held = threading.Event()
    release = threading.Event()

    def hold_a_cycle(spin: bool) -> bool:
        held.set()
        release.wait(10)
        return True

    other = threading.Thread(target=lambda: cycles.run_now(lambda: True, hold_a_cycle))
    other.start()
    assert held.wait(10)
    assert not cycles.run_now(lambda: True, lane) and len(lane.threads) == 2  # the lock is taken: submit instead
    release.set()
    other.join(10)
    assert cycles.run_now(lambda: True, lane)  # the cycle raised: the job fails
    assert cycles.stopped and [str(f) for f in failures] == ["peer lost"]
    assert not cycles.run_now(lambda: True, lane)
