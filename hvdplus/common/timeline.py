"""Chrome-trace timeline (open in Perfetto or chrome://tracing): one row per tensor name, Horovod's phases.

Each collective shows NEGOTIATE_<KIND> (submitted until every rank agreed), then the <KIND> span holding its
activities: QUEUE (agreed, waiting for the batches before it), MEMCPY_IN_FUSION_BUFFER, the engine call
(MPI_ALLREDUCE, GLOO_ALLGATHER, ... or HIERARCHICAL_ALLREDUCE with its LOCAL_/CROSS_ sub-steps nested) and
MEMCPY_OUT_FUSION_BUFFER. Horovod's format and variables (HOROVOD_TIMELINE, HOROVOD_TIMELINE_MARK_CYCLES).

Events are buffered and written at most every `flush_seconds`, each time followed by the closing bracket, which
the next write overwrites: the file is valid JSON after every flush, so a job that dies keeps a readable trace.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Iterable

__all__ = ["Timeline"]

_CLOSE = b"\n]\n"


class Timeline:
    """Collects trace events from any thread; `flush()` writes them, `close()` ends the file."""

    def __init__(self, path: str, mark_cycles: bool = False, flush_seconds: float = 1.0) -> None:
        self.mark_cycles = mark_cycles
        self._flush_seconds = flush_seconds
        self._file = open(path, "wb")
        self._file.write(b"[" + _CLOSE)
        self._file.flush()
        self._written = 0  # events in the file so far
        self._pending: list[dict] = []
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._last_flush = self._start

    def _emit(self, event: dict) -> None:
        with self._lock:
            self._pending.append(event)

    def _row(self, name: str) -> int:
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

    def close(self) -> None:
        """Write what is left and close the file (idempotent)."""
        self.flush()
        with self._lock:
            self._file.close()
