"""`hvdplus.spark.run`: Horovod's `horovod.spark.run` on hvdplus. Spark starts the ranks as the tasks of one barrier
stage; everything after hvd.init() is hvdplus's usual Gloo runtime.

The driver serves the job's authenticated rendezvous on the driver host, hands every task its address and the
job's secret in the task's closure (Spark's RPC, encrypted where spark.network.crypto is on; never a file), and
watches the store: the first failure, or tasks that do not start within start_timeout, ends the job."""

from __future__ import annotations

import functools
import logging
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

from hvdplus.common.rendezvous import RendezvousServer, new_secret
from hvdplus.spark.context import active_context, driver_addresses, num_proc_from, start_timeout_from
from hvdplus.spark.keys import ABORT_KEY, FAILURE_KEY, FUNCTION_KEY, attempt_key, result_key
from hvdplus.spark.output import OutputPrinter
from hvdplus.spark.spark_job import SparkJob
from hvdplus.spark.task import TaskJob, run_barrier_task

__all__ = ["run", "check_engine", "dumps", "nic_list", "abort", "CANCEL_SECONDS"]

log = logging.getLogger("hvdplus.spark")

POLL_SECONDS = 0.1
ABORT_GRACE_SECONDS = 3.0  # tasks stop their ranks by themselves once the driver aborts; then Spark cancels them
CANCEL_SECONDS = 5.0  # how long the driver waits for Spark to cancel the job before it raises anyway


def check_engine(use_mpi: bool | None, use_gloo: bool | None, extra_mpi_args: str | None) -> None:
    """Refuse MPI (use_mpi=True, use_gloo=False, MPI arguments): Spark starts the ranks itself, so there is no
    mpirun; they run over Gloo."""
    if use_mpi:
        raise ValueError(
            "hvdplus.spark runs its ranks over Gloo (Spark starts the processes, so there is no mpirun): "
            "drop use_mpi=True"
        )
    if extra_mpi_args:
        raise ValueError(f"extra_mpi_args={extra_mpi_args!r} needs MPI, which hvdplus.spark does not use: drop it")
    if use_gloo is not None and not isinstance(use_gloo, bool):
        raise TypeError(f"use_gloo must be True, False or None, got {use_gloo!r}")
    if use_gloo is False:  # Horovod's run_controller: not Gloo means MPI
        raise ValueError(
            "hvdplus.spark runs its ranks over Gloo (Spark starts the processes, so there is no mpirun): "
            "use_gloo=False asks for MPI; drop it or pass use_gloo=True"
        )


def dumps(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bytes:
    """fn and its arguments, pickled with PySpark's cloudpickle (lambdas and functions of __main__ travel too)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}; pass the function itself")
    from pyspark import cloudpickle

    data: bytes = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    return data


def nic_list(nics: Iterable[str] | None) -> list[str]:
    """Horovod's `nics` (a set or a list of interface names) as a list; a set in sorted order."""
    if nics is None:
        return []
    if isinstance(nics, str):
        return [nics]
    return sorted(nics) if isinstance(nics, (set, frozenset)) else list(nics)


def abort(server: RendezvousServer, spark: SparkJob, grace: float = ABORT_GRACE_SECONDS) -> None:
    """End the job: every task stops its rank and returns; Spark cancels what is left after `grace` seconds."""
    server.put(ABORT_KEY, b"1")
    if not spark.done.wait(grace):
        spark.cancel()
        spark.done.wait(CANCEL_SECONDS)


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `num_proc` Spark tasks (fn calls hvd.init() itself); its results in rank order.

    `num_proc` defaults to the SparkContext's defaultParallelism, `start_timeout` to HOROVOD_SPARK_START_TIMEOUT or
    600 s. Raises RuntimeError naming the rank, its task and its traceback when a rank fails, and TimeoutError
    when the tasks do not all start within `start_timeout` (too few free task slots)."""
    check_engine(use_mpi, use_gloo, extra_mpi_args)
    payload = dumps(fn, args, kwargs)
    context = active_context()
    num_proc = num_proc_from(context, num_proc)
    timeout = start_timeout_from(start_timeout)
    interfaces = nic_list(nics)
    bind, address = driver_addresses(context, interfaces)
    secret = new_secret()
    server = RendezvousServer([bind], secret)
    ranks = [str(rank) for rank in range(num_proc)]
    printer = OutputPrinter(server, lambda: ranks, stdout, stderr, prefix_output_with_timestamp)
    try:
        server.put(FUNCTION_KEY, payload)
        job = TaskJob(address, server.port(bind), secret, timeout, dict(env or {}), executable, tuple(interfaces))
        if verbose >= 1:
            log.info("hvdplus.spark.run: %d rank(s), rendezvous at %s:%d", num_proc, address, job.port)
        tasks = context.parallelize(range(num_proc), num_proc).barrier()
        spark = SparkJob(context, "run", tasks.mapPartitions(functools.partial(run_barrier_task, job)).collect)
        _watch(server, spark, num_proc, timeout)
    finally:
        printer.stop()
        server.close()
    return _results(server, num_proc)


def _watch(server: RendezvousServer, spark: SparkJob, num_proc: int, timeout: float) -> None:
    """Wait for the Spark job, ending it at the first failure a task reports, or when the tasks do not all start
    within `timeout` seconds."""
    deadline, started = time.monotonic() + timeout, False
    while not spark.done.wait(POLL_SECONDS):
        failure = server.get(FAILURE_KEY)
        if failure is not None:
            abort(server, spark)
            raise RuntimeError(f"hvdplus.spark.run: {failure.decode(errors='replace')}")
        if not started:
            count = sum(server.get(attempt_key(i)) is not None for i in range(num_proc))
            started = count == num_proc
            if not started and time.monotonic() > deadline:
                abort(server, spark, grace=0.0)  # the tasks that started wait in allGather: Spark cancels them
                raise TimeoutError(
                    f"hvdplus.spark.run: only {count} of the {num_proc} Spark task(s) started within start_timeout "
                    f"{timeout:g} s. A barrier stage starts all its tasks at once: the cluster needs {num_proc} "
                    "free task slots (executors x cores / spark.task.cpus). Lower num_proc, add executors, or raise "
                    "start_timeout if executors are allocated on demand"
                )
    failure = server.get(FAILURE_KEY)
    if failure is not None:
        raise RuntimeError(f"hvdplus.spark.run: {failure.decode(errors='replace')}")
    if spark.error is not None:
        raise RuntimeError(f"hvdplus.spark.run: the Spark job failed: {spark.error}") from spark.error


def _results(server: RendezvousServer, num_proc: int) -> list[Any]:
    """Every rank's returned value, in rank order."""
    values = []
    for rank in range(num_proc):
        data = server.get(result_key(str(rank)))
        if data is None:
            raise RuntimeError(f"hvdplus.spark.run: rank {rank} ended without returning a result")
        ok, value = pickle.loads(data)
        if not ok:
            raise RuntimeError(f"hvdplus.spark.run: rank {rank} raised:\n{value}")
        values.append(value)
    return values
