"""The collectives that change the runtime rather than move data: join, registering and removing process sets,
opening point-to-point channels; and the device planes, each built at its kind's first agreed collective. Every rank
runs them in the agreed order, so each gets the same set ids and creates its groups in the same order."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from hvdplus.common.control.messages import Request, Response
from hvdplus.common.control.negotiation import device_kind
from hvdplus.common.data.buffer_ops import DataPlane, DeviceKind
from hvdplus.common.data.executor import Executor, Submission
from hvdplus.common.engines.base import Engine
from hvdplus.common.ops import OpKind
from hvdplus.common.set_table import ProcessSetTable
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology

__all__ = ["ControlCollectives"]


class ControlCollectives:
    """This rank's part of the control collectives, and what they leave open until shutdown."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        topology: Topology,
        sets: ProcessSetTable,
        device_kinds: dict[str, DeviceKind],
        planes: dict[str, DataPlane],
        executor: Executor,
        set_added: Callable[[int], None],
        set_removing: Callable[[int], None],
        join_done: Callable[[], None],
    ) -> None:
        """`planes`: the device planes built so far, by kind (this object adds them). `set_added(id)` and
        `set_removing(id)`: collective over all ranks, right after a process set is added and before it is removed
        (its own rounds start and stop there); `join_done()`: after a join completed, before it returns."""
        self._engine, self._settings, self._topology = engine, settings, topology
        self._sets, self._device_kinds, self._planes, self._executor = sets, device_kinds, planes, executor
        self._set_added, self._set_removing, self._join_done = set_added, set_removing, join_done
        self.joined = False  # this rank called join() and the join has not completed: it contributes zeros
        self._channels: list[Any] = []  # point-to-point channels opened for the user (closed at shutdown)
        self._owned_elsewhere: weakref.WeakSet[Any] = weakref.WeakSet()  # planned groups, closed at shutdown

    def run(self, response: Response, work: Submission) -> Any:
        """A control collective's result (join, process sets, channels), or a data one the executor runs alone."""
        if response.kind == OpKind.JOIN:
            self.joined = False
            self._join_done()
            return response.join_last_rank
        if response.kind == OpKind.ADD_PROCESS_SET:  # its groups' creation waits for the peers as a data call does
            return self._engine.run_watched(partial(self._add_set, work.request), self._executor.alive)
        if response.kind == OpKind.OPEN_CHANNEL:
            self._channels.append(self._engine.run_watched(self._engine.open_channel, self._executor.alive))
            return self._channels[-1]
        if response.kind == OpKind.REMOVE_PROCESS_SET:
            removed = work.request.root  # the id of the set to remove travels in `root`
            self._set_removing(removed)
            self._sets.remove(removed)
            return removed
        return self._executor.run(response, work, response.members.index(self._engine.rank))

    def _add_set(self, request: Request) -> int:
        """Collective over all ranks: add the process set of `request`'s ranks and start its rounds."""
        set_id = self._sets.add(tuple(sorted(request.ranks or ())), self._planes.values())
        self._set_added(set_id)
        return set_id

    def build_planes(self, responses: list[Response]) -> None:
        """Build the plane of each device kind at its first agreed collective, with a group for every process set.
        Collective: every rank sees the same responses in the same order, members or not."""
        if len(self._planes) == len(self._device_kinds):
            return
        for response in responses:
            kind = device_kind(response.first.device)
            if kind in self._device_kinds and kind not in self._planes:
                plane = self._device_kinds[kind].build(self._engine, self._settings, self._topology)
                self._sets.add_plane(plane)
                self._planes[kind] = plane

    def close_at_shutdown(self, channel: Any) -> None:
        """Close `channel` (a planned group) at shutdown, if it is still alive then (held weakly: its owner may
        release it earlier)."""
        self._owned_elsewhere.add(channel)

    def closers(self) -> list[Callable[[], None]]:
        """What shutdown closes: the channels and planned groups still open."""
        return [channel.close for channel in [*self._channels, *self._owned_elsewhere]]
