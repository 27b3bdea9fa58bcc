"""The background threads: queue -> negotiate -> fuse -> execute -> complete handles, in the rounds of each set of
ranks (set_rounds.py): the whole job's, and each process set's own, which its members run alone.

In each set's rounds every member runs the same cycle in lock step. Each cycle costs one small bitwise-AND
allreduce (the response-cache bits plus flags), whose size does not depend on the number of ranks; announcements
not in the cache are exchanged merged (announcements.py: ranks that agree share one entry), and every member
derives the same ordered list of responses from the same table (agreement.py). While work is in flight,
cycles follow HOROVOD_CYCLE_TIME; once a round shows that no member has work, none runs until a member has work or
a peer rings (idle_spells.py). Join, process sets, channels and device planes are
control_collectives.py's, run in the whole job's rounds.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from hvdplus.common.control.frozen import failure_of
from hvdplus.common.control.in_flight import Names
from hvdplus.common.control.member_rounds import MemberRounds
from hvdplus.common.control.messages import Request
from hvdplus.common.control.negotiation import device_kind
from hvdplus.common.control.round_counters import RoundCounters
from hvdplus.common.control.set_rounds import RoundsContext, SetRounds
from hvdplus.common.control.world_rounds import WorldEvents, WorldRounds
from hvdplus.common.data.buffer_ops import DataPlane, DeviceKind
from hvdplus.common.data.executor import Submission
from hvdplus.common.engines.base import Engine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.handles import Handle
from hvdplus.common.ops import ReduceOp
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
# In an elastic job the launcher names a worker that died about 0.1 s after its exit: a survivor whose transport
# failed first waits this long for that notice, so that it names the lost worker instead of announcing a failure
# of its own (which its peers would then report too).
_ELASTIC_NOTICE_WAIT_S = 1.0


def control_spin_s(local_ranks: int) -> float:
    """How long a rank spins for a busy control round, for a host running `local_ranks` ranks. The host's cores,
    not this process's affinity: a launcher that binds each rank to its own cores leaves every rank a core."""
    return _SPIN_S if local_ranks <= (os.cpu_count() or 1) else _CROWDED_SPIN_S


