"""`hvdplus.spark.run_elastic`: Horovod's elastic training on Spark, driven by hvdplusrun's own ElasticDriver.

Spark runs `max_num_proc` plain tasks; each attempt of a task is a host of one slot that discovery offers while
its heartbeat lives. The driver plans generations as hvdplusrun does (docs/elastic.md): a worker that fails, or a
task that Spark loses, blacklists that host and the job goes on from the last commit with the others (if
`min_num_proc` allows); Spark runs a failed task again as a new host, which joins at the next reset."""

from __future__ import annotations

import functools
import json
import logging
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO, cast

from hvdplus.common.elastic.plan import host_of
from hvdplus.common.settings import Settings
from hvdplus.runner.cluster_env import deprecated_bounds, rank_env
from hvdplus.runner.elastic_run import ElasticDriver, ElasticJobError
from hvdplus.runner.hosts import Slot
from hvdplus.runner.job_spec import ElasticOptions, JobSpec
from hvdplus.runner.supervise import Process
from hvdplus.spark.context import active_context, driver_addresses, num_proc_from, start_timeout_from
from hvdplus.spark.elastic_task import run_elastic_task
from hvdplus.spark.elastic_tasks import POLL_SECONDS, TaskRegistry, TaskSupervisor
from hvdplus.spark.keys import FAILURE_KEY, FUNCTION_KEY, result_key
from hvdplus.spark.output import OutputPrinter
from hvdplus.spark.runner import CANCEL_SECONDS, dumps, nic_list
from hvdplus.spark.spark_job import SparkJob
from hvdplus.spark.task import TaskJob

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["run_elastic", "SparkElasticDriver"]

log = logging.getLogger("hvdplus.spark")


class SparkElasticDriver(ElasticDriver):
    """hvdplusrun's elastic driver whose workers are started by Spark tasks instead of over ssh."""

    def __init__(self, options: ElasticOptions, bind: str, address: str, nics: list[str], verbose: bool) -> None:
        super().__init__(JobSpec(command=[], slots=[], mode="gloo", env={}, nics=nics, verbose=verbose), options)
        self.address, self.port = address, self.server.listen(bind)
        self.tasks = TaskRegistry(self.server)
        self.supervisor = TaskSupervisor(self.server, self.tasks)
        self.spark: SparkJob | None = None  # the Spark job of the tasks, once started
        self.notices: TextIO | None = None  # where say() prints (default sys.stderr)

    def check_engine(self) -> None:
        """The job ends when the Spark job of its tasks failed (Spark aborted the stage)."""
        if self.spark is not None and self.spark.done.is_set() and self.spark.error is not None:
            raise ElasticJobError(f"the Spark job of its tasks failed: {self.spark.error}")

    def launch_worker(self, wid: str, slot: Slot, elastic: dict[str, str]) -> Process:
        """Order the task that stands for `wid`'s host to start it in `slot`."""
        env = rank_env(slot, self.address, self.port, self.secret, self.spec.nics)
        env.update(elastic)
        worker = self.tasks.start(host_of(wid), json.dumps(env))
        return cast(Process, worker)  # ElasticDriver reads only .exited, .proc.returncode and .stop()

    def say(self, message: str) -> None:
        """The driver's notices go to run_elastic's `stderr`."""
        print(message, file=self.notices or sys.stderr, flush=True)


