"""The elastic driver's view of its Spark tasks: which attempts live (a host of one slot each) and the workers
they run, as process-like objects for hvdplusrun's ElasticDriver."""

from __future__ import annotations

import logging
import threading
import time

from hvdplus.common.rendezvous import RendezvousServer
from hvdplus.runner.supervise import Supervisor
from hvdplus.spark.keys import ABORT_KEY, TASKS_KEY, exit_key, heartbeat_key, start_key, stop_key, task_key

__all__ = ["POLL_SECONDS", "LOST_SECONDS", "ExitStatus", "TaskWorker", "TaskRegistry", "TaskSupervisor"]

log = logging.getLogger("hvdplus.spark")

POLL_SECONDS = 0.2
LOST_SECONDS = 5.0  # a task whose heartbeat stood still this long is lost (its executor died, or Spark killed it)
LOST_STATUS = 128 + 9  # reported for the worker of a lost task: it is gone as if killed


class ExitStatus:
    """What ElasticDriver reads of a worker's process: its exit status, None while it runs."""

    def __init__(self) -> None:
        self.returncode: int | None = None


class TaskWorker:
    """One worker a task runs on the driver's order (its `run`-th), seen like a supervised process."""

    def __init__(self, server: RendezvousServer, host: str, run: int) -> None:
        self.server, self.host, self.run = server, host, run
        self.proc = ExitStatus()
        self.exited = threading.Event()

    def stop(self) -> None:
        """Ask the task to stop this worker."""
        self.server.put(stop_key(self.host, self.run), b"1")

    def ended(self, code: int) -> None:
        if not self.exited.is_set():
            self.proc.returncode = code
            self.exited.set()


class TaskRegistry:
    """Follows the tasks' registrations, heartbeats and workers' exits in the store (a thread, every 0.2 s)."""

    def __init__(self, server: RendezvousServer) -> None:
        self.server = server
        self.hosts: list[str] = []  # every attempt that registered, in order
        self._beats: dict[str, tuple[bytes | None, float]] = {}  # host -> (last heartbeat, when it last changed)
        self.lost: set[str] = set()
        self.workers: list[TaskWorker] = []
        self._runs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdplus-spark-tasks", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            self.refresh()

    def refresh(self) -> None:
        """Read new registrations, mark tasks whose heartbeat stopped lost, and record workers' exits."""
        count = int(self.server.get(TASKS_KEY) or b"0")
        now = time.monotonic()
        with self._lock:
            while len(self.hosts) < count and (name := self.server.get(task_key(len(self.hosts)))) is not None:
                self.hosts.append(name.decode())
            for host in self.hosts:
                beat = self.server.get(heartbeat_key(host))
                last, since = self._beats.get(host, (None, now))
                self._beats[host] = (beat, now) if beat != last else (last, since)
                if host not in self.lost and now - self._beats[host][1] > LOST_SECONDS:
                    self.lost.add(host)
                    log.warning("hvdplus.spark: task %s is lost (no heartbeat for %g s)", host, LOST_SECONDS)
            for worker in self.workers:
                code = self.server.get(exit_key(worker.host, worker.run))
                if code is not None:
                    worker.ended(int(code))
                elif worker.host in self.lost:
                    worker.ended(LOST_STATUS)

    def discover(self) -> dict[str, int]:
        """The live tasks, as hosts of one slot each (the elastic driver's host discovery)."""
        with self._lock:
            return {host: 1 for host in self.hosts if host not in self.lost}

    def start(self, host: str, env: str) -> TaskWorker:
        """Order task `host` to start a worker with the JSON environment `env`."""
        with self._lock:
            run = self._runs.get(host, 0)
            self._runs[host] = run + 1
            worker = TaskWorker(self.server, host, run)
            self.workers.append(worker)
        self.server.put(start_key(host, run), env.encode())
        return worker

    def tags(self) -> list[str]:
        """The workers' output tags (their worker ids)."""
        with self._lock:
            return [f"{host}/0" for host in self.hosts]

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()


class TaskSupervisor(Supervisor):
    """ElasticDriver's supervisor for Spark: stopping every worker aborts the job, and every task then returns."""

    def __init__(self, server: RendezvousServer, tasks: TaskRegistry) -> None:
        super().__init__()
        self.server, self.tasks = server, tasks

    def stop_all(self) -> None:
        """Abort: every task stops its worker and returns; wait (a few seconds at most) for the workers to end."""
        self.server.put(ABORT_KEY, b"1")
        deadline = time.monotonic() + LOST_SECONDS
        for worker in list(self.tasks.workers):
            worker.exited.wait(max(0.0, deadline - time.monotonic()))
