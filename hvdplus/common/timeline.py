"""Chrome-trace timeline (open in Perfetto or chrome://tracing): one row per tensor name, Horovod's phases.

Each collective shows NEGOTIATE_<KIND> (submitted until every rank agreed), then the <KIND> span holding its
activities: QUEUE (agreed, waiting for the batches before it), MEMCPY_IN_FUSION_BUFFER, the engine call
(MPI_ALLREDUCE, GLOO_ALLGATHER, ... or HIERARCHICAL_ALLREDUCE with its LOCAL_/CROSS_ sub-steps nested) and
MEMCPY_OUT_FUSION_BUFFER. Horovod's format and variables (HOROVOD_TIMELINE, HOROVOD_TIMELINE_MARK_CYCLES).

Events are buffered and written at most every `flush_seconds`, each time followed by the closing bracket, which
the next write overwrites: the file is valid JSON after every flush, so a job that dies keeps a readable trace.

The coordinator's thread writes a timeline; `TimelineSlot` lets other threads (hvd.start_timeline,
hvd.stop_timeline) replace it without ever closing it under that thread: the writer makes the swap itself,
between its cycles. A closed timeline refuses events, so a write that came too late raises instead of vanishing.
The planned path (common/planned_steps.py) also writes its collectives' spans, from the training threads: it
reads the slot's current timeline, and drops its events if that one is closed meanwhile.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable

__all__ = ["Timeline", "TimelineSlot"]

_CLOSE = b"\n]\n"


class Timeline:
    """Collects trace events from any thread; `flush()` writes them, `close()` ends the file."""

    def __init__(self, path: str, mark_cycles: bool = False, flush_seconds: float = 1.0) -> None:
        self.mark_cycles = mark_cycles
        self.path = path
        self._flush_seconds = flush_seconds
        self._file = open(path, "wb")
        self._file.write(b"[" + _CLOSE)
        self._file.flush()
        self._written = 0  # events in the file so far
        self._pending: list[dict] = []
        self._rows: dict[str, int] = {}
        self._lock = threading.RLock()  # _row emits under it
        self._start = time.perf_counter()
        self._last_flush = self._start

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._file.closed:
                raise RuntimeError(f"timeline {self.path} is closed: an event reached it after stop_timeline()")
            self._pending.append(event)

    def _row(self, name: str) -> int:
        with self._lock:  # the planned path writes from the training threads too
            row = self._rows.get(name)
            if row is None:
                row = self._rows[name] = len(self._rows) + 1
                self._emit({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
            return row

    def _now_us(self) -> float:
        return (time.perf_counter() - self._start) * 1e6

    def begin(self, tensors: str | Iterable[str], phase: str) -> None:
        """Open span `phase` on the row of each tensor (a fused batch shares the timestamp)."""
        now = self._now_us()
        for tensor in [tensors] if isinstance(tensors, str) else tensors:
            self._emit({"name": phase, "ph": "B", "ts": now, "pid": self._row(tensor), "tid": 1})

    def end(self, tensors: str | Iterable[str]) -> None:
        """Close the innermost open span on the row of each tensor."""
        now = self._now_us()
        for tensor in [tensors] if isinstance(tensors, str) else tensors:
            self._emit({"ph": "E", "ts": now, "pid": self._row(tensor), "tid": 1})

    def cycle(self) -> None:
        """Once per negotiation cycle: mark it (with mark_cycles) and write the events if a flush is due."""
        if self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "ts": self._now_us(), "pid": 0, "s": "g"})
        self.flush_if_due()

    def flush_if_due(self) -> None:
        """Write the events if `flush_seconds` have passed since the last write."""
        if time.perf_counter() - self._last_flush >= self._flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the buffered events, then the closing bracket (overwritten by the next flush)."""
        with self._lock:
            if self._file.closed or not self._pending:
                return
            text = ",\n".join(json.dumps(event) for event in self._pending)
            self._file.seek(-len(_CLOSE), os.SEEK_END)
            self._file.write(((",\n" if self._written else "\n") + text).encode() + _CLOSE)
            self._file.flush()
            self._written += len(self._pending)
            self._pending.clear()
            self._last_flush = time.perf_counter()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def tolerant(self) -> Timeline:
        """This timeline, for a writer beside the slot's owner (a process set's rounds): its events are dropped
        once a swap closed it, where this object's own raise."""
        return _Tolerant(self)

    def close(self) -> None:
        """Write what is left and close the file (idempotent)."""
        self.flush()
        with self._lock:
            self._file.close()


class _Tolerant(Timeline):
    """A second face of one timeline: the same state (its __dict__ is the timeline's own, so events, rows and the
    file's position stay one), with events that come after the close dropped."""

    def __init__(self, timeline: Timeline) -> None:  # noqa: D107 - shares the state, builds none
        self.__dict__ = timeline.__dict__

    def _emit(self, event: dict) -> None:
        try:
            super()._emit(event)
        except RuntimeError:  # closed by a swap under this writer: dropped, as the planned path drops its own
            pass


class TimelineSlot:
    """The timeline its owner thread writes (None: none), replaced by other threads only between the owner's cycles.

    `replace()` queues the new timeline and returns a swap to wait for; the owner applies queued replacements in
    `settle()`, where it holds no timeline, closing each replaced one itself; `retire()` (the owner stops for good)
    closes the last one and makes later replacements take effect at once. So no timeline is closed while the
    owner writes to it. Every change of the current timeline happens under the lock."""

    def __init__(self, timeline: Timeline | None = None) -> None:
        self._current = timeline
        self._lock = threading.Lock()
        self._queued: list[tuple[Timeline | None, _Swap]] = []
        self._retired = False

    def replace(self, timeline: Timeline | None) -> _Swap | None:
        """Any thread but the owner: make `timeline` the one written from the owner's next cycle on. Returns the
        swap to wait for (its `wait()` returns once the replaced timeline is closed), or None if there is nothing
        to wait for: the owner has retired (the swap happened here), or there is no timeline to stop."""
        with self._lock:
            if not self._retired:
                if timeline is None and self._current is None and not self._queued:
                    return None
                swap = _Swap()
                self._queued.append((timeline, swap))
                return swap
            replaced, self._current = self._current, timeline
        if replaced is not None:
            replaced.close()
        return None

    @property
    def current(self) -> Timeline | None:
        """The timeline written now, for writers beside the owner (the planned path), which must expect it to be
        closed under them by a swap (its events then raise RuntimeError)."""
        return self._current

    def settle(self) -> Timeline | None:
        """The owner, between cycles: apply the queued replacements; the timeline to write this cycle."""
        if self._queued:  # a replacement queued just after this look is applied at the next call
            with self._lock:
                self._apply()
        return self._current

    def retire(self) -> None:
        """The owner, when it stops writing for good: apply what is queued, then close the timeline."""
        with self._lock:
            self._retired = True
            self._apply()
            last, self._current = self._current, None
        if last is not None:
            last.close()

    def _apply(self) -> None:
        for timeline, swap in self._queued:
            replaced, self._current = self._current, timeline
            swap.finish(replaced)
        self._queued.clear()


class _Swap:
    """A queued replacement: done once the owner made it and closed the timeline it replaced."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, replaced: Timeline | None) -> None:
        try:
            if replaced is not None:
                replaced.close()
        except OSError as exc:  # the file could not be finished: the caller of replace() hears of it
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> None:
        """Block until the swap is made; raise the error that finishing the replaced file met, if any."""
        self._done.wait()
        if self._error is not None:
            raise self._error
