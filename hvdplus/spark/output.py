"""The driver's printer of what ranks print: each line from the store to `stdout` or `stderr`, prefixed
`[rank]<stdout>:` as hvdplusrun's Gloo mode does (optionally after a timestamp)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from hvdplus.common.rendezvous import RendezvousServer
from hvdplus.spark.keys import output_key

__all__ = ["OutputPrinter"]

POLL_SECONDS = 0.1


class OutputPrinter:
    """Prints the ranks' lines as they arrive, in a thread, until `stop()` (which prints what is left)."""

    def __init__(
        self,
        server: RendezvousServer,
        tags: Callable[[], list[str]],
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        timestamps: bool = False,
    ) -> None:
        """`tags()` names the ranks (or elastic workers) whose output to print."""
        self._server, self._tags, self._timestamps = server, tags, timestamps
        self._streams = {b"o": stdout or sys.stdout, b"e": stderr or sys.stderr}
        self._next: dict[str, int] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdplus-spark-output", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            self.print_new()

    def print_new(self) -> None:
        """Print every line that arrived since the last call."""
        for tag in self._tags():
            seq = self._next.get(tag, 0)
            while (data := self._server.get(output_key(tag, seq))) is not None:
                self._server.store.apply("delete", [output_key(tag, seq).encode()])
                kind, line = data[:1], data[1:].decode(errors="replace")
                stream = self._streams[kind]
                when = time.strftime("%a %b %d %H:%M:%S %Y ") if self._timestamps else ""
                end = "" if line.endswith("\n") else "\n"
                stream.write(f"{when}[{tag}]<{'stdout' if kind == b'o' else 'stderr'}>:{line}{end}")
                stream.flush()
                seq += 1
            self._next[tag] = seq

    def stop(self) -> None:
        """Stop the thread and print what is left."""
        self._stopped.set()
        self._thread.join()
        self.print_new()
