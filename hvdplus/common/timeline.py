"""Chrome-trace timeline (open in Perfetto or chrome://tracing): one row per tensor, Horovod's phases.

A row is labelled as Horovod's PyTorch names the op: `allreduce.<name>`, `allgather.<name>`, ... (op_name).

Each collective shows NEGOTIATE_<KIND> (submitted until every rank agreed), then the <KIND> span holding its
activities: QUEUE (agreed, waiting for the batches before it), MEMCPY_IN_FUSION_BUFFER, the engine call
(MPI_ALLREDUCE, GLOO_ALLGATHER, ... or HIERARCHICAL_ALLREDUCE with its LOCAL_/CROSS_ sub-steps nested) and
MEMCPY_OUT_FUSION_BUFFER. Horovod's format and variables (HOROVOD_TIMELINE, HOROVOD_TIMELINE_MARK_CYCLES).

A writer thread per timeline writes the events as they come (gathered for 10 ms, so that a burst of them is one
write), each write followed by the closing bracket, which the next write overwrites: the file is valid
JSON after every write, so a job that is running or died shows a readable trace of what it did.

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

__all__ = ["Timeline", "TimelineSlot", "op_name"]

_CLOSE = b"\n]\n"
# How long the writer gathers events after the first before it writes them: one write (a seek, a write and a
# flush) per collective would cost the training threads about half again the events' own cost, for no reader.
_GATHER_SECONDS = 0.01


def op_name(kind: str, name: str) -> str:
    """A collective's row label, as Horovod's PyTorch names the op: `allreduce.<name>` for kind ALLREDUCE; an
    unnamed collective's name (`allreduce.noname.ps0.3`) has the prefix already."""
    prefix = f"{kind.lower()}."
    return name if name.startswith(prefix) else prefix + name


class Timeline:
    """Collects trace events from any thread; its writer thread writes them as they come, `close()` ends the file."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.mark_cycles = mark_cycles
        self.path = path
        self._file = open(path, "wb")
        self._file.write(b"[" + _CLOSE)
        self._file.flush()
        self._written = 0  # events in the file so far
        self._pending: list[dict] = []
        self._rows: dict[str, int] = {}
        self._lock = threading.RLock()  # _row emits under it
        self._arrived = threading.Condition(self._lock)
        self._closed = False
        self._error: OSError | None = None
        self._start = time.perf_counter()
        self._writer = threading.Thread(target=self._write_loop, name=f"hvdplus timeline {path}", daemon=True)
        self._writer.start()

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"timeline {self.path} is closed: an event reached it after stop_timeline()")
            self._pending.append(event)
            if len(self._pending) == 1:  # the writer waits only when nothing is pending
                self._arrived.notify()

    def _row(self, name: str, kind: str | None = None) -> int:
        with self._lock:  # the planned path writes from the training threads too
            row = self._rows.get(name)
            if row is None:
                row = self._rows[name] = len(self._rows) + 1
                label = name if kind is None else op_name(kind, name)
                self._emit({"name": "process_name", "ph": "M", "pid": row, "args": {"name": label}})
            return row

    def _now_us(self) -> float:
        return (time.perf_counter() - self._start) * 1e6

    def begin(self, tensors: str | Iterable[str], phase: str, kind: str | None = None) -> None:
        """Open span `phase` on the row of each tensor (a fused batch shares the timestamp). `kind`: the
        collective's (ALLREDUCE, ...), which names a row this event opens (`op_name`)."""
        now = self._now_us()
        for tensor in [tensors] if isinstance(tensors, str) else tensors:
            self._emit({"name": phase, "ph": "B", "ts": now, "pid": self._row(tensor, kind), "tid": 1})

    def end(self, tensors: str | Iterable[str]) -> None:
        """Close the innermost open span on the row of each tensor."""
        now = self._now_us()
        for tensor in [tensors] if isinstance(tensors, str) else tensors:
            self._emit({"ph": "E", "ts": now, "pid": self._row(tensor), "tid": 1})

    def cycle(self) -> None:
        """Once per negotiation cycle: mark it (with mark_cycles)."""
        if self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "ts": self._now_us(), "pid": 0, "s": "g"})

    def _write_loop(self) -> None:
        """The writer thread: write what arrived, as Horovod's writer thread does, so a file opened while the job
        runs shows the collectives done up to `_GATHER_SECONDS` ago."""
        while True:
            with self._arrived:
                while not self._pending and not self._closed:
                    self._arrived.wait()
                if not self._closed:  # the events that follow closely go in the same write (close() ends this)
                    self._arrived.wait(_GATHER_SECONDS)
                events, self._pending = self._pending, []
            if not events:  # closed, and everything written
                return
            if self._error is None:  # after a failed write the file is left as the last good one
                try:
                    self._write(events)
                except OSError as exc:
                    self._error = exc

    def _write(self, events: list[dict]) -> None:
        """Append `events`, then the closing bracket (overwritten by the next write)."""
        text = ",\n".join(json.dumps(event) for event in events)
        self._file.seek(-len(_CLOSE), os.SEEK_END)
        self._file.write(((",\n" if self._written else "\n") + text).encode() + _CLOSE)
        self._file.flush()
        self._written += len(events)

    @property
    def closed(self) -> bool:
        """Whether `close()` was called: the timeline refuses events."""
        return self._closed

    def tolerant(self) -> Timeline:
        """This timeline, for a writer beside the slot's owner (a process set's rounds): its events are dropped
        once a swap closed it, where this object's own raise."""
        return _Tolerant(self)

    def close(self) -> None:
        """Write what is left and close the file (idempotent); raise the OSError a write met, if any."""
        with self._arrived:
            self._closed = True
            self._arrived.notify()
        self._writer.join()
        self._file.close()
        error, self._error = self._error, None
        if error is not None:
            raise error


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
