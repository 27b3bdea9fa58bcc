"""Job supervision: rank-prefixed output, per-rank files, fail-fast, Ctrl-C to every host, no orphans."""

from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hvdplus.runner.blame import Blame, Failure

__all__ = ["Supervisor", "Process", "RankFiles", "describe_exit"]

POLL_SECONDS = 0.05
STOP_SECONDS = 2.5  # agents escalate to SIGKILL after 1 s; this bounds a stuck ssh
CULPRIT_EXIT_SECONDS = 2.0  # how long the report waits for the failed rank's exception line and exit status
_console_lock = threading.Lock()


def describe_exit(code: int) -> str:
    """'exit code 1', or 'exit code 137 (killed by SIGKILL)' for 128 + signal."""
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


@dataclass
class Process:
    """One supervised child: a rank's agent (local or over ssh) or a whole mpirun."""

    label: str
    proc: subprocess.Popen[bytes]
    lifeline: bool
    rank: int | None = None  # None for mpirun, which runs them all
    pumps: list[threading.Thread] = field(default_factory=list)
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=5))
    exited: threading.Event = field(default_factory=threading.Event)
    exited_at: float = 0.0

    def watch_exit(self) -> None:
        """Record when the process ends (a thread blocks in its wait, so exits are ordered by time, not by
        the supervisor's polling order)."""

        def wait() -> None:
            self.proc.wait()
            self.exited_at = time.monotonic()
            self.exited.set()

        threading.Thread(target=wait, name=f"hvdplusrun-{self.label}-wait", daemon=True).start()

    def stop(self) -> None:
        """Ask it to end: close its lifeline (agents) or SIGTERM it (mpirun)."""
        if self.lifeline:
            assert self.proc.stdin is not None  # the lifeline is the child's stdin pipe
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        elif not self.exited.is_set():
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_MPI_TAG = re.compile(rb"^\[(?:\d+,)?(\d+)\](?:<(stdout|stderr)>)?:? ?")


def split_tag(stream: str, line: bytes) -> tuple[int, str, bytes] | None:
    """(rank, stream, text) of a line of mpirun's tagged output ('[1,3]<stdout>: ...' or MPICH's '[3] ...')."""
    match = _MPI_TAG.match(line)
    if not match:
        return None
    return int(match.group(1)), (match.group(2) or stream.encode()).decode(), line[match.end() :]


class RankFiles:
    """--output-filename: each rank's output, without prefixes, in DIR/rank.N/stdout and DIR/rank.N/stderr."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._files: dict[tuple[int, str], IO[bytes]] = {}
        self._lock = threading.Lock()

    def write(self, rank: int, stream: str, line: bytes) -> None:
        with self._lock:
            if (rank, stream) not in self._files:
                folder = self.directory / f"rank.{rank}"
                folder.mkdir(parents=True, exist_ok=True)
                self._files[rank, stream] = open(folder / stream, "wb")
            self._files[rank, stream].write(line)
            self._files[rank, stream].flush()

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                file.close()


def _pump(
    stream: IO[bytes], console: IO[bytes], prefix: bytes, sink: Callable[[bytes], None], tail: collections.deque
) -> None:
    """Relay a child's lines to the console (and its file) until it closes the stream. If the console's reader
    goes away (`| head`, a full disk under `| tee`), the lines still go to the files and the tail, and the pump
    keeps draining: a rank blocked on a full pipe would stall the job in its next collective."""
    for line in iter(stream.readline, b""):
        tail.append(line.decode(errors="replace").rstrip())
        sink(line)
        with _console_lock:
            try:
                console.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                console.flush()
            except OSError:
                _discard(console)
    stream.close()


def _discard(console: IO[Any]) -> None:
    """Point a console whose reader is gone at /dev/null, for every writer of it (our messages, and Python's
    flush at exit, which would otherwise fail with BrokenPipeError)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, console.fileno())
    finally:
        os.close(devnull)
    try:
        console.flush()
    except OSError:  # what was buffered for the old reader is lost with it
        pass


