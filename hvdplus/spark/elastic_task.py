"""What each Spark task of `hvdplus.spark.run_elastic` does (a plain stage, not a barrier one: a task that fails
does not take the others with it).

Each attempt of a task is a host of one slot, `spark-task-<index>-<attempt>` (Horovod's choice on Spark): it
registers in the store, beats a heartbeat, and runs a worker whenever the elastic driver orders one, until the
driver aborts the job. A worker that fails by itself makes the task fail, so that Spark runs it again (up to
spark.task.maxFailures), as a new host that the driver can add to the job."""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterable, Iterator

from hvdplus.common.elastic.plan import worker_id
from hvdplus.common.rendezvous import RendezvousClient
from hvdplus.runner.cluster_env import worker_environ
from hvdplus.runner.supervise import describe_exit
from hvdplus.spark.child import POLL_SECONDS, Child
from hvdplus.spark.keys import ABORT_KEY, TASKS_KEY, exit_key, heartbeat_key, result_key, start_key, stop_key, task_key
from hvdplus.spark.task import TaskJob, worker_argv

__all__ = ["HEARTBEAT_SECONDS", "task_host", "run_elastic_task"]

HEARTBEAT_SECONDS = 0.5


def task_host(index: int, attempt: int) -> str:
    """The host name an attempt of a task stands for in the elastic job."""
    return f"spark-task-{index}-{attempt}"


def _beat(client: RendezvousClient, host: str, stopped: threading.Event) -> None:
    while not stopped.wait(HEARTBEAT_SECONDS):
        try:
            client.add(heartbeat_key(host), 1)
        except (ConnectionError, OSError):
            return


def _order(client: RendezvousClient, host: str, run: int) -> dict[str, str] | None:
    """Wait for the driver's order to start worker `run` (its environment), or None once the job is over."""
    while not client.check([ABORT_KEY]):
        if client.check([start_key(host, run)]):
            env: dict[str, str] = json.loads(client.get(start_key(host, run)))
            return env
        threading.Event().wait(POLL_SECONDS)
    return None


def _stopping(client: RendezvousClient, host: str, run: int) -> bool:
    """Whether the driver ordered worker `run` of task `host` to stop, or aborted the job."""
    return client.check([stop_key(host, run)]) or client.check([ABORT_KEY])


def run_elastic_task(job: TaskJob, index: int, partition: Iterable[object]) -> Iterator[tuple[str, int]]:
    """The body of one elastic task: yields (its host name, the number of workers it ran) once the job is over."""
    from pyspark import TaskContext

    context = TaskContext.get()
    host = task_host(index, context.attemptNumber() if context is not None else 0)
    wid = worker_id(host, 0)
    client = RendezvousClient(job.address, job.port, job.secret, job.start_timeout)
    stopped = threading.Event()
    try:
        client.set(task_key(client.add(TASKS_KEY, 1) - 1), host.encode())
        threading.Thread(target=_beat, args=(client.clone(), host, stopped), daemon=True).start()
        run, seq = 0, 0
        while (env := _order(client, host, run)) is not None:
            label = f"worker {wid} (Spark task {index})"
            environ = worker_environ(os.environ, job.env, env)
            child = Child(client, worker_argv(job, result_key(wid), label), environ, wid, seq)
            code = child.wait(functools.partial(_stopping, client, host, run))
            seq = child.seq
            client.set(exit_key(host, run), str(code).encode())
            if code != 0 and not _stopping(client, host, run):
                tail = "\n".join(child.tail)
                raise RuntimeError(
                    f"{label} exited with {describe_exit(code)}; the task fails so that Spark runs it again"
                    + (f". Last output:\n{tail}" if tail else "")
                )
            run += 1
        yield host, run
    finally:
        stopped.set()
        client.close()
