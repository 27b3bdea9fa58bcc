"""What the rounds on this rank have done so far, summed over the whole job's and each member set's rounds: the
counters tests and benchmarks read to check that an optimisation happened (`runtime().coordinator.counters`)."""

from __future__ import annotations

from collections.abc import Callable

from hvdplus.common.control.set_rounds import SetRounds
from hvdplus.common.control.world_rounds import WorldRounds
from hvdplus.common.data.buffer_ops import DataPlane
from hvdplus.common.ops import OpKind

__all__ = ["RoundCounters"]


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for each in counts:
        for key, count in each.items():
            total[key] = total.get(key, 0) + count
    return total


class RoundCounters:
    """Read-only counters of this rank's rounds."""

    def __init__(self, world: WorldRounds, sets: Callable[[], list[SetRounds]], planes: dict[str, DataPlane]) -> None:
        """`sets()`: the member sets' rounds now. `planes`: the device planes built so far, by kind."""
        self._world, self._sets, self._planes = world, sets, planes

    @property
    def _all(self) -> list[SetRounds]:
        return [self._world, *self._sets()]

    @property
    def rounds(self) -> int:
        """Control rounds run so far, in every set's rounds (a test checks that idle ranks run none)."""
        return sum(rounds.rounds for rounds in self._all)

    @property
    def graces_skipped(self) -> int:
        """Rings this rank joined at once, having had no work of its own lately (idle_spells.py)."""
        return sum(rounds.graces_skipped for rounds in self._all)

    @property
    def driven_cycles(self) -> int:
        """Cycles run so far by threads waiting for a collective rather than by the background threads."""
        return sum(rounds.cycles.driven for rounds in self._all)

    @property
    def lone_runs(self) -> int:
        """Blocking collectives the lone lane ran in a round of their own (SetRounds.run_lone)."""
        return sum(rounds.lone_runs for rounds in self._all)

    @property
    def background_rests(self) -> int:
        """Times a background thread rested while the lone lane ran the cycles (SetRounds._background_wait)."""
        return sum(rounds.rests for rounds in self._all)

    @property
    def lone_fallbacks(self) -> int:
        """Lone lane rounds that did not decide their collective alone and went on as a full cycle."""
        return sum(rounds.lone_fallbacks for rounds in self._all)

    @property
    def busy(self) -> bool:
        """Whether collectives of this rank are queued or in flight."""
        return any(rounds.busy for rounds in self._all)

    @property
    def largest_batch(self) -> dict[OpKind, int]:
        """The most collectives of each kind that one engine call carried so far (fusion tests read it)."""
        largest: dict[OpKind, int] = {}
        for rounds in self._all:
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

    @property
    def hierarchical_runs(self) -> dict[str, int]:
        """Engine calls run hierarchically so far, by kind and cross-host algorithm (tests and benchmarks)."""
        return _summed([rounds.executor.hierarchical_runs for rounds in self._all])

    @property
    def autotune_done(self) -> bool:
        """On rank 0 with autotune on: whether the search has settled on its best configuration."""
        return self._world.tuning is not None and self._world.tuning.done

    @property
    def thread_id(self) -> int | None:
        """The world's thread's ident (benchmarks read its CPU clock: an idle job's, since while the ranks are
        busy threads that wait for collectives run most cycles)."""
        return self._world.thread.ident
