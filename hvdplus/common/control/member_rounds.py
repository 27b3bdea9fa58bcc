"""The rounds of each process set this rank is a member of (set_rounds.py): opened and closed as the whole
job's rounds add and remove sets, joined with the rank, and stopped with the job."""

from __future__ import annotations

import threading

from hvdplus.common.control.set_rounds import RoundsContext, SetRounds
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.handles import Handle
from hvdplus.common.tunables import Tunables

__all__ = ["MemberRounds"]


class MemberRounds:
    """Each member set's rounds on this rank, by set id (the world's rounds are not among them)."""

    def __init__(self, context: RoundsContext) -> None:
        self._context = context
        self._by_set: dict[int, SetRounds] = {}
        self._joins: list[Handle] = []  # join() in each set's rounds, which the world's join waits for

    def get(self, set_id: int) -> SetRounds | None:
        return self._by_set.get(set_id)

    def all(self) -> list[SetRounds]:
        return list(self._by_set.values())

    def open(self, set_id: int) -> None:
        """Collective over all ranks, as a process set is added: its own rounds, on its members."""
        wake = threading.Event()
        doorbell = self._context.engine.open_doorbell(wake.set, self._context.sets.members(set_id))
        if doorbell is None:  # not a member
            return
        # Autotune tunes the world's rounds only: a set's keep the configured values.
        rounds = SetRounds(self._context, set_id, wake, doorbell, Tunables.from_settings(self._context.settings))
        self._by_set[set_id] = rounds
        rounds.thread.start()

    def close(self, set_id: int) -> None:
        """Collective over all ranks, as a process set is removed: its members stop its rounds together."""
        rounds = self._by_set.pop(set_id, None)
        if rounds is not None:
            rounds.stop(f"process set {set_id} was removed")

    def join(self) -> None:
        """This rank called join(): it contributes zeros to its set peers' allreduces until they all join."""
        self._joins = [rounds.join() for rounds in self.all()]

    def finish_joins(self) -> None:
        """The world's join completed: wait for this rank's join in each of its sets' rounds, which every member
        submitted before the world's, so that work submitted after join() returns meets no joined rank there."""
        joins, self._joins = self._joins, []
        for handle in joins:
            handle.wait()

    def stop(self, clean: bool, why: BaseException | None) -> None:
        """The world's thread is stopping (`why`): stop each set's rounds, after a final round of its members
        (`clean`: they all stop in this same world round), or at once (a failure)."""
        for rounds in self._by_set.values():
            if clean:
                rounds.stop(str(why))
            else:
                rounds.abandon(HorovodInternalError(f"hvdplus can no longer run collectives: {why}"))
