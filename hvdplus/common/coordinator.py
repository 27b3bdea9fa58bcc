"""The background thread: queue -> negotiate -> fuse -> execute -> complete handles.

Every rank runs the same cycle in lock step. Each cycle costs one small bitwise-AND allreduce
(the response-cache bits plus flags), whose size does not depend on the number of ranks; announcements
not in the cache are exchanged merged (common/announcements.py: ranks that agree share one entry), and
every rank derives the same ordered list of responses from the same table (common/agreement.py). This module
runs the steps of a cycle; which thread runs it is common/cycles.py's choice.

The control allreduce is non-blocking and waited for without spinning a core (a peer that is busy
computing would otherwise make this thread poll MPI for as long). While work is in flight on any rank,
cycles follow HOROVOD_CYCLE_TIME. Once a round shows that no rank has work, no round runs at all until a rank has
work or a peer rings (common/idle_spells.py). Join, process sets, channels and device planes are
common/control_collectives.py's.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from hvdplus.common.agreement import BUSY, SHUTDOWN, STALL_ABORT, Agreement
from hvdplus.common.autotune import TuningRun
from hvdplus.common.buffer_ops import DataPlane, DeviceKind
from hvdplus.common.control_collectives import ControlCollectives
from hvdplus.common.cycles import Cycles
from hvdplus.common.dispatch import Dispatcher
from hvdplus.common.engines.base import Engine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.executor import Executor, Work
from hvdplus.common.frozen import FrozenPeerInspector, failure_of, ranks_that_shut_down
from hvdplus.common.handles import Handle
from hvdplus.common.idle_spells import IdleSpells
from hvdplus.common.in_flight import InFlight
from hvdplus.common.messages import Request
from hvdplus.common.negotiation import device_kind
from hvdplus.common.ops import OpKind
from hvdplus.common.set_table import ProcessSetTable
from hvdplus.common.settings import Settings
from hvdplus.common.timeline import Timeline, TimelineSlot
from hvdplus.common.topology import Topology
from hvdplus.common.tunables import Tunables

__all__ = ["Coordinator", "control_spin_s"]

log = logging.getLogger("hvdplus")

# How long a rank spins for the control round while work is in flight (Agreement.exchange). On a host that runs
# more ranks than it has cores, the core a rank spins on is the one a peer needs, so it spins only briefly (3 ranks
# on 2 cores, MPI, 3000 lone allreduces: 12.6-14.0 s spinning 2 ms, 7.5-8.4 s not spinning, 6.5-7.1 s spinning
# 0.3 ms; the median call stays at ~0.33 ms only with a spin).
_SPIN_S, _CROWDED_SPIN_S = 2e-3, 3e-4
_FAILED_JOIN_S = 2.0


def control_spin_s(local_ranks: int) -> float:
    """How long a rank spins for a busy control round, for a host running `local_ranks` ranks. The host's cores,
    not this process's affinity: a launcher that binds each rank to its own cores leaves every rank a core."""
    return _SPIN_S if local_ranks <= (os.cpu_count() or 1) else _CROWDED_SPIN_S