def run_elastic(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` (an hvd.elastic.run training function's caller) as an elastic job on Spark tasks;
    the results of the last generation's workers, in rank order.

    `num_proc` (default defaultParallelism) workers start the job; it goes on while at least `min_num_proc`
    (default `num_proc`) live, with up to `max_num_proc` (default `num_proc`) Spark tasks. Raises RuntimeError when
    the job cannot go on (the reason, as hvdplusrun prints it, is logged to stderr). `min_np` and `max_np` are
    Horovod's deprecated spellings of `min_num_proc` and `max_num_proc`."""
    min_num_proc, max_num_proc = deprecated_bounds(min_num_proc, max_num_proc, min_np, max_np)
    payload = dumps(fn, args, kwargs)
    context = active_context()
    num_proc, fewest, most = _counts(context, num_proc, min_num_proc, max_num_proc)
    timeout = start_timeout_from(start_timeout)
    settled = Settings.from_env().elastic_timeout if elastic_timeout is None else float(elastic_timeout)
    interfaces = nic_list(nics)
    bind, address = driver_addresses(context, interfaces)
    options = ElasticOptions(num_proc, fewest, most, lambda: driver.tasks.discover(), settled, reset_limit)
    driver = SparkElasticDriver(options, bind, address, interfaces, verbose >= 2)
    driver.notices = stderr
    driver.server.put(FUNCTION_KEY, payload)
    printer = OutputPrinter(driver.server, driver.tasks.tags, stdout, stderr, prefix_output_with_timestamp)
    job = TaskJob(address, driver.port, driver.secret, timeout, dict(env or {}), None, tuple(interfaces))
    body = functools.partial(run_elastic_task, job)
    driver.spark = SparkJob(
        context, "run_elastic", context.parallelize(range(most), most).mapPartitionsWithIndex(body).collect
    )
    try:
        _await_tasks(driver, driver.spark, num_proc, timeout)
        code = driver.run()
    finally:
        driver.supervisor.stop_all()  # driver.run() did already, unless _await_tasks raised: the tasks return
        if not driver.spark.done.wait(CANCEL_SECONDS):
            driver.spark.cancel()  # tasks that could not reach the store any more
        driver.server.close()
        driver.tasks.close()
        printer.stop()
    if code != 0 or driver.plan is None:
        failure = driver.server.get(FAILURE_KEY)
        detail = f"; a worker's failure:\n{failure.decode(errors='replace')}" if failure else ""
        raise RuntimeError(f"hvdplus.spark.run_elastic: the elastic job failed (exit status {code}){detail}")
    return [_result(driver, wid) for wid in driver.plan.workers]


def _counts(
    context: SparkContext, num_proc: int | None, min_num_proc: int | None, max_num_proc: int | None
) -> tuple[int, int, int]:
    """num_proc (default defaultParallelism), min_num_proc and max_num_proc (default num_proc), checked."""
    num_proc = num_proc_from(context, num_proc)
    fewest = num_proc_from(context, num_proc if min_num_proc is None else min_num_proc, "min_num_proc")
    most = num_proc_from(context, num_proc if max_num_proc is None else max_num_proc, "max_num_proc")
    if not fewest <= num_proc <= most:
        raise ValueError(f"need min_num_proc <= num_proc <= max_num_proc, got {fewest}, {num_proc}, {most}")
    return num_proc, fewest, most


def _await_tasks(driver: SparkElasticDriver, spark: SparkJob, num_proc: int, timeout: float) -> None:
    """Wait for `num_proc` tasks to register (Horovod's start_timeout), or for the Spark job to fail."""
    deadline = time.monotonic() + timeout
    while len(driver.tasks.discover()) < num_proc:
        if spark.done.is_set():
            raise RuntimeError(f"hvdplus.spark.run_elastic: the Spark job ended before the training: {spark.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hvdplus.spark.run_elastic: only {len(driver.tasks.discover())} of the {num_proc} Spark task(s) "
                f"started within start_timeout {timeout:g} s. Lower num_proc, add executors, or raise start_timeout "
                "if executors are allocated on demand"
            )
        time.sleep(POLL_SECONDS)


def _result(driver: SparkElasticDriver, wid: str) -> Any:
    data = driver.server.get(result_key(wid))
    if data is None:
        raise RuntimeError(f"hvdplus.spark.run_elastic: worker {wid} of the last generation left no result")
    ok, value = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"hvdplus.spark.run_elastic: worker {wid} raised:\n{value}")
    return value
