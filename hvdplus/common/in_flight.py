"""This rank's collectives from submit to completion: queued until a cycle takes them, then in flight by key until a
response runs them. A name is unique while its collective is in flight (Horovod's rule: a duplicate raises)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.executor import Work
from hvdplus.common.messages import Key

__all__ = ["InFlight"]


class InFlight:
    """Submitted from any thread; taken, run and failed by the thread running a cycle."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Work] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the names: submitting threads add them, cycles discard them
        self._names: set[str] = set()
        self._by_key: dict[Key, Work] = {}

    def __len__(self) -> int:
        """Collectives taken by a cycle and not run yet."""
        return len(self._by_key)

    def reserve(self, name: str) -> None:
        """Claim `name` for a collective about to be submitted; ValueError if one by that name is in flight."""
        with self._lock:
            if name in self._names:
                raise ValueError(
                    f"a collective named {name!r} is already in flight on this rank; "
                    f"names must be unique until synchronize() returns (duplicate name)"
                )
            self._names.add(name)

    def put(self, work: Work) -> None:
        """Queue `work` (its name reserved) for the next cycle."""
        self._queue.put(work)

    @property
    def queued(self) -> bool:
        """Whether work waits for the next cycle."""
        return not self._queue.empty()

    def take_queued(self) -> Iterator[Work]:
        """Take every work queued since the last call, recording it as in flight."""
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return
            self._by_key[work.request.key] = work
            yield work

    def take(self, key: Key) -> Work | None:
        """The work of an agreed response, if this rank submitted it; its name is free again."""
        work = self._by_key.pop(key, None)
        if work is not None:
            with self._lock:
                self._names.discard(work.request.name)
        return work

    def put_back(self, work: Work) -> None:
        """Work a failing cycle took and did not finish: in flight again, so that the failure reaches it."""
        self._by_key[work.request.key] = work

    def fail_all(self, error: HorovodInternalError) -> None:
        """Every queued and in-flight collective fails with `error`."""
        list(self.take_queued())
        for work in self._by_key.values():
            work.handle.set_error(error)
        self._by_key.clear()
        with self._lock:
            self._names.clear()
