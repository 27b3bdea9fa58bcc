"""The rendezvous store keys through which the Spark driver, its tasks and their ranks talk (stdlib only)."""

from __future__ import annotations

__all__ = [
    "FUNCTION_KEY",
    "FAILURE_KEY",
    "ABORT_KEY",
    "result_key",
    "attempt_key",
    "output_key",
    "TASKS_KEY",
    "task_key",
    "heartbeat_key",
    "start_key",
    "stop_key",
    "exit_key",
]

PREFIX = "hvdplus/spark"
FUNCTION_KEY = f"{PREFIX}/function"  # the driver's pickled (fn, args, kwargs)
FAILURE_KEY = f"{PREFIX}/failure"  # the first failure, in words: the rank, where it ran, its traceback
ABORT_KEY = f"{PREFIX}/abort"  # set by the driver: every task stops its rank and returns


def result_key(tag: str) -> str:
    """Where a rank leaves its pickled (ok, value) outcome; `tag`: its rank (run) or worker id (run_elastic)."""
    return f"{PREFIX}/result/{tag}"


def attempt_key(index: int) -> str:
    """A counter each attempt of Spark task `index` adds 1 to: a second attempt must not run fn again."""
    return f"{PREFIX}/attempt/{index}"


def output_key(tag: str, seq: int) -> str:
    """Line `seq` of what rank `tag` printed: one byte for the stream (b'o' or b'e'), then the line."""
    return f"{PREFIX}/output/{tag}/{seq}"


TASKS_KEY = f"{PREFIX}/elastic/tasks"  # run_elastic: how many task attempts registered


def task_key(number: int) -> str:
    """run_elastic: the host name (`spark-task-<index>-<attempt>`, a host of one slot) of registered attempt
    `number` (from 0, in the order they registered)."""
    return f"{PREFIX}/elastic/task/{number}"


def heartbeat_key(host: str) -> str:
    """run_elastic: a counter the task `host` raises about every HEARTBEAT seconds while it lives."""
    return f"{PREFIX}/elastic/heartbeat/{host}"


def start_key(host: str, run: int) -> str:
    """run_elastic: the driver's order to task `host` to start its `run`-th worker (its JSON environment)."""
    return f"{PREFIX}/elastic/start/{host}/{run}"


def stop_key(host: str, run: int) -> str:
    """run_elastic: the driver's order to stop that worker."""
    return f"{PREFIX}/elastic/stop/{host}/{run}"


def exit_key(host: str, run: int) -> str:
    """run_elastic: that worker's exit status, set by its task."""
    return f"{PREFIX}/elastic/exit/{host}/{run}"
