"""Horovod on Spark (`horovod.spark.run`, `run_elastic`): Spark tasks start the ranks, hvdplus's runtime runs them.

PySpark is imported only when a job runs (install it with `pip install 'hvdplus[spark]'`). Horovod's Spark
Estimators (KerasEstimator, TorchEstimator, Petastorm) are not part of hvdplus."""

from __future__ import annotations

from hvdplus.spark.elastic import run_elastic
from hvdplus.spark.runner import run

__all__ = ["run", "run_elastic"]
