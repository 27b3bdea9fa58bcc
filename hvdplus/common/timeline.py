"""Chrome-trace timeline (open in chrome://tracing or Perfetto): one row per tensor name.

Each collective shows a NEGOTIATE_<KIND> span (submitted until every rank agreed) followed by the
<KIND> span (the engine call, fused allreduces sharing one span each). Horovod's format and variable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TextIO

__all__ = ["Timeline"]


class Timeline:
    """Appends trace events to `path` as they happen; `close()` finishes the JSON array."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.mark_cycles = mark_cycles
        self._file: TextIO = open(path, "w")
        self._file.write("[\n")
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._pid = os.getpid()

    def _emit(self, event: dict) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(event) + ",\n")

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
        return row

    def _now_us(self) -> float:
        return (time.perf_counter() - self._start) * 1e6

    def begin(self, tensor: str, phase: str) -> None:
        """Open span `phase` on the tensor's row."""
        self._emit({"name": phase, "ph": "B", "ts": self._now_us(), "pid": self._row(tensor), "tid": 1})

    def end(self, tensor: str) -> None:
        """Close the innermost open span on the tensor's row."""
        self._emit({"ph": "E", "ts": self._now_us(), "pid": self._row(tensor), "tid": 1})

    def cycle(self) -> None:
        """Mark the start of a negotiation cycle (with HOROVOD_TIMELINE_MARK_CYCLES=1)."""
        if self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "ts": self._now_us(), "pid": 0, "s": "g"})

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps({"name": "trace_end", "ph": "i", "ts": self._now_us(), "pid": 0}))
                self._file.write("\n]\n")
                self._file.close()
