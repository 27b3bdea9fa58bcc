"""What each Spark task of `hvdplus.spark.run` does, inside Spark's barrier execution mode.

The task counts its attempt in the store (a second attempt after a failure refuses to run fn again), learns every
task's host through BarrierTaskContext.allGather, takes its rank from them (ranks grouped by host, as Horovod's),
and runs its rank in a process of its own until it ends or the driver aborts the job. A failure is reported to the
driver through the store and the task itself ends normally, so Spark has no reason to re-run the stage."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from hvdplus.common.rendezvous import RendezvousClient
from hvdplus.runner.cluster_env import place_by_host, rank_env, worker_environ
from hvdplus.runner.hosts import Slot
from hvdplus.runner.supervise import describe_exit
from hvdplus.spark.child import Child
from hvdplus.spark.keys import ABORT_KEY, FAILURE_KEY, attempt_key, result_key

__all__ = ["TaskJob", "worker_argv", "run_barrier_task"]


@dataclass(frozen=True)
class TaskJob:
    """What the driver hands every task (in the task's closure, over Spark's RPC): the rendezvous and the options."""

    address: str
    port: int
    secret: str
    start_timeout: float
    env: Mapping[str, str] = field(default_factory=dict)
    executable: str | None = None
    nics: tuple[str, ...] = ()


def worker_argv(job: TaskJob, result: str, label: str) -> list[str]:
    """The command line of a rank's process: hvdplus.spark.worker under the job's Python."""
    return [job.executable or sys.executable, "-m", "hvdplus.spark.worker", result, label]


def _report(client: RendezvousClient, message: str) -> None:
    """Record the job's first failure, where the driver watches (a later one is a consequence)."""
    client.compare_set(FAILURE_KEY, b"", message.encode())


def run_barrier_task(job: TaskJob, partition: Iterable[object]) -> Iterator[tuple[int, int, int]]:
    """The body of one barrier task: yields (task index, rank, exit status of the rank's process)."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    index, host = context.partitionId(), socket.gethostname()
    client = RendezvousClient(job.address, job.port, job.secret, job.start_timeout)
    try:
        if client.add(attempt_key(index), 1) > 1:
            _report(
                client,
                f"Spark started task {index} again on {host}: an earlier attempt of the job's barrier stage failed "
                "(a lost executor or a killed task; see the Spark logs). hvdplus.spark runs fn once per job and "
                "does not run it again",
            )
            yield index, -1, 1
            return
        slot = place_by_host(context.allGather(host))[index]
        yield index, slot.rank, _run_rank(job, client, slot, f"rank {slot.rank} (Spark task {index} on {host})")
    except (ConnectionError, OSError):
        raise  # the driver is gone: nobody to report to
    except Exception:
        _report(client, f"Spark task {index} on {host} failed:\n{traceback.format_exc()}")
        yield index, -1, 1
    finally:
        client.close()


def _run_rank(job: TaskJob, client: RendezvousClient, slot: Slot, label: str) -> int:
    """Run rank `slot.rank`'s process to its end, or until the driver aborts; its exit status."""
    try:
        env = worker_environ(os.environ, job.env, rank_env(slot, job.address, job.port, job.secret, job.nics))
        child = Child(client, worker_argv(job, result_key(str(slot.rank)), label), env, str(slot.rank))
    except OSError as exc:
        _report(client, f"{label} could not start {job.executable or sys.executable!r}: {exc}")
        return 127
    code = child.wait(lambda: client.check([ABORT_KEY]))
    if code != 0 and not client.check([ABORT_KEY]):
        tail = "\n".join(child.tail)
        _report(client, f"{label} exited with {describe_exit(code)}" + (f"; last output:\n{tail}" if tail else ""))
    return code
