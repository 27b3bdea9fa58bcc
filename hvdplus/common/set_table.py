"""The process sets this rank knows, by id: each set's ranks and its engine groups (host engine, device planes,
hierarchical local and cross-host groups).

Registering and removing a set are collectives of the whole job, run by the coordinator in the agreed order, so
every rank gives a set the same id (ids are never reused) and creates its groups in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hvdplus.common.data.hierarchical import HierarchicalGroups, hierarchical_groups
from hvdplus.common.engines.base import Engine
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology

__all__ = ["ProcessSetEntry", "ProcessSetTable"]

log = logging.getLogger("hvdplus")


@dataclass
class ProcessSetEntry:
    ranks: tuple[int, ...]
    group: Any
    index: int | None  # this rank's position in `ranks`; None if it is not a member
    hierarchy: HierarchicalGroups | None = None  # its local and cross groups, when its ranks span hosts evenly
    device_groups: dict[str, Any] = field(default_factory=dict)  # its group on each device plane, by plane name


class ProcessSetTable:
    """Set 0 is the whole job; the others come from `add`."""

    def __init__(self, engine: Engine, settings: Settings, topology: Topology) -> None:
        self._engine, self._settings, self._topology = engine, settings, topology
        everyone = tuple(range(engine.size))
        self._sets = {0: ProcessSetEntry(everyone, engine.world, engine.rank, self._hierarchy_of(everyone))}
        self._next_id = 1

    def __getitem__(self, set_id: int) -> ProcessSetEntry:
        return self._sets[set_id]

    def __contains__(self, set_id: int) -> bool:
        return set_id in self._sets

    def ranks(self, set_id: int) -> tuple[int, ...] | None:
        """A set's ranks; None if it does not exist (removed, or never added)."""
        entry = self._sets.get(set_id)
        return entry.ranks if entry else None

    def ids(self) -> list[int]:
        """The ids of the sets registered now, 0 first."""
        return list(self._sets)

    def id_of(self, ranks: tuple[int, ...]) -> int | None:
        """The id of the set of exactly these (sorted) ranks, if one exists: 0 for every rank."""
        entries = list(self._sets.items())  # one C call: the world's rounds may add a set meanwhile
        return next((set_id for set_id, entry in entries if entry.ranks == ranks), None)

    def members(self, set_id: int) -> tuple[int, ...]:
        """A set's ranks; empty if it does not exist."""
        return self.ranks(set_id) or ()

    def index_in(self, set_id: int) -> int | None:
        """This rank's position in a set; None if it is not a member or the set does not exist."""
        entry = self._sets.get(set_id)
        return entry.index if entry else None

    def add(self, ranks: tuple[int, ...], planes: Iterable[Any]) -> int:
        """Collective over all ranks: register a set, with its engine group and its group on each of `planes`."""
        set_id = self._next_id
        index = ranks.index(self._engine.rank) if self._engine.rank in ranks else None
        self._sets[set_id] = ProcessSetEntry(
            ranks,
            self._engine.new_group(ranks),
            index,
            self._hierarchy_of(ranks),
            {plane.name: plane.engine.new_group(ranks) for plane in planes},
        )
        self._next_id += 1
        return set_id

    def remove(self, set_id: int) -> None:
        self._sets.pop(set_id, None)

    def add_plane(self, plane: Any) -> None:
        """Collective over all ranks: every set's group on a device plane built just now."""
        for set_id, entry in self._sets.items():
            entry.device_groups[plane.name] = plane.engine.world if set_id == 0 else plane.engine.new_group(entry.ranks)

    def release(self) -> None:
        """The engine destroyed the groups: keep no handle alive."""
        for entry in self._sets.values():
            entry.group = entry.hierarchy = None

    def _hierarchy_of(self, ranks: tuple[int, ...]) -> HierarchicalGroups | None:
        """Collective over all ranks: a set's hierarchical groups, unless hierarchical collectives are off or its
        layout cannot use them (the reason is logged when the user asked for them)."""
        settings = self._settings
        asked = settings.hierarchical_allreduce or settings.hierarchical_allgather
        if not (asked or settings.autotune):
            return None
        groups, reason = hierarchical_groups(self._engine, self._topology, ranks)
        if groups is None and asked and self._engine.rank == ranks[0]:
            log.warning("hierarchical collectives on ranks %s fall back to flat: %s", list(ranks), reason)
        return groups