class Coordinator:
    """Owns the engine after init: every collective of this process runs in the rounds of its set, on their
    background thread or on a thread that waits for one (cycles.py)."""

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
        self._names = Names()
        self._fatal: BaseException | None = None
        self._elastic = settings.launch.elastic_worker is not None  # a failure is recovered from: no error trace
        # Only the world's thread swaps the timeline; others write it (set_timeline).
        self._timeline = TimelineSlot(
            Timeline(settings.timeline, settings.timeline_mark_cycles)
            if settings.timeline not in ("", "DYNAMIC") and self.rank == 0  # DYNAMIC: hvd.start_timeline() starts it
            else None
        )
        context = RoundsContext(engine, settings, self._sets, self._names, self._spin_s, self._timeline, self._fail)
        self._member = MemberRounds(context)
        wake = threading.Event()
        doorbell = engine.open_doorbell(wake.set)
        assert doorbell is not None  # every rank is in the world's
        self._world = WorldRounds(
            context,
            topology,
            wake,
            doorbell,
            self.tunables,
            self._planes,
            self._device_kinds,
            WorldEvents(
                self._stopped,
                lambda clean: self._member.stop(clean, self._fatal),
                self._member.open,
                self._member.close,
                self._member.finish_joins,
            ),
        )
        self.counters = RoundCounters(self._world, self._member.all, self._planes)
        self._world.thread.start()

    # ----------------------------------------------------------------- public, any thread
    def submit(self, request: Request, input: np.ndarray | None = None, output: np.ndarray | None = None) -> Handle:
        """Queue one collective; the handle completes when every member of its set has run it."""
        rounds, on_device = self._route(request, input)
        self._names.reserve(request)
        return self._queue(rounds, request, input, output, on_device)

    def allreduce_now(self, request: Request, input: np.ndarray, output: np.ndarray) -> None:
        """A blocking allreduce into `output`: in its rounds' lone lane where it is open (set_rounds.py:
        SetRounds.run_lone; host buffers, and not Adasum, which the executor reduces tensor by tensor), else
        submitted and waited for."""
        rounds, on_device = self._route(request, input)
        self._names.reserve(request)
        lone = not on_device and request.op != ReduceOp.ADASUM
        work = rounds.run_lone(request, input, output) if lone else None
        (self._queue(rounds, request, input, output, on_device) if work is None else work).wait()

    def _route(self, request: Request, input: Any) -> tuple[SetRounds, bool]:
        """The rounds that run `request`, and whether its input is a device plane's tensor; ValueError if this rank
        cannot submit it, HorovodInternalError if collectives can no longer run."""
        if self._fatal is not None:
            raise HorovodInternalError(f"hvdplus can no longer run collectives: {self._fatal}")
        on_device = input is not None and not isinstance(input, np.ndarray)
        if request.process_set == 0:  # every rank is a member of the whole job's set, which is never removed
            return self._world, on_device
        if request.process_set not in self._sets:
            raise ValueError(f"process set {request.process_set} does not exist (it was removed or never added)")
        if self._sets[request.process_set].index is None:
            raise ValueError(
                f"rank {self.rank} is not a member of process set {request.process_set} "
                f"(ranks {list(self._sets[request.process_set].ranks)}); only members may submit"
            )
        # Device tensors travel in the world's rounds, which own the device planes.
        rounds = self._world if on_device else self._member.get(request.process_set)
        if rounds is None:  # removed since the check above
            raise ValueError(f"process set {request.process_set} does not exist (it was removed or never added)")
        return rounds, on_device

    def _queue(self, rounds: SetRounds, request: Request, input: Any, output: Any, on_device: bool) -> Handle:
        """Queue `request` (its name reserved) for `rounds`."""
        work = Submission(request, rounds.new_handle(request.name), input, output)
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
        self._member.join()

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

    def process_set_ids(self) -> list[int]:
        """The ids of the process sets registered now, 0 first."""
        return self._sets.ids()

    def process_set_id_of(self, ranks: tuple[int, ...]) -> int | None:
        """The id of the registered set of exactly these (sorted) ranks, if any (0: every rank)."""
        return self._sets.id_of(ranks)

    def shutdown(self) -> None:
        """Stop the threads once every rank's world round sees the request (any rank's request stops all)."""
        self._world.request_stop()
        if threading.current_thread() is not self._world.thread and not self._world.cycles.in_cycle:
            # After a failure the thread only releases the engine, which can wait on a frozen peer until the
            # transport's own timeout: do not hold the process's exit for it (the thread is a daemon).
            self._world.thread.join(_FAILED_JOIN_S if self._fatal is not None else None)

    def plane_engine(self, kind: str) -> Any | None:
        """The engine of device kind `kind`'s plane, once built (the planned path opens its groups on it)."""
        plane = self._planes.get(kind)
        return None if plane is None else plane.engine

    @property
    def running(self) -> bool:
        return self._world.thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """Why this rank's collectives can no longer run (a failure, a shutdown); None while they can."""
        return self._fatal

    # ----------------------------------------------------------------- what the world's rounds call
    def _fail(self, exc: BaseException) -> None:
        """A cycle or a doorbell failed (engine failure, a failed or frozen peer): every pending and future call
        fails, in every set's rounds, and the threads stop."""
        error = failure_of(self._engine, exc, _ELASTIC_NOTICE_WAIT_S if self._elastic else 0.0)
        if self._elastic:  # hvd.elastic.run recovers, then warns once, naming the lost worker
            log.debug("hvdplus background thread failed: %s", error)
        else:
            log.error("hvdplus background thread failed: %s", error)
        self.fail(error)

    def fail(self, error: HorovodInternalError) -> None:
        """The job failed (a round, or a collective outside the rounds: a frozen plan's step that met a frozen or
        failed peer): every pending and future call fails with `error`, and the threads stop without a final
        round, which would wait for that peer too."""
        if self._fatal is None:
            self._fatal = error
        for rounds in [self._world, *self._member.all()]:
            rounds.abandon(error)

    def _stopped(self, error: HorovodInternalError) -> None:
        """The whole job's rounds agreed to stop (a shutdown, a stall): why collectives can no longer run."""
        self._fatal = error
