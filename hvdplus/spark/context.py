"""The driver's side of Spark: PySpark itself (an optional dependency), the active SparkContext, and where tasks
reach the driver."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hvdplus.runner.agent import interface_address

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = ["active_context", "driver_addresses", "start_timeout_from", "num_proc_from"]

DEFAULT_START_TIMEOUT = 600.0


def active_context() -> SparkContext:
    """The running SparkContext; ImportError naming the extra without PySpark, RuntimeError without a context."""
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError("hvdplus.spark needs PySpark: pip install 'hvdplus[spark]'") from None
    context = SparkContext._active_spark_context
    if context is None:
        raise RuntimeError(
            "hvdplus.spark found no active SparkContext: create one first "
            "(SparkSession.builder.getOrCreate()) and call run() on the driver"
        )
    return context


def driver_addresses(context: SparkContext, nics: Sequence[str] | None) -> tuple[str, str]:
    """(address to bind the rendezvous to, address tasks connect to): the first of `nics`' address, else
    spark.driver.bindAddress and spark.driver.host, the addresses Spark's own driver uses (never 0.0.0.0)."""
    if nics:
        address = interface_address(nics[0])
        if address is None:
            raise ValueError(f"nics: this driver has no IPv4 address on {nics[0]!r}; name an interface it has")
        return address, address
    conf = context.getConf()
    host = conf.get("spark.driver.host") or socket.gethostname()
    advertised = socket.gethostbyname(host)
    bind = conf.get("spark.driver.bindAddress") or advertised
    return (advertised if bind in ("0.0.0.0", "::") else socket.gethostbyname(bind)), advertised


def start_timeout_from(start_timeout: float | None, environ: Mapping[str, str] = os.environ) -> float:
    """`start_timeout`, else HOROVOD_SPARK_START_TIMEOUT, else 600 s (Horovod's default)."""
    if start_timeout is None:
        text = environ.get("HOROVOD_SPARK_START_TIMEOUT")
        try:
            start_timeout = float(text) if text else DEFAULT_START_TIMEOUT
        except ValueError:
            raise ValueError(f"HOROVOD_SPARK_START_TIMEOUT must be a number of seconds, got {text!r}") from None
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or start_timeout <= 0:
        raise ValueError(f"start_timeout must be a positive number of seconds, got {start_timeout!r}")
    return float(start_timeout)


def num_proc_from(context: SparkContext, num_proc: int | None, name: str = "num_proc") -> int:
    """`num_proc`, else the context's defaultParallelism (Horovod's default)."""
    if num_proc is None:
        return int(context.defaultParallelism)
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {num_proc!r}")
    return num_proc
