"""The control rounds of one set of ranks: the whole job's, or one process set's own (Horovod's ProcessSetTable keeps
a controller per set the same way). Each has its queue, agreement (response cache, message table, stall
inspector), doorbell, idle spells and cycles, and a thread of its own, so a set's collectives need only its members'
rounds, and sets run out of phase: a rank blocked in one set's engine call does not hold up another set's.

Every member runs the same sequence of its set's rounds, but which thread of a rank runs the next one does not
matter (cycles.py). The whole job's rounds (world_rounds.py) also run what only they can: join,
process sets, channels, device planes (every device tensor travels in them), autotune and the timeline's cycle
marks. A process set's rounds join on their own when the rank calls join() (its members' allreduces on the set get
its zeros), and stop with a final round of their members when the set is removed or the job shuts down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from hvdplus.common.control.agreement import BUSY, SHUTDOWN, STALL_ABORT, Agreement
from hvdplus.common.control.cycles import Cycles
from hvdplus.common.control.frozen import FrozenPeerInspector, peer_failure
from hvdplus.common.control.idle_spells import IdleSpells
from hvdplus.common.control.in_flight import InFlight, Names
from hvdplus.common.control.messages import Request, Response
from hvdplus.common.control.negotiation import join_key
from hvdplus.common.data.buffer_ops import DataPlane
from hvdplus.common.data.dispatch import Dispatcher
from hvdplus.common.data.executor import Executor, Submission
from hvdplus.common.engines.base import Doorbell, Engine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.handles import Completed, Handle, Work
from hvdplus.common.ops import OpKind
from hvdplus.common.set_table import ProcessSetTable
from hvdplus.common.settings import Settings
from hvdplus.common.timeline import Timeline, TimelineSlot
from hvdplus.common.tunables import Tunables

__all__ = ["RoundsContext", "SetRounds"]

log = logging.getLogger("hvdplus")

# How long the background thread sleeps while the lone lane runs the cycles and it has nothing to run
# (SetRounds._background_wait): 20 cycle times, at most a second (how late it then notices a failure, or the
# ranks' going idle; a frozen peer is named after a second of silence too).
_RESTING_CYCLES, _MOST_REST_S = 20, 1.0


@dataclass(frozen=True)
class RoundsContext:
    """What every set's rounds on this rank share."""

    engine: Engine
    settings: Settings
    sets: ProcessSetTable
    names: Names  # this rank's collectives in flight, on every set's rounds
    spin_s: float  # how long a round is spun for while work is in flight (coordinator.control_spin_s)
    timeline: TimelineSlot
    fail: Callable[[BaseException], None]  # what a failure does to the whole job: every set's work fails


class _Lone:
    """A blocking collective in the lone lane (SetRounds.run_lone): its cache bit once found, and the submission
    it becomes if the lane's round does not decide it alone."""

    __slots__ = ("request", "input", "output", "bit", "work")

    def __init__(self, request: Request, input: np.ndarray, output: np.ndarray) -> None:
        self.request, self.input, self.output = request, input, output
        self.bit = -1
        self.work: Submission | None = None

    def submission(self, new_handle: Callable[[str], Handle]) -> Submission:
        self.work = Submission(self.request, new_handle(self.request.name), self.input, self.output)
        return self.work


