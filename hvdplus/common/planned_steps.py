"""What every frozen step plan shares, whatever its framework (torch/planned/reducer.py for DistributedOptimizer,
torch/zero/shard_plan.py for ZeroOptimizer): the plan's own communicator, the registry that join() serves, the
liveness of its waits, its timeline spans, the failure rule it shares with the negotiated path, and the consistency
exchange that names the ranks whose step differs.

A plan is frozen on every member of its process set together (torch/planned/planned.py). From then on its
collectives start from the caller's thread in plan order, with no negotiation; a guard in each step (1 from a rank
that trains, 0 from a rank in join(), NaN from a rank whose step differs) keeps every member's view of the step the
same, and a NaN makes them exchange one consistency word and raise PlanMismatchError together.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from hvdplus.common import basics, collectives
from hvdplus.common.control.frozen import FrozenPeerInspector, failure_of
from hvdplus.common.engines.base import DataEngine, PlannedGroup
from hvdplus.common.exceptions import HorovodInternalError, PlanMismatchError
from hvdplus.common.handles import ALIVE_EVERY_S, Work
from hvdplus.common.ops import ReduceOp
from hvdplus.common.plans.step_plan import (
    Decision,
    agreement_words,
    consistency_words,
    decide,
    plan_digest,
    read_consistency,
)
from hvdplus.common.timeline import Timeline

__all__ = [
    "PlannedStep",
    "Alive",
    "serve_joined",
    "frozen_plans",
    "settings_allow",
    "agree_to_freeze",
    "open_planned_group",
]

log = logging.getLogger("hvdplus")

# Plans frozen on this rank: join() runs their steps with zeros while other ranks still train. Held weakly: an
# optimizer the program dropped releases its buffers and communicator with it (weakref.finalize). Every member
# must serve the same plans, so join() first runs a full garbage collection, after which the plans left are
# those the program still holds, the same on every rank.
_FROZEN: weakref.WeakSet[PlannedStep] = weakref.WeakSet()
_JOIN_POLL_S = 1e-3
# The beacons of the plans' waits travel on streams of their own, above the control rounds' (process set ids).
_PLAN_STREAMS, _PLAN_STREAM_SPAN = 1 << 20, 1 << 20


def settings_allow(on_device: bool = False) -> bool:
    """Whether the job's settings let an optimizer's plan freeze: not when the user asked for negotiation
    (HVDPLUS_PLANNED_PATH=0), or for what only the executor does: autotune, and for tensors on the host engine
    hierarchical allreduce (the executor runs it on host buffers only: a device plane's tensors, `on_device`, take
    the plane's own allreduce on the negotiated path too)."""
    settings = basics.runtime().settings
    hierarchical = settings.hierarchical_allreduce and not on_device
    return settings.planned_path and not hierarchical and not settings.autotune


def agree_to_freeze(
    carrier: str | None, items: list[Any], name: str, process_set: basics.ProcessSet
) -> tuple[list[int], int] | Decision:
    """Collective over the process set: agree, under `name`, on freezing the plan that `items` describe, carried on
    the plane named `carrier` ('host', or a device plane's kind; None: this rank cannot take the planned path).
    (The set's global ranks, the plan's digest), or the decision not to freeze (yet). One negotiated MIN allreduce
    decides, by a name that depends on nothing a rank counts (ranks in join() or in a new elastic generation have
    counted different steps)."""
    rt = basics.runtime()
    set_id = process_set.process_set_id or 0
    ranks = list(range(rt.size)) if set_id == 0 else list(process_set.ranks)
    digest = plan_digest([ranks, "" if carrier is None else carrier, *items])
    words = agreement_words(carrier is not None, digest)
    collectives.submit_allreduce(words, words, "int64", name, ReduceOp.MIN, process_set=process_set).wait()
    decision = decide(words, digest)
    return (ranks, digest) if decision == Decision.FREEZE else decision


def open_planned_group(engine: Any, ranks: list[int], process_set: basics.ProcessSet) -> PlannedGroup:
    """Collective over the set's `ranks`: a new planned group of `engine`, closed at shutdown at the latest."""
    rt = basics.runtime()
    set_id = process_set.process_set_id or 0
    # Freezes happen on every member together, so each member counts the same groups (per job and set).
    key = set_id * 65536 + int(rt.auto_name("planned_group", set_id).rsplit(".", 1)[1])
    alive = Alive(rt, len(ranks), "the opening of a planned group")  # a member that died before arriving ends the wait
    group: PlannedGroup = engine.open_planned(ranks, key, rt.settings.stall_shutdown_time_seconds or None, alive)
    rt.coordinator.close_at_shutdown(group)
    return group


def frozen_plans() -> list[PlannedStep]:
    """The plans frozen on this rank and not dropped yet (any job's)."""
    return list(_FROZEN)


class PlannedStep:
    """A frozen step plan of one optimizer on one process set, and the communicator its collectives use. A
    framework's plan adds its buffers; `buffer_of` turns one of them into what `group` reduces."""

    what = "a planned step"  # how messages name one of the plan's collectives
    title = "the planned step"  # and the plan's step, with its optimizer

    def __init__(
        self,
        engine: DataEngine,
        group: PlannedGroup,
        ranks: Sequence[int],
        digest: int,
        host: bool,
        buffer_of: Callable[[Any], Any],
        guard_group: PlannedGroup | None = None,
    ) -> None:
        """`engine`: the engine whose collectives run on `group` (the host engine, or a device plane's). `ranks`: the
        process set's global ranks. `host`: whether `engine` is the host engine (else a device plane's).
        `buffer_of`: the framework's buffer as `engine` takes it (a numpy view of a host tensor for the host
        engine; a device plane's tensor as it is). `guard_group`: a planned group of the host engine that sums
        the step's guard as a host word, for a device plane's plan (reading a reduced device element would hold the
        training thread until the GPU drained: reducer.py)."""
        self.runtime = basics.runtime()
        self._engine, self._group, self._ranks, self._digest = engine, group, tuple(ranks), digest
        self._set_rank = self._ranks.index(self.runtime.rank)
        # A member that stops answering (frozen, hung) is named as in the control rounds: each member counts the
        # plan's waits alike (they run in plan order everywhere) and beacons on the plan's own stream, which is the
        # same on every member (identical plans are told apart by how many came before).
        twins = self.runtime.auto_name(f"plan{digest}", 0)
        stream = _PLAN_STREAMS + zlib.crc32(twins.encode()) % _PLAN_STREAM_SPAN
        self._frozen = FrozenPeerInspector(
            self.runtime.engine,
            self.runtime.settings,
            stream,
            self._ranks,
            "a planned step",
            "it may be frozen or hung, or have stopped calling optimizer.step() (or join())",
        )
        self._waits = 0
        self._serving: Alive | None = None  # join()'s alive for the wait it serves (check_served_step); its polls'
        # engine errors name the members that did not answer it, as a wait's do
        self.host, self._buffer = host, buffer_of
        _FROZEN.add(self)
        self._release = weakref.finalize(self, group.close)  # at close(), or when the optimizer is collected
        self._guard_group = guard_group
        self._guard_word = np.zeros(1, dtype=np.float32)  # this rank's guard, then the sum (with a guard group)
        if guard_group is not None:
            self._release_guard_group = weakref.finalize(self, guard_group.close)

    @property
    def closed(self) -> bool:
        """Whether the plan was dropped (a failed step, an engine error, a new job): the optimizer negotiates."""
        return self not in _FROZEN

    @property
    def stale(self) -> bool:
        """Closed, or frozen in an earlier job (an elastic reset, or shutdown() and init()), whose ranks agree
        afresh: the optimizer negotiates."""
        return self.closed or not basics.is_initialized() or self.runtime is not basics.runtime()

    def close(self) -> None:
        """Drop the plan: release its communicator (once; later calls do nothing) and the collectives in flight
        on it, which are abandoned (a Gloo work kept alive keeps the group's context to interpreter exit)."""
        _FROZEN.discard(self)
        self._abandon()
        self._release()
        if self._guard_group is not None:
            self._release_guard_group()

    def _start_guard_word(self, value: float) -> Work:
        """Start summing this rank's guard `value` as a host word on the guard group (there must be one)."""
        assert self._guard_group is not None
        self._guard_word[0] = value
        return self.runtime.engine.start_allreduce(self._guard_word, "float32", ReduceOp.SUM, self._guard_group)

    def _abandon(self) -> None:
        """Forget the work in flight (each kind of plan keeps its own)."""

    def _trace_start(self, names: Sequence[str], kind: str) -> Timeline | None:
        """Open the timeline spans of a planned collective on its tensors' rows (`kind`, and PLANNED_`kind`
        inside it); the timeline they went to, or None (no timeline, or stopped meanwhile)."""
        timeline = self.runtime.coordinator.timeline
        if timeline is None:
            return None
        try:
            timeline.begin(names, kind, kind)
            timeline.begin(names, f"PLANNED_{kind}")
        except RuntimeError:  # closed by a swap under this thread: the events are dropped
            return None
        return timeline

    @staticmethod
    def _trace_end(timeline: Timeline | None, names: Sequence[str]) -> None:
        """Close the spans `_trace_start` opened, once this thread saw the collective complete."""
        if timeline is not None:
            try:
                timeline.end(names)
                timeline.end(names)
            except RuntimeError:
                pass

    def _alive(self) -> Alive:
        """The `alive` of this plan's next wait (one per wait, counted alike on every member)."""
        self._waits += 1
        return Alive(self.runtime, self._group.size, self.what, self._frozen, self._waits)

    def check_served_step(self, since: float) -> None:
        """join()'s liveness check of the step it serves (started at `since`, time.monotonic), as a training
        member's wait makes: counted as the wait the training members are in (the plan's next, after those of the
        served step already complete here), so that a rank in join() answers their beacons as a training member
        does, and names a member that froze instead of being named with it. Its failure fails the job, as a
        wait's does."""
        round_number = self._waits + 1 + self._joined_waits_done()
        if self._serving is None or self._serving.round_number != round_number:
            self._serving = Alive(self.runtime, self._group.size, self.what, self._frozen, round_number, since)
        with self._engine_errors(self._serving):
            self._serving()

    @contextmanager
    def _engine_errors(self, waiting: Alive | None = None) -> Iterator[None]:
        """An engine's error (a peer died: Gloo's connection closed) ends the plan and becomes the error the
        negotiated path raises for a failed collective (control/frozen.py `failure_of`: it names a peer that
        announced its failure, or announces this rank's), which elastic training recovers from, and fails the
        job. In a wait (`waiting`, its alive) that lasted past the stall check, it names the members that did not
        answer it instead, unless one announced a failure: Gloo ends such a wait with a timeout of its own."""
        try:
            yield
        except HorovodInternalError as exc:
            self._failed(exc)
            raise
        except Exception as exc:
            error = self._error_of(exc, waiting)
            self._failed(error)
            try:
                raise error from exc
            finally:  # a local that holds the error (whose traceback holds this frame) would keep the step's
                del error  # engine work alive past an elastic reset: a survivor blocked in it would wait forever

    def _error_of(self, exc: Exception, waiting: Alive | None) -> HorovodInternalError:
        """The error an engine's `exc` becomes (see _engine_errors)."""
        engine = self.runtime.engine
        stalled = None if waiting is None else waiting.stalled()
        return stalled if stalled is not None else failure_of(engine, exc)

    def _failed(self, error: HorovodInternalError) -> None:
        """The plan's collective failed: a job failure, as a failed round is (every later call raises it, and
        shutdown runs no final round that would wait for a frozen peer too). The runtime keeps a copy without
        `error`'s traceback and cause, which hold the step's engine work: an elastic reset must release it, or a
        survivor still blocked in the step's collective on Gloo waits for its connections forever."""
        self.close()
        self.runtime.coordinator.fail(HorovodInternalError(str(error)))

    def _fail(self, differs: list[str], training: bool) -> None:
        """A rank's step differed: every rank exchanges one consistency word to learn which, and raises. The word
        travels on a host engine's group: the plan's own, or the guard group of a device plane's plan (which has
        one wherever it has peers)."""
        words = consistency_words(self._set_rank, self._group.size, self._digest, training, bool(differs))
        if self._group.size > 1:
            host_group = self._group if self._guard_group is None else self._guard_group
            alive = self._alive()
            with self._engine_errors(alive):
                self.runtime.engine.start_allreduce(words, "int64", ReduceOp.SUM, host_group).wait(alive)
        consistency = read_consistency(words, self._group.size, self._digest)
        who = [self._ranks[i] for i in consistency.differing]
        text = (
            f"{self.title} cannot complete this step: the step of rank(s) {who} differs from the plan frozen on "
            f"every rank (a changed model)"
        )
        if not consistency.digests_agree:
            text += " (and the ranks ran plans with different digests)"
        if differs:
            text += f"; here: {'; '.join(differs[:3])}"
        self.close()
        raise PlanMismatchError(
            text + ". The step's gradients are partly reduced and not usable; the next step negotiates again."
        )

    # ----------------------------------------------------------------- join
    def start_joined_step(self) -> None:
        """In join(): start this plan's collectives with zeros (guard 0), as the training ranks start theirs."""
        raise NotImplementedError

    def joined_step_done(self) -> bool:
        """Without blocking: whether the step `start_joined_step` started has completed."""
        raise NotImplementedError

    def end_joined_step(self) -> bool:
        """After a completed joined step: whether to stop serving this plan (every rank joined, or the plan
        ended on every rank)."""
        raise NotImplementedError

    def _joined_waits_done(self) -> int:
        """Of the waits a training member counts in the step being served, how many are complete here (a plan
        that waits for its whole step at once: none until it ends)."""
        return 0


class Alive:
    """Called about once a second while a planned step waits: raise once hvdplus has failed; name the members that
    do not answer (`frozen`, for the plan's wait number `round_number`: warn after the stall check time, raise
    after the shutdown time), or without an inspector warn once about a stall."""

    def __init__(
        self,
        runtime: basics.Runtime,
        size: int,
        what: str = "a planned step",
        frozen: FrozenPeerInspector | None = None,
        round_number: int = 0,
        started: float | None = None,
    ) -> None:
        """`started`: when the wait began (time.monotonic; default: now)."""
        self._runtime, self._warned = runtime, False
        self._started = time.monotonic() if started is None else started
        self._size, self._what = size, what
        self._frozen, self.round_number = frozen, round_number

    def stalled(self) -> HorovodInternalError | None:
        """The error naming the members that have not answered this wait, once it has lasted long enough to tell
        (FrozenPeerInspector.stalled); else None."""
        if self._frozen is None:
            return None
        return self._frozen.stalled(self.round_number, time.monotonic() - self._started)

    def __call__(self) -> None:
        if not self._runtime.coordinator.running:
            why = self._runtime.coordinator.failure
            stopped = f"hvdplus stopped while {self._what} was in flight"
            raise HorovodInternalError(f"{stopped}: {why}" if why else stopped)
        waited = time.monotonic() - self._started
        if self._frozen is not None:
            self._frozen.waiting(self.round_number, waited)
            return
        settings = self._runtime.settings
        if not self._warned and not settings.stall_check_disable and waited > settings.stall_check_time_seconds:
            self._warned = True
            log.warning(
                "%s has waited %.0f s for the other %d rank(s) of its process set: a rank may have stopped "
                "calling optimizer.step() (or join())",
                self._what,
                waited,
                self._size - 1,
            )
        limit = settings.stall_shutdown_time_seconds
        if limit > 0 and waited > limit:
            raise HorovodInternalError(
                f"{self._what} stalled longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={limit:g}"
            )


def serve_joined() -> None:
    """join(): while other ranks still train, run every frozen plan's steps with zeros, as the negotiated path
    contributes zeros to their collectives. Each plan is served until its step shows that no rank trains any more,
    or that the plan ended on every rank."""
    current = basics.runtime()
    if _FROZEN:  # plans of optimizers the program dropped go now, on every rank alike (a full collection takes
        gc.collect()  # ~75 ms with torch loaded, holding the GIL: only where a plan could be among the garbage)
    for stale in [plan for plan in _FROZEN if plan.runtime is not current]:  # an earlier job's
        stale.close()
    serving = list(_FROZEN)
    started: dict[PlannedStep, float] = {}
    for plan in serving:
        plan.start_joined_step()
        started[plan] = time.monotonic()
    checked = time.monotonic()
    while serving:
        time.sleep(_JOIN_POLL_S)
        # Twice as often as a training member's wait calls its alive (reading the peers' notices costs an engine
        # call): this rank's beacon must reach the training members before they judge who is silent, and its
        # polls are not aligned with their waits.
        if time.monotonic() - checked >= ALIVE_EVERY_S / 2:
            checked = time.monotonic()
            for plan in serving:
                plan.check_served_step(started[plan])
        for plan in [plan for plan in serving if plan.joined_step_done()]:
            if plan.end_joined_step():
                serving.remove(plan)
            else:
                plan.start_joined_step()
                started[plan] = time.monotonic()
