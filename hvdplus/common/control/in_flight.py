"""This rank's collectives from submit to completion: queued until a cycle takes them, then in flight by key until a
response runs them. A name is unique on a rank while its collective is in flight (Horovod's rule: a duplicate
raises), across the rounds of every process set: `Names` is shared by each set's `InFlight`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

from hvdplus.common.control.messages import Key, Request
from hvdplus.common.data.executor import Submission
from hvdplus.common.exceptions import HorovodInternalError

__all__ = ["InFlight", "Names"]


class Names:
    """The names of this rank's collectives in flight, on every set's rounds, with their requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # submitting threads add names, cycles discard them
        self._held: dict[str, Request] = {}
        self._agreed: set[str] = set()  # held names whose collective its rounds have agreed (decided, not run yet)
        self._posted: dict[int, list[Request]] = {}  # shadows one set's rounds pass to another's (agreement.py)

    def reserve(self, request: Request) -> None:
        """Claim a collective's name before it is submitted; ValueError if one by that name is in flight."""
        with self._lock:
            if request.name in self._held:
                raise ValueError(
                    f"a collective named {request.name!r} is already in flight on this rank; "
                    f"names must be unique until synchronize() returns (duplicate name)"
                )
            self._held[request.name] = request

    def undecided(self, name: str) -> Request | None:
        """This rank's request in flight under `name` (on whichever set's rounds), unless its rounds agreed it."""
        return None if name in self._agreed else self._held.get(name)

    def agreed(self, keys: Iterable[Key]) -> None:
        """A round agreed these collectives (this rank's among them, if held, are about to run)."""
        with self._lock:
            for key in keys:
                held = self._held.get(key[1])
                if held is not None and held.key == key:
                    self._agreed.add(key[1])

    def release(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self._held.pop(name, None)
                self._agreed.discard(name)

    def post(self, set_id: int, shadow: Request) -> None:
        """Have set `set_id`'s rounds send `shadow` in their next negotiation."""
        with self._lock:
            self._posted.setdefault(set_id, []).append(shadow)

    def has_posted(self, set_id: int) -> bool:
        """Whether shadows wait to be sent in set `set_id`'s rounds."""
        return set_id in self._posted

    def take_posted(self, set_id: int) -> list[Request]:
        if set_id not in self._posted:  # every cycle asks: no lock for the usual answer
            return []
        with self._lock:
            return self._posted.pop(set_id, [])


class InFlight:
    """One set's rounds' collectives: submitted from any thread; taken and run by the thread running a cycle;
    failed by any thread (a failure in another set's rounds fails them all)."""

    def __init__(self, names: Names) -> None:
        self._queue: queue.SimpleQueue[Submission] = queue.SimpleQueue()
        self.names = names
        self._lock = threading.Lock()  # guards _by_key: `fail_all` may come from another thread than the cycle's
        self._by_key: dict[Key, Submission] = {}

    def __len__(self) -> int:
        """Collectives taken by a cycle and not run yet."""
        return len(self._by_key)

    def put(self, work: Submission) -> None:
        """Queue `work` (its name reserved) for the next cycle."""
        self._queue.put(work)

    @property
    def queued(self) -> bool:
        """Whether work waits for the next cycle."""
        return not self._queue.empty()

    def take_queued(self) -> list[Submission]:
        """Take every work queued since the last call, recording it as in flight. Under the lock throughout, so that
        `fail_all` from another thread finds each work either queued or in flight."""
        taken: list[Submission] = []
        if self._queue.empty():  # the usual answer between bursts, with no lock
            return taken
        with self._lock:
            while not self._queue.empty():  # cheaper than get_nowait's Empty, which every cycle would raise
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:  # another thread (failing them all) took the last one
                    break
                self._by_key[work.request.key] = work
                taken.append(work)
        return taken

    def take(self, key: Key) -> Submission | None:
        """The work of an agreed response, if this rank submitted it; its name stays held until the cycle releases
        the names of all it took at once (`names.release`)."""
        with self._lock:
            return self._by_key.pop(key, None)

    def hold(self, work: Submission) -> Submission:
        """Record `work` as in flight without queueing it: a cycle took it at once (the lone lane), or took it and
        did not finish it (a failing cycle's, so that the failure reaches it)."""
        with self._lock:
            self._by_key[work.request.key] = work
        return work

    def fail_all(self, error: HorovodInternalError) -> None:
        """Every queued and in-flight collective fails with `error`."""
        self.take_queued()
        with self._lock:
            failed, self._by_key = list(self._by_key.values()), {}
        for work in failed:
            work.handle.set_error(error)
        self.names.release([work.request.name for work in failed])