class SetRounds:
    """One set's rounds on this rank (a member), on a thread of their own."""

    def __init__(
        self,
        context: RoundsContext,
        set_id: int,
        wake: threading.Event,
        doorbell: Doorbell,
        tunables: Tunables,
        planes: dict[str, DataPlane] | None = None,
    ) -> None:
        """`wake`: the event `doorbell` sets when it rings. `planes`: the device planes whose collectives these
        rounds run (the world's)."""
        engine, settings, sets = context.engine, context.settings, context.sets
        self.set_id, self._engine, self._sets = set_id, engine, sets
        self.ranks = sets.members(set_id)
        self.tunables, self._spin_s = tunables, context.spin_s
        self._timeline, self._fail_job = context.timeline, context.fail
        self._wake, self._doorbell = wake, doorbell
        self._planes = {} if planes is None else planes
        self._in_flight = InFlight(context.names)
        self.executor = Executor(engine, lambda id_: sets[id_], tunables, self._planes)
        self._dispatcher = Dispatcher(
            engine.rank, self.executor, self._in_flight, self._planes, tunables, engine, self._run_control, self._joined
        )
        self._agreement = Agreement(
            engine, lambda: sets[set_id].group, settings, sets.members, sets.index_in, set_id, context.names
        )
        self._frozen = FrozenPeerInspector(engine, settings, set_id, None if set_id == 0 else self.ranks)
        self._idle = IdleSpells(doorbell, wake, self.ranks.index(engine.rank), self._has_own_work, self._between_wakes)
        self.rounds = 0  # control rounds run so far (a test checks that idle ranks run none)
        # Lone lane rounds (run_lone) that decided their collective alone, and those that went on as a full cycle.
        self.lone_runs = self.lone_fallbacks = 0
        self.rests = 0  # times the background thread went to rest (_background_wait)
        self.joined = False  # this rank called join() and these rounds have not agreed the join yet
        self._stop_requested = False
        self._stop_reason = ""
        self._resting = False  # the background thread sleeps longer than a cycle time (_background_wait)
        # Device planes stay on the background thread: a waiting thread's current stream may be the user's.
        self.cycles = Cycles(
            self._cycle, self._failed, inline=not self._planes_possible(), period_s=lambda: tunables.cycle_time_ms / 1e3
        )
        self._drive = self.cycles.drive  # every handle's (one bound method, not one per handle)
        self.thread = threading.Thread(target=self._loop, name=f"hvdplus-rounds-{set_id}", daemon=True)

    # ----------------------------------------------------------------- any thread
    def submit(self, work: Submission) -> Handle:
        """Queue `work` (its name reserved) for these rounds."""
        self._in_flight.put(work)
        self.cycles.submitted()
        if self.cycles.stopped:  # stopped meanwhile (the set removed by a peer's round, a failure): none will run it
            reason = self._stop_reason or "a failure"
            self._in_flight.fail_all(HorovodInternalError(f"process set {self.set_id}'s rounds stopped: {reason}"))
        # Event.set costs more than the check, and bursts need only one. Read after the put: a thread that goes idle
        # after this check finds the work queued (IdleSpells.wait_for_work looks before it sleeps).
        if not self._wake.is_set() and (self._resting or not self.cycles.waiters_drive):
            self._wake.set()
        return work.handle

    def run_lone(self, request: Request, input: np.ndarray, output: np.ndarray) -> Work | None:
        """The lone lane: run a blocking allreduce (its name reserved) of host buffers from the calling thread, in a
        round of its own, when the ranks are busy, nothing else of this rank is queued or in flight here, and the
        collective is cached as it is. Its work: done, unless the round did not decide it alone (a peer was not
        ready, or announced more), or the job failed. None: the lane was not open (submit it instead).

        The lane makes no submission, handle or batch: announced by its cache bit, the collective runs once every
        member sent the same words, which decides it as a full cycle would (Agreement.lone_response). Horovod's
        rules hold: the order is agreed, and a mismatch is an uncached request that takes the full cycle."""
        lone = _Lone(request, input, output)
        if not self.cycles.run_now(partial(self._lone_ready, lone), partial(self._lone_cycle, lone)):
            return None
        if lone.work is None:
            return Completed()
        handle = lone.work.handle
        while not handle.done() and self.cycles.drive(handle, True):  # its first cycle ran: as a wait's later ones
            pass
        return handle

    def _lone_ready(self, lone: _Lone) -> bool:
        """Whether the lone lane may run `lone` now (the cycle lock held)."""
        if (
            self._stop_requested
            or self._in_flight.queued
            or self._in_flight
            or not self._agreement.quiet
            or self._config() is not None
            or self._joined()
            or not self._timeline_off()
        ):
            return False
        lone.bit = self._agreement.cached_bit(lone.request)
        return lone.bit >= 0

    def _lone_cycle(self, lone: _Lone, spin: bool) -> bool | None:
        """The lone lane's cycle: its round, then its data call, or the rest of a full cycle."""
        try:
            self.rounds += 1
            words = self._agreement.lone_words(lone.bit)
            words = self._agreement.exchange(words, self._spin_s if spin else 0.0, self._frozen, self.rounds)
            response = self._agreement.lone_response(words, lone.bit)
            if response is None:  # the round goes on as any, with the collective announced by its bit
                self.lone_fallbacks += 1
                self._agreement.announce(self._in_flight.hold(lone.submission(self.new_handle)))
                return self._decided(words, None)
            names = self._in_flight.names
            names.agreed((response.key,))
            self._watched(partial(self.executor.reduce_alone, response, lone.input, lone.output))
            names.release([lone.request.name])
            self.lone_runs += 1
            return True
        except BaseException:  # the job's failure reaches the collective as it reaches any in flight
            if lone.work is None:
                self._in_flight.hold(lone.submission(self.new_handle))
            raise

    def new_handle(self, name: str) -> Handle:
        """A handle whose waiting thread may run these rounds' cycles."""
        return Handle(name, self._drive)

    def join(self) -> Handle:
        """This rank called join(): contribute zeros to the set's allreduces until every member has joined."""
        self.joined = True
        request = Request(join_key(self.set_id)[1], OpKind.JOIN, self.set_id)
        self._in_flight.names.reserve(request)
        return self.submit(Submission(request, self.new_handle(request.name)))

    def stop(self, reason: str) -> None:
        """Stop after a final round with the other members (who stop in the same world round): queued and later
        work fails with `reason`. Waits for the thread, unless called from it (a member that fails meanwhile ends
        the final round with an error, which ends the thread too)."""
        self._stop_reason = reason
        self._stop_requested = True
        self._wake.set()
        if threading.current_thread() is not self.thread and not self.cycles.in_cycle:
            self.thread.join()

    def abandon(self, error: HorovodInternalError) -> None:
        """The job failed: fail every collective of these rounds and run no more (no final round: peers may be
        gone)."""
        self.fail_everything(error)
        self.cycles.stopped = True
        self._wake.set()

    def fail_everything(self, error: HorovodInternalError) -> None:
        self._in_flight.fail_all(error)
        self._agreement.forget_work()

    @property
    def graces_skipped(self) -> int:
        return self._idle.graces_skipped

    @property
    def busy(self) -> bool:
        """Whether collectives of this rank are queued or in flight here (tests)."""
        return bool(self._in_flight) or self._in_flight.queued

    # ----------------------------------------------------------------- what the world's rounds add (WorldRounds)
    def _planes_possible(self) -> bool:
        """Whether device planes may run here (then waiting threads do not run the cycles)."""
        return False

    def _control(self, response: Response, work: Submission) -> Any:
        """A control collective only the world's rounds run (ADD_PROCESS_SET and the like)."""
        raise AssertionError(f"{response.kind.name} reached process set {self.set_id}'s own rounds")

    def _joined(self) -> bool:
        return self.joined

    def _timeline_now(self) -> Timeline | None:
        """The timeline this cycle writes: the one written now, swapped only by the world's thread between its
        cycles (a write that comes after a swap closed it is dropped)."""
        current = self._timeline.current
        return None if current is None else current.tolerant()

    def _timeline_off(self) -> bool:
        """Whether no timeline is written now (the lone lane writes none)."""
        return self._timeline.current is None

    def _between_wakes(self) -> None:
        """What an idle rank does at each wake-up that needs no round."""

    def _config(self) -> int | None:
        return None

    def _prepare(self, responses: list[Response]) -> None:
        """Before the responses run: what their first collective of a kind needs (device planes)."""

    def _after(self, words: np.ndarray, responses: list[Response]) -> None:
        """After a cycle ran: autotune."""

    def _stopped(self, flags: int) -> None:
        """The round carried SHUTDOWN or STALL_ABORT: fail what is in flight here with the reason."""
        if flags & STALL_ABORT:  # the whole job stops, as when the world's rounds flag it (the cycle's failure)
            raise HorovodInternalError(self._agreement.stalls.abort_reason())
        reason = self._stop_reason or f"process set {self.set_id}'s rounds were stopped by a peer (shutdown)"
        self.fail_everything(HorovodInternalError(f"{reason}; the collective cannot complete"))

    def _release(self) -> None:
        """The thread stops: release what these rounds hold."""
        try:
            self._doorbell.close()
        except Exception as exc:  # pragma: no cover - best effort at exit
            log.debug("closing process set %d's doorbell failed: %s", self.set_id, exc)

    # ----------------------------------------------------------------- the thread
    def _loop(self) -> None:
        try:
            while not self.cycles.stopped:
                if self.cycles.idle:  # every member saw the same round, so all stop running rounds together
                    self._idle.wait_for_work(self.rounds + 1)
                    self.cycles.run()
                else:
                    self._wake.wait(self._background_wait())  # a submit nobody waits for ends it
                    self._resting = False
                    self._wake.clear()
                    self.cycles.run_if_due(self._has_urgent_work)
        except BaseException as exc:  # the doorbell failed
            self._failed(exc)
        finally:
            self._release()

    def _background_wait(self) -> float:
        """How long the background thread sleeps before its next cycle: until it is due, or, while blocking calls
        run their cycles in the lone lane and this rank has nothing queued or in flight here, _RESTING_CYCLES cycle
        times (at most _MOST_REST_S), unless a submit wakes it first. Its cycles are then for the peers alone, which
        need none of this rank's rounds to complete anything before it submits (it has nothing of theirs), and its
        wake-ups, one each cycle time, cost a loop of lone blocking allreduces a fifth of its speed on two shared
        cores. (Not after a cycle that a waiting thread drove: asynchronous bursts would then pay a wake-up each.)"""
        due = self.cycles.until_background_due()
        if not self.cycles.last_lone:
            return due
        self._resting = True  # before the look below: a submit either sees it or is seen (submit's wake)
        if self.busy or self._stop_requested or self.cycles.stopped:
            self._resting = False
            return due
        self.rests += 1
        return max(due, min(_RESTING_CYCLES * self.tunables.cycle_time_ms / 1e3, _MOST_REST_S))

    def _failed(self, exc: BaseException) -> None:
        """A cycle or the doorbell failed: every set's work fails. A verdict of a set's own rounds (a member frozen or
        stalled) is announced, as a failed rank announces its error, so that the ranks outside the set, which share
        no round with these, name it too."""
        if self.set_id != 0 and isinstance(exc, HorovodInternalError) and peer_failure(self._engine) is None:
            self._engine.announce_failure(str(exc))
        self._fail_job(exc)

    def _has_own_work(self) -> bool:
        """Whether this rank has something for the next round: work submitted since the last one, or a stop."""
        return self._stop_requested or self._in_flight.queued or self.cycles.stopped

    def _has_urgent_work(self) -> bool:
        """Whether the thread's next cycle cannot wait for the cycle time: a stop, or work that no waiting thread
        runs (one that waits runs the cycle for its own work, and this thread taking it would add a round)."""
        return self._stop_requested if self.cycles.waiters_drive else self._has_own_work()

    def _cycle(self, spin: bool) -> bool | None:
        """One cycle: whether any member has work in flight, or None once the rounds stop. `spin`: whether to spin
        while waiting for the peers in the round (Agreement.exchange); not after an idle spell, where the peers
        may still be computing and a spin would take the core this rank's own compute (or a peer's) needs."""
        if self.cycles.stopped:
            return None
        timeline = self._timeline_now()
        for work in self._in_flight.take_queued():
            if timeline:
                timeline.begin(work.request.name, f"NEGOTIATE_{work.request.kind.name}", work.request.kind.name)
            self._agreement.announce(work)
        self._agreement.shadow_held()
        self.rounds += 1
        joined = self._joined()
        flags = (SHUTDOWN if self._stop_requested else 0) | (BUSY if self._in_flight or joined else 0)
        words = self._agreement.words(flags, joined, self._config())
        words = self._agreement.exchange(words, self._spin_s if spin else 0.0, self._frozen, self.rounds)
        return self._decided(words, timeline)

    def _decided(self, words: np.ndarray, timeline: Timeline | None) -> bool | None:
        """The rest of a cycle, once its round's words are in: stop, or run what the round agreed."""
        flags = self._agreement.flags(words)
        if flags & (SHUTDOWN | STALL_ABORT):
            self._stopped(flags)
            return None
        responses = self._agreement.responses(words)
        self._in_flight.names.agreed(response.key for response in responses)
        self._prepare(responses)
        if responses:
            self._run(responses, timeline)
        self._after(words, responses)
        self._agreement.stalls.warn()
        return bool(flags & BUSY)

    def _run(self, responses: list[Response], timeline: Timeline | None) -> None:
        """Run the round's responses. Their data calls wait for the peers as the next round would: a member that
        freezes inside one is named as in a round (each call's wait calls the executor's `alive`), and a member
        blocked in one answers the beacons of the members already waiting in the next round, whose number it
        beacons, so that they name the frozen member only."""
        self._watched(partial(self._dispatcher.run, responses, timeline))

    def _watched(self, run: Callable[[], None]) -> None:
        """`run()` the round's data calls, watched as the next round (`_run`)."""
        round_number, started = self.rounds + 1, time.monotonic()
        self.executor.alive = lambda: self._frozen.waiting(round_number, time.monotonic() - started)
        try:
            run()
        except Exception as exc:  # Gloo's own timeout (at the stall shutdown time) may end the wait first
            self._frozen.raise_if_stalled(round_number, time.monotonic() - started, exc)
            raise
        finally:
            self.executor.alive = None

    def _run_control(self, response: Response, work: Submission) -> Any:
        """A control collective's result, or a data one the executor runs alone (alltoall, barrier)."""
        if response.kind == OpKind.JOIN and self.set_id != 0:  # this set's own join
            self.joined = False
            return response.join_last_rank
        if response.kind in (OpKind.JOIN, OpKind.ADD_PROCESS_SET, OpKind.REMOVE_PROCESS_SET, OpKind.OPEN_CHANNEL):
            return self._control(response, work)
        return self.executor.run(response, work, response.members.index(self._engine.rank))