class Coordinator:
    """Owns the engine after init: all collectives of this process run in its cycles, on its background thread or
    on a thread that waits for one (common/cycles.py)."""

    def __init__(
        self, engine: Engine, settings: Settings, topology: Topology, device_kinds: dict[str, DeviceKind] | None = None
    ) -> None:
        """`device_kinds`: the device kinds every rank can reduce on a plane of its own (`agreed_device_kinds`)."""
        self._engine = engine
        self.rank, self.size = engine.rank, engine.size
        self.tunables = Tunables.from_settings(settings)
        self._spin_s = control_spin_s(topology.local_size)
        # Device kinds every rank can reduce on a plane of their own: their tensors go to the core as they are
        # (adapters read `device_kinds` per tensor: a tuple). A plane is built at its kind's first collective.
        self._device_kinds: dict[str, DeviceKind] = device_kinds or {}
        self.device_kinds = tuple(self._device_kinds)
        self._planes: dict[str, DataPlane] = {}
        self._sets = ProcessSetTable(engine, settings, topology)
        self._wake = threading.Event()
        self._doorbell = engine.open_doorbell(self._wake.set)
        # Only this thread writes the timeline; others replace it through the slot, between cycles (set_timeline).
        self._timeline = TimelineSlot(
            Timeline(settings.timeline, settings.timeline_mark_cycles) if settings.timeline and self.rank == 0 else None
        )
        self._idle = IdleSpells(self._doorbell, self._wake, self.rank, self._has_own_work, self._timeline.settle)
        self._tuning = (
            TuningRun(self.tunables, settings, self.rank, self._sets[0].hierarchy is not None, len(topology.hosts))
            if settings.autotune
            else None
        )
        self._executor = Executor(engine, lambda set_id: self._sets[set_id], self.tunables, self._planes)
        self._frozen = FrozenPeerInspector(engine, settings)
        self._in_flight = InFlight()
        self._control = ControlCollectives(
            engine, settings, topology, self._sets, self._device_kinds, self._planes, self._executor
        )
        self._dispatcher = Dispatcher(
            self.rank, self._executor, self._in_flight, self._planes, self.tunables, engine, self._control.run
        )
        self._agreement = Agreement(
            engine, lambda: self._sets[0].group, settings, self._sets.members, self._sets.index_in
        )
        self._shutdown_requested = False
        self._fatal: BaseException | None = None
        self.rounds = 0  # control rounds run so far (a test checks that idle ranks run none)
        # Device planes stay on the background thread: a waiting thread's current stream may be the user's.
        self._cycles = Cycles(
            self._cycle, self._fail, inline=not self._device_kinds, period_s=lambda: self.tunables.cycle_time_ms / 1e3
        )
        self._thread = threading.Thread(target=self._loop, name="hvdplus-coordinator", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- public, any thread
    def submit(self, request: Request, input: np.ndarray | None = None, output: np.ndarray | None = None) -> Handle:
        """Queue one collective; the handle completes when every rank has run it."""
        if self._fatal is not None:
            raise HorovodInternalError(f"hvdplus can no longer run collectives: {self._fatal}")
        if request.process_set not in self._sets:
            raise ValueError(f"process set {request.process_set} does not exist (it was removed or never added)")
        if self._sets[request.process_set].index is None:
            raise ValueError(
                f"rank {self.rank} is not a member of process set {request.process_set} "
                f"(ranks {list(self._sets[request.process_set].ranks)}); only members may submit"
            )
        self._in_flight.reserve(request.name)
        work = Work(request, Handle(request.name, self._cycles.drive), input, output)
        if self.device_kinds and input is not None and not isinstance(input, np.ndarray):  # a device tensor
            work.ready = self._device_kinds[device_kind(request.device)].ops.ready(input)
        self._in_flight.put(work)
        # Event.set costs more than the check, and bursts need only one. Read after the put: a thread that goes idle
        # after this check finds the work queued (IdleSpells.wait_for_work looks before it sleeps).
        if not self._wake.is_set() and not self._cycles.waiters_drive:
            self._wake.set()
        if self._fatal is not None:  # the thread stopped while we queued: nobody will run this work
            work.handle.set_error(HorovodInternalError(f"hvdplus can no longer run collectives: {self._fatal}"))
        return work.handle

    @property
    def timeline(self) -> Timeline | None:
        """The timeline written now (rank 0's, when one is on), which the planned path writes beside this thread."""
        return self._timeline.current

    def set_timeline(self, timeline: Timeline | None) -> None:
        """Write `timeline` from the next cycle on (None: stop) and close the one it replaces. The background
        thread makes the swap between its cycles, where it holds no timeline; this returns once it has (at once
        if the thread has stopped), so the replaced file is complete and closed."""
        swap = self._timeline.replace(timeline)
        if swap is None or threading.current_thread() is self._thread or self._cycles.in_cycle:  # cannot wait
            return
        self._wake.set()  # an idle thread settles it where it sleeps, without starting a round
        swap.wait()

    def close_at_shutdown(self, channel: Any) -> None:
        """Close `channel` (a planned group) when the thread stops, if it is still alive then (held weakly: its
        owner may release it earlier)."""
        self._control.close_at_shutdown(channel)

    def process_set_ranks(self, set_id: int) -> tuple[int, ...] | None:
        return self._sets.ranks(set_id)

    def shutdown(self) -> None:
        """Stop the thread once every rank's cycle sees the request (any rank's request stops all)."""
        self._shutdown_requested = True
        self._wake.set()
        if threading.current_thread() is not self._thread and not self._cycles.in_cycle:  # (a signal handler's)
            # After a failure the thread only releases the engine, which can wait on a frozen peer until the
            # transport's own timeout: do not hold the process's exit for it (the thread is a daemon).
            self._thread.join(_FAILED_JOIN_S if self._fatal is not None else None)

    @property
    def graces_skipped(self) -> int:
        """Rings this rank joined at once, having had no work of its own lately (common/idle_spells.py)."""
        return self._idle.graces_skipped

    @property
    def driven_cycles(self) -> int:
        """Cycles run so far by threads waiting for a collective rather than by the background thread."""
        return self._cycles.driven

    @property
    def largest_batch(self) -> dict[OpKind, int]:
        """The most collectives of each kind that one engine call carried so far (fusion tests read it)."""
        return dict(self._executor.largest_batch)

    @property
    def plane_runs(self) -> dict[str, int]:
        """Engine calls run on each device plane so far, by plane name (tests check the device path ran)."""
        return dict(self._executor.plane_runs)

    @property
    def plane_tensors(self) -> dict[str, int]:
        """Tensors those engine calls carried, by plane name (more tensors than calls: fusion happened)."""
        return dict(self._executor.plane_tensors)

    @property
    def built_planes(self) -> tuple[str, ...]:
        """The device planes built so far: each at its device kind's first collective."""
        return tuple(plane.name for plane in self._planes.values())

    def plane_engine(self, kind: str) -> Any | None:
        """The engine of device kind `kind`'s plane, once built (the planned path opens its groups on it)."""
        plane = self._planes.get(kind)
        return None if plane is None else plane.engine

    @property
    def hierarchical_runs(self) -> dict[str, int]:
        """Engine calls run hierarchically so far, by kind and cross-host algorithm (tests and benchmarks)."""
        return dict(self._executor.hierarchical_runs)

    @property
    def autotune_done(self) -> bool:
        """On rank 0 with autotune on: whether the search has settled on its best configuration."""
        return self._tuning is not None and self._tuning.done

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """Why this rank's collectives can no longer run (a failure, a shutdown); None while they can."""
        return self._fatal

    @property
    def thread_id(self) -> int | None:
        """The background thread's ident (benchmarks read its CPU clock: an idle job's, since while the ranks are
        busy threads that wait for collectives run most cycles)."""
        return self._thread.ident

    # ----------------------------------------------------------------- background thread
    def _loop(self) -> None:
        try:
            while not self._cycles.stopped:
                if self._cycles.idle:  # every rank saw the same round, so all stop running rounds together
                    self._idle.wait_for_work(self.rounds + 1)
                    self._cycles.run()
                else:
                    self._wake.wait(self._cycles.until_due())  # a submit nobody waits for ends it at once
                    self._wake.clear()
                    self._cycles.run_if_due(self._has_urgent_work)
        except BaseException as exc:  # the doorbell failed
            self._fail(exc)
        finally:
            for release in [
                self._timeline.retire,
                *self._control.closers(),
                self._doorbell.close,
                *(plane.engine.shutdown for plane in self._planes.values()),
                self._engine.shutdown,
            ]:
                try:  # each on its own: a failing one must not keep the host engine's resources
                    release()
                except Exception as exc:  # pragma: no cover - best effort at exit
                    log.debug("shutdown of %s failed: %s", release, exc)
            self._sets.release()

    def _fail(self, exc: BaseException) -> None:
        """A cycle or the doorbell failed (engine failure, a failed or frozen peer): every pending and future call
        fails, and the background thread stops."""
        error = failure_of(self._engine, exc)
        log.error("hvdplus background thread failed: %s", error)
        self._fatal = error
        self._fail_everything(error)
        self._wake.set()

    def _has_own_work(self) -> bool:
        """Whether this rank has something for the next round: work submitted since the last one, or a shutdown."""
        return self._shutdown_requested or self._in_flight.queued

    def _has_urgent_work(self) -> bool:
        """Whether the background thread's next cycle cannot wait for the cycle time: a shutdown, or work that no
        waiting thread runs (one that waits runs the cycle for its own work, and the background thread taking it
        would add a round)."""
        return self._shutdown_requested if self._cycles.waiters_drive else self._has_own_work()

    def _drain_queue(self, timeline: Timeline | None) -> None:
        for work in self._in_flight.take_queued():
            if timeline:
                timeline.begin(work.request.name, f"NEGOTIATE_{work.request.kind.name}")
            self._agreement.announce(work)

    def _cycle(self, spin: bool) -> bool | None:
        """One negotiation cycle: whether any rank has work in flight, or None once the job shuts down. `spin`:
        whether to spin while waiting for the peers in the control round (see Agreement.exchange); it does not
        after an idle spell: the peers may still be computing, and a spin would take the core this rank's own
        compute (or, on a shared host, a peer's) needs."""
        timeline = self._timeline.settle()  # the one this cycle writes, whatever other threads ask meanwhile
        if timeline:
            timeline.cycle()
        self._drain_queue(timeline)
        self.rounds += 1
        joined = self._control.joined
        flags = (SHUTDOWN if self._shutdown_requested else 0) | (BUSY if self._in_flight or joined else 0)
        config = None if self._tuning is None else self._tuning.word()
        words = self._agreement.words(flags, joined, config)
        words = self._agreement.exchange(words, self._spin_s if spin else 0.0, self._frozen, self.rounds)
        flags = self._agreement.flags(words)
        if flags & (SHUTDOWN | STALL_ABORT):
            self._stop(flags)
            return None
        responses = self._agreement.responses(words)
        self._control.build_planes(responses)
        self._dispatcher.run(responses, timeline)
        if self._tuning is not None:
            self._tuning.after_cycle(self._agreement.config(words), responses)
        self._agreement.stalls.warn()
        return bool(flags & BUSY)

    def mark_joined(self) -> None:
        """Called by join(): from now on this rank contributes zeros to every allreduce."""
        self._control.joined = True

    # ----------------------------------------------------------------- shutdown
    def _stop(self, flags: int) -> None:
        if flags & STALL_ABORT:
            reason = self._agreement.stalls.abort_reason()
        else:
            reason = f"hvdplus was shut down on {ranks_that_shut_down(self._engine, self._shutdown_requested)}"
        self._fatal = HorovodInternalError(reason)
        self._fail_everything(HorovodInternalError(f"{reason}; the collective cannot complete"))

    def _fail_everything(self, error: HorovodInternalError) -> None:
        self._in_flight.fail_all(error)
        self._agreement.forget_work()
