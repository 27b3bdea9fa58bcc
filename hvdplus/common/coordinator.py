"""The background threads: queue -> negotiate -> fuse -> execute -> complete handles, in the rounds of each set of
ranks (common/set_rounds.py): the whole job's, and each process set's own, which its members run alone.

In each set's rounds every member runs the same cycle in lock step. Each cycle costs one small bitwise-AND
allreduce (the response-cache bits plus flags), whose size does not depend on the number of ranks; announcements
not in the cache are exchanged merged (common/announcements.py: ranks that agree share one entry), and every member
derives the same ordered list of responses from the same table (common/agreement.py). While work is in flight,
cycles follow HOROVOD_CYCLE_TIME; once a round shows that no member has work, none runs until a member has work or
a peer rings (common/idle_spells.py). Join, process sets, channels and device planes are
common/control_collectives.py's, run in the whole job's rounds.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from hvdplus.common.buffer_ops import DataPlane, DeviceKind
from hvdplus.common.engines.base import Engine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.executor import Work
from hvdplus.common.frozen import failure_of
from hvdplus.common.handles import Handle
from hvdplus.common.in_flight import Names
from hvdplus.common.messages import Request
from hvdplus.common.negotiation import device_kind
from hvdplus.common.ops import OpKind
from hvdplus.common.set_rounds import RoundsContext, SetRounds
from hvdplus.common.set_table import ProcessSetTable
from hvdplus.common.settings import Settings
from hvdplus.common.timeline import Timeline, TimelineSlot
from hvdplus.common.topology import Topology
from hvdplus.common.tunables import Tunables
from hvdplus.common.world_rounds import WorldEvents, WorldRounds

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
    """Owns the engine after init: every collective of this process runs in the rounds of its set, on their
    background thread or on a thread that waits for one (common/cycles.py)."""

    def __init__(
        self, engine: Engine, settings: Settings, topology: Topology, device_kinds: dict[str, DeviceKind] | None = None
    ) -> None:
        """`device_kinds`: the device kinds every rank can reduce on a plane of its own (`agreed_device_kinds`)."""
        self._engine, self._settings = engine, settings
        self.rank, self.size = engine.rank, engine.size
        self.tunables = Tunables.from_settings(settings)
        self._spin_s = control_spin_s(topology.local_size)
        # Device kinds every rank can reduce on a plane of their own: their tensors go to the core as they are
        # (adapters read `device_kinds` per tensor: a tuple). A plane is built at its kind's first collective.
        self._device_kinds: dict[str, DeviceKind] = device_kinds or {}
        self.device_kinds = tuple(self._device_kinds)
        self._planes: dict[str, DataPlane] = {}
        self._sets = ProcessSetTable(engine, settings, topology)
        self._names = Names()
        self._fatal: BaseException | None = None
        self._set_rounds: dict[int, SetRounds] = {}  # the rounds of each process set this rank is in
        self._set_joins: list[Handle] = []  # join() in those rounds, which the world's join waits for
        # Only the world's thread swaps the timeline; others write it (set_timeline).
        self._timeline = TimelineSlot(
            Timeline(settings.timeline, settings.timeline_mark_cycles) if settings.timeline and self.rank == 0 else None
        )
        self._context = RoundsContext(
            engine, settings, self._sets, self._names, self._spin_s, self._timeline, self._fail
        )
        wake = threading.Event()
        doorbell = engine.open_doorbell(wake.set)
        assert doorbell is not None  # every rank is in the world's
        self._world = WorldRounds(
            self._context,
            topology,
            wake,
            doorbell,
            self.tunables,
            self._planes,
            self._device_kinds,
            WorldEvents(
                self._stopped,
                self._stop_set_rounds,
                self._open_set_rounds,
                self._close_set_rounds,
                self._finish_set_joins,
            ),
        )
        self._world.thread.start()

    # ----------------------------------------------------------------- public, any thread
    def submit(self, request: Request, input: np.ndarray | None = None, output: np.ndarray | None = None) -> Handle:
        """Queue one collective; the handle completes when every member of its set has run it."""
        if self._fatal is not None:
            raise HorovodInternalError(f"hvdplus can no longer run collectives: {self._fatal}")
        if request.process_set not in self._sets:
            raise ValueError(f"process set {request.process_set} does not exist (it was removed or never added)")
        if self._sets[request.process_set].index is None:
            raise ValueError(
                f"rank {self.rank} is not a member of process set {request.process_set} "
                f"(ranks {list(self._sets[request.process_set].ranks)}); only members may submit"
            )
        on_device = input is not None and not isinstance(input, np.ndarray)
        # Device tensors travel in the world's rounds, which own the device planes.
        rounds = self._world if request.process_set == 0 or on_device else self._set_rounds.get(request.process_set)
        if rounds is None:  # removed since the check above
            raise ValueError(f"process set {request.process_set} does not exist (it was removed or never added)")
        self._names.reserve(request)
        work = Work(request, rounds.new_handle(request.name), input, output)
        if on_device:
            work.ready = self._device_kinds[device_kind(request.device)].ops.ready(input)
        rounds.submit(work)
        if self._fatal is not None:  # the threads stopped while we queued: nobody will run this work
            work.handle.set_error(HorovodInternalError(f"hvdplus can no longer run collectives: {self._fatal}"))
        return work.handle

    def mark_joined(self) -> None:
        """Called by join(), before it submits: from now on this rank contributes zeros to every allreduce, in the
        world's rounds and in those of each of its process sets."""
        self._world.control.joined = True
        self._set_joins = [rounds.join() for rounds in list(self._set_rounds.values())]

    @property
    def timeline(self) -> Timeline | None:
        """The timeline written now (rank 0's, when one is on), which the planned path writes beside the rounds."""
        return self._timeline.current

    def set_timeline(self, timeline: Timeline | None) -> None:
        """Write `timeline` from the world's next cycle on (None: stop) and close the one it replaces. The world's
        thread makes the swap between its cycles; this returns once it has (at once if the thread has stopped), so
        the replaced file is complete and closed."""
        swap = self._timeline.replace(timeline)
        if swap is None or threading.current_thread() is self._world.thread or self._world.cycles.in_cycle:
            return
        self._world.wake()  # an idle thread settles it where it sleeps, without starting a round
        swap.wait()

    def close_at_shutdown(self, channel: Any) -> None:
        """Close `channel` (a planned group) when the thread stops, if it is still alive then (held weakly: its
        owner may release it earlier)."""
        self._world.control.close_at_shutdown(channel)

    def process_set_ranks(self, set_id: int) -> tuple[int, ...] | None:
        return self._sets.ranks(set_id)

    def shutdown(self) -> None:
        """Stop the threads once every rank's world round sees the request (any rank's request stops all)."""
        self._world.request_stop()
        if threading.current_thread() is not self._world.thread and not self._world.cycles.in_cycle:
            # After a failure the thread only releases the engine, which can wait on a frozen peer until the
            # transport's own timeout: do not hold the process's exit for it (the thread is a daemon).
            self._world.thread.join(_FAILED_JOIN_S if self._fatal is not None else None)

    # ----------------------------------------------------------------- counters (tests, benchmarks)
    @property
    def _all_rounds(self) -> list[SetRounds]:
        return [self._world, *self._set_rounds.values()]

    @property
    def rounds(self) -> int:
        """Control rounds run so far, in every set's rounds (a test checks that idle ranks run none)."""
        return sum(rounds.rounds for rounds in self._all_rounds)

    @property
    def graces_skipped(self) -> int:
        """Rings this rank joined at once, having had no work of its own lately (common/idle_spells.py)."""
        return sum(rounds.graces_skipped for rounds in self._all_rounds)

    @property
    def driven_cycles(self) -> int:
        """Cycles run so far by threads waiting for a collective rather than by the background threads."""
        return sum(rounds.cycles.driven for rounds in self._all_rounds)

    @property
    def busy(self) -> bool:
        """Whether collectives of this rank are queued or in flight."""
        return any(rounds.busy for rounds in self._all_rounds)

    @property
    def largest_batch(self) -> dict[OpKind, int]:
        """The most collectives of each kind that one engine call carried so far (fusion tests read it)."""
        largest: dict[OpKind, int] = {}
        for rounds in self._all_rounds:
            for kind, count in rounds.executor.largest_batch.items():
                largest[kind] = max(count, largest.get(kind, 0))
        return largest

    @property
    def plane_runs(self) -> dict[str, int]:
        """Engine calls run on each device plane so far, by plane name (tests check the device path ran)."""
        return dict(self._world.executor.plane_runs)

    @property
    def plane_tensors(self) -> dict[str, int]:
        """Tensors those engine calls carried, by plane name (more tensors than calls: fusion happened)."""
        return dict(self._world.executor.plane_tensors)

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
        runs: dict[str, int] = {}
        for rounds in self._all_rounds:
            for kind, count in rounds.executor.hierarchical_runs.items():
                runs[kind] = runs.get(kind, 0) + count
        return runs

    @property
    def autotune_done(self) -> bool:
        """On rank 0 with autotune on: whether the search has settled on its best configuration."""
        return self._world.tuning is not None and self._world.tuning.done

    @property
    def running(self) -> bool:
        return self._world.thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """Why this rank's collectives can no longer run (a failure, a shutdown); None while they can."""
        return self._fatal

    @property
    def thread_id(self) -> int | None:
        """The world's thread's ident (benchmarks read its CPU clock: an idle job's, since while the ranks are
        busy threads that wait for collectives run most cycles)."""
        return self._world.thread.ident

    # ----------------------------------------------------------------- what the world's rounds call
    def _fail(self, exc: BaseException) -> None:
        """A cycle or a doorbell failed (engine failure, a failed or frozen peer): every pending and future call
        fails, in every set's rounds, and the threads stop."""
        error = failure_of(self._engine, exc)
        log.error("hvdplus background thread failed: %s", error)
        if self._fatal is None:
            self._fatal = error
        for rounds in self._all_rounds:
            rounds.abandon(error)

    def _stopped(self, error: HorovodInternalError) -> None:
        """The whole job's rounds agreed to stop (a shutdown, a stall): why collectives can no longer run."""
        self._fatal = error

    def _stop_set_rounds(self, clean: bool) -> None:
        """The world's thread is stopping: stop each set's rounds, after a final round of its members (`clean`: they
        all stop in this same world round), or at once (a failure)."""
        for rounds in self._set_rounds.values():
            if clean:
                rounds.stop(str(self._fatal))
            else:
                rounds.abandon(HorovodInternalError(f"hvdplus can no longer run collectives: {self._fatal}"))

    def _open_set_rounds(self, set_id: int) -> None:
        """Collective over all ranks, as a process set is added: its own rounds, on its members."""
        wake = threading.Event()
        doorbell = self._engine.open_doorbell(wake.set, self._sets.members(set_id))
        if doorbell is None:  # not a member
            return
        # Autotune tunes the world's rounds only: a set's keep the configured values.
        rounds = SetRounds(self._context, set_id, wake, doorbell, Tunables.from_settings(self._settings))
        self._set_rounds[set_id] = rounds
        rounds.thread.start()

    def _close_set_rounds(self, set_id: int) -> None:
        """Collective over all ranks, as a process set is removed: its members stop its rounds together."""
        rounds = self._set_rounds.pop(set_id, None)
        if rounds is not None:
            rounds.stop(f"process set {set_id} was removed")

    def _finish_set_joins(self) -> None:
        """The world's join completed: wait for this rank's join in each of its sets' rounds, which every member
        submitted before the world's, so that work submitted after join() returns meets no joined rank there."""
        joins, self._set_joins = self._set_joins, []
        for handle in joins:
            handle.wait()
