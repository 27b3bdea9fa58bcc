"""The whole job's rounds: a set's rounds (set_rounds.py), which every rank runs, plus what only they run:
join, registering and removing process sets, channels and device planes (control_collectives.py), every
collective on a device tensor, autotune, the timeline's swaps and cycle marks, and shutdown, which stops every set's
rounds and releases the engine."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdplus.common.autotune import TuningRun
from hvdplus.common.control.agreement import STALL_ABORT, Agreement
from hvdplus.common.control.control_collectives import ControlCollectives
from hvdplus.common.control.frozen import ranks_that_shut_down
from hvdplus.common.control.messages import Response
from hvdplus.common.control.set_rounds import RoundsContext, SetRounds
from hvdplus.common.data.buffer_ops import DataPlane, DeviceKind
from hvdplus.common.data.executor import Submission
from hvdplus.common.engines.base import Doorbell
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.timeline import Timeline
from hvdplus.common.topology import Topology
from hvdplus.common.tunables import Tunables

__all__ = ["WorldEvents", "WorldRounds"]

log = logging.getLogger("hvdplus")


@dataclass(frozen=True)
class WorldEvents:
    """What the whole job's rounds tell the coordinator, which owns the sets' rounds."""

    stopped: Callable[[HorovodInternalError], None]  # the rounds agreed to stop (shutdown, stall): why
    stopping: Callable[[bool], None]  # the thread stops: stop the sets' rounds (cleanly: after their final round)
    set_added: Callable[[int], None]  # collective over all ranks: a set was just registered
    set_removing: Callable[[int], None]  # collective over all ranks: a set is about to be removed
    join_done: Callable[[], None]  # the job's join completed, before join() returns


class WorldRounds(SetRounds):
    """The whole job's rounds on this rank."""

    def __init__(
        self,
        context: RoundsContext,
        topology: Topology,
        wake: threading.Event,
        doorbell: Doorbell,
        tunables: Tunables,
        planes: dict[str, DataPlane],
        device_kinds: dict[str, DeviceKind],
        events: WorldEvents,
    ) -> None:
        """`planes`: the device planes built so far, by kind (built here, at each kind's first collective)."""
        self._device_kinds, self._events = device_kinds, events
        super().__init__(context, 0, wake, doorbell, tunables, planes)
        engine, settings = context.engine, context.settings
        self.control = ControlCollectives(
            engine,
            settings,
            topology,
            context.sets,
            device_kinds,
            planes,
            self.executor,
            events.set_added,
            events.set_removing,
            events.join_done,
        )
        self.tuning = (
            TuningRun(tunables, settings, engine.rank, context.sets[0].hierarchy is not None, len(topology.hosts))
            if settings.autotune
            else None
        )
        self._clean_stop = False

    def request_stop(self) -> None:
        """Shut the job down at the next world round (any rank's request stops all)."""
        self._stop_requested = True
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _planes_possible(self) -> bool:
        return bool(self._device_kinds)

    def _control(self, response: Response, work: Submission) -> Any:
        return self.control.run(response, work)

    def _joined(self) -> bool:
        return self.control.joined

    def _timeline_now(self) -> Timeline | None:
        timeline = self._timeline.settle()  # the one this cycle writes, whatever other threads ask meanwhile
        if timeline:
            timeline.cycle()
        return timeline

    def _timeline_off(self) -> bool:
        return self._timeline.settle() is None  # a timeline started meanwhile: the next cycle writes it

    def _between_wakes(self) -> None:
        self._timeline.settle()  # a timeline swap asked for while idle needs no round

    def _config(self) -> int | None:
        return None if self.tuning is None else self.tuning.word()

    def _prepare(self, responses: list[Response]) -> None:
        self.control.build_planes(responses)

    def _after(self, words: np.ndarray, responses: list[Response]) -> None:
        if self.tuning is not None:
            self.tuning.after_cycle(Agreement.config(words), responses)

    def _stopped(self, flags: int) -> None:
        if flags & STALL_ABORT:
            reason = self._agreement.stalls.abort_reason()
        else:
            reason = f"hvdplus was shut down on {ranks_that_shut_down(self._engine, self._stop_requested)}"
            self._clean_stop = True
        self._events.stopped(HorovodInternalError(reason))
        self.fail_everything(HorovodInternalError(f"{reason}; the collective cannot complete"))

    def _release(self) -> None:
        self._events.stopping(self._clean_stop)  # before the engine the sets' rounds run on goes
        for release in [
            self._timeline.retire,
            *self.control.closers(),
            self._doorbell.close,
            *(plane.engine.shutdown for plane in self._planes.values()),
            self._engine.shutdown,
        ]:
            try:  # each on its own: a failing one must not keep the host engine's resources
                release()
            except Exception as exc:  # pragma: no cover - best effort at exit
                log.debug("shutdown of %s failed: %s", release, exc)
        self._sets.release()
