"""A Spark task's rank process: started in a session of its own, ended with the task, its output sent to the driver.

The process dies with the Python worker that runs the task (PR_SET_PDEATHSIG), so a task that Spark kills or
cancels leaves nothing behind; every line it prints goes to the driver through the job's store."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from hvdplus.common.rendezvous import RendezvousClient
from hvdplus.spark.keys import output_key

__all__ = ["Child", "POLL_SECONDS", "GRACE_SECONDS"]

POLL_SECONDS = 0.2
GRACE_SECONDS = 1.0


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec function that asks Linux to SIGKILL the child when the task's process dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def set_death_signal() -> None:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG

    return set_death_signal


class Child:
    """One rank's process, run to its end by the task; `stop()` ends it early."""

    def __init__(self, client: RendezvousClient, argv: list[str], env: dict[str, str], tag: str, seq: int = 0) -> None:
        """Start `argv`; its lines go to the store as rank `tag`'s output, numbered on from `seq`."""
        self._client, self._tag, self.seq = client, tag, seq
        self._lock = threading.Lock()
        self.tail: list[str] = []  # the last lines of its stderr, for a failure without a traceback
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent(),  # noqa: PLW1509 - only prctl, safe after fork
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None  # both are pipes
        self._pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, b"o"), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, b"e"), daemon=True),
        ]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: IO[bytes], kind: bytes) -> None:
        for line in iter(stream.readline, b""):
            if kind == b"e":
                self.tail = (self.tail + [line.decode(errors="replace").rstrip()])[-10:]
            with self._lock:
                seq, self.seq = self.seq, self.seq + 1
                try:
                    self._client.set(output_key(self._tag, seq), kind + line)
                except (ConnectionError, OSError):
                    return  # the driver is gone: the task ends the process

    def wait(self, should_stop: Callable[[], bool]) -> int:
        """Wait for the process to end, stopping it once `should_stop()` says so (or cannot ask the driver); its
        exit status (128 + signal for a signal), after its last line went to the driver."""
        while self.proc.poll() is None:
            try:
                stop = should_stop()
            except (ConnectionError, OSError):  # the driver is gone: nobody waits for this rank any more
                stop = True
            if stop:
                self.stop()
                break
            time.sleep(POLL_SECONDS)
        code = self.proc.wait()
        self._signal(signal.SIGKILL)  # whatever it left in its session
        for pump in self._pumps:
            pump.join(timeout=5.0)
        return code if code >= 0 else 128 - code

    def stop(self) -> None:
        """SIGTERM the process's session, SIGKILL after GRACE_SECONDS."""
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