def _end_with_parent() -> Callable[[], None] | None:
    """A preexec function asking Linux to SIGTERM the child when its parent dies (PR_SET_PDEATHSIG); None
    where there is no prctl (the lifeline covers agents there, not a bare mpirun)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def set_death_signal() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return set_death_signal


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _workers_text(count: int) -> str:
    return f"{count} other worker" + ("s" if count > 1 else "")


def _running_text(running: list[Process]) -> str:
    if len(running) == 1:
        return running[0].label if running[0].rank is None else "the running worker"  # mpirun runs them all
    return f"all {len(running)} running workers"


class Supervisor:
    """Starts children, relays their output, and ends the job at the first failure or signal."""

    def __init__(self, output_dir: str | None = None, hosts: Mapping[int, str] | None = None) -> None:
        self.files = RankFiles(output_dir) if output_dir else None
        self.hosts = dict(hosts or {})  # rank -> host, to name where the failed rank ran
        self.blame = Blame()
        self.processes: list[Process] = []
        self._signal: int | None = None

    def start(
        self,
        label: str,
        argv: Sequence[str],
        rank: int | None = None,
        payload: bytes | None = None,
        env: dict[str, str] | None = None,
        tag: str | None = None,
    ) -> Process:
        """Start `argv` in its own session; with `payload`, its stdin gets it and stays open as a lifeline (the
        agent ends its rank when it closes). Without one (mpirun), the kernel sends the child SIGTERM if this
        process dies, even by SIGKILL, and mpirun then ends its ranks. `tag` prefixes its output lines instead of
        the rank (an elastic worker's host/slot)."""
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if payload else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=None if payload else _end_with_parent(),
        )
        process = Process(label, proc, lifeline=payload is not None, rank=rank)
        process.watch_exit()
        if payload:
            assert proc.stdin is not None  # stdin=PIPE with a payload
            try:
                proc.stdin.write(payload)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass  # it exited already, or a failed peer made the supervisor close this lifeline: its exit reports it
        for name, stream, console in (
            ("stdout", proc.stdout, sys.stdout.buffer),
            ("stderr", proc.stderr, sys.stderr.buffer),
        ):
            tagged = tag if tag is not None else rank  # an elastic worker is tagged by its id: ranks change
            prefix = f"[{tagged}]<{name}>:".encode() if tagged is not None else b""
            pump = threading.Thread(
                target=_pump,
                args=(stream, console, prefix, self._sink(rank, name), process.tail),
                name=f"hvdplusrun-{label}-{name}",
                daemon=True,
            )
            pump.start()
            process.pumps.append(pump)
        self.processes.append(process)
        return process

    def _sink(self, rank: int | None, stream: str) -> Callable[[bytes], None]:
        """Where a child's lines go besides the console: its rank's file (mpirun's lines split by their rank
        tags), and the blame log for stderr."""
        files, blame = self.files, self.blame

        def sink(line: bytes) -> None:
            tagged = (rank, stream, line) if rank is not None else split_tag(stream, line)
            if tagged is None:
                return
            if files is not None:
                files.write(*tagged)
            if tagged[1] == "stderr":
                blame.observe(tagged[0], tagged[2])

        return sink

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    def wait(self) -> int:
        """Wait for every child; on the first failure or SIGINT/SIGTERM/SIGHUP stop all and return a code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._watch()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.files:
                self.files.close()

    def _watch(self) -> int:
        running = list(self.processes)
        while running:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                self._say(f"hvdplusrun: got {name}; stopping {_running_text(running)}")
                self.stop_all()
                return 128 + self._signal
            ended = sorted((p for p in running if p.exited.is_set()), key=lambda p: p.exited_at)
            for process in ended:
                running.remove(process)
            failed = [p for p in ended if p.proc.returncode != 0]
            if failed:  # the first to exit, by time; the report then names the root cause if another rank's
                code = failed[0].proc.returncode
                self._report(failed[0], running)
                self.stop_all()
                return code if code > 0 else 128 - code
            time.sleep(POLL_SECONDS)
        self._drain(self.processes)
        return 0

    def _report(self, first: Process, running: list[Process]) -> None:
        """Name the failure once: the rank that failed first (from the exceptions the ranks printed, which may
        not be the first process to exit), its host, its exit status and exception; then the ranks that failed
        as a consequence, and how many workers are being stopped, if any."""
        self._drain([first])
        cause = self._root_cause()
        culprit = self._process_of(cause.rank) if cause else None
        # A culprit that printed its exception is exiting: wait for its status.
        if cause is not None and culprit is not None and not cause.frozen:
            culprit.exited.wait(CULPRIT_EXIT_SECONDS)
        tail = culprit or first
        self._drain([tail] if tail.exited.is_set() else [])
        stopped = [p for p in running if p is not culprit and not p.exited.is_set()]
        parts = [self._culprit_text(first, cause, culprit)]
        then = self.blame.consequences(cause) if cause else []
        if then:
            parts.append(f"then {_ranks_text(then)} failed as a consequence")
        if culprit is not None and not culprit.exited.is_set():
            parts.append("stopping it" + (f" and {_workers_text(len(stopped))}" if stopped else ""))
        elif stopped:
            parts.append(f"stopping {_workers_text(len(stopped))}")
        last = "".join(f"\n    {line}" for line in tail.tail)
        self._say(f"hvdplusrun: {'; '.join(parts)}.{' Last output:' + last if last else ''}")

    def _root_cause(self) -> Failure | None:
        """The blamed failure; while only consequences are known, give the rank they name a moment to print
        its own exception (it may exit after its peers, which fail within milliseconds of it)."""
        deadline = time.monotonic() + CULPRIT_EXIT_SECONDS
        cause = self.blame.root_cause()
        while cause is not None and cause.consequence and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            cause = self.blame.root_cause()
        return cause

    def _process_of(self, rank: int) -> Process | None:
        """The supervised process that runs only `rank` (Gloo mode's agents); None under mpirun."""
        return next((p for p in self.processes if p.rank == rank), None)

    def _culprit_text(self, first: Process, cause: Failure | None, culprit: Process | None) -> str:
        if cause is None:  # nothing printed an exception: the first process to fail is all we know
            return f"{first.label} failed with {describe_exit(first.proc.returncode)}"
        who = f"rank {cause.rank}" + (f" on {self.hosts[cause.rank]}" if cause.rank in self.hosts else "")
        if culprit is None:  # mpirun ran every rank: its exit status is the job's
            return f"{who} failed ({cause.line}); {first.label} exited with {describe_exit(first.proc.returncode)}"
        if culprit.exited.is_set():
            return f"{who} failed with {describe_exit(culprit.proc.returncode)} ({cause.line})"
        return f"{who} failed ({cause.line}) and has not exited"

    def stop_all(self) -> None:
        """End every child: polite first, then SIGKILL whatever is left after STOP_SECONDS."""
        for process in self.processes:
            process.stop()
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.processes:
            if not process.exited.wait(timeout=max(0.0, deadline - time.monotonic())):
                process.kill()
                process.exited.wait()
        self._drain(self.processes)

    @staticmethod
    def _drain(processes: list[Process]) -> None:
        for process in processes:
            for pump in process.pumps:
                pump.join(timeout=1.0)

    @staticmethod
    def _say(message: str) -> None:
        with _console_lock:
            try:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
            except OSError:
                _discard(sys.stderr)
