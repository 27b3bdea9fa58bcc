"""horovod.ray.elastic: Horovod's ElasticRayExecutor (its first elastic Ray API: settings with the bounds, then
start() and run()) and RayHostDiscovery; the job they run is hvdplus/ray/elastic_job.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hvdplus.ray.elastic_job import RayHostDiscovery
from hvdplus.ray.runner import RayExecutor
from hvdplus.ray.settings import ElasticRaySettings
from hvdplus.runner.cluster_env import deprecated_bounds

__all__ = ["ElasticRayExecutor", "RayHostDiscovery"]


class ElasticRayExecutor:
    """Horovod's ElasticRayExecutor: an elastic job over every live Ray node (Horovod deprecated it for
    `RayExecutor(min_workers=..., max_workers=...)`, which this runs on).

    ```python
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=8)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)
    executor.start()
    results = executor.run(train)     # train() calls hvd.init() and an @hvd.elastic.run function
    ```
    """

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: set[str] | None = None,
        min_np: int | None = None,
        max_np: int | None = None,
        **kwargs: Any,
    ) -> ElasticRaySettings:
        """Horovod's ElasticSettings for Ray. `min_np`/`max_np` are Horovod's deprecated names of the bounds;
        other keywords must name a settings field (`verbose`, `cooldown_range`)."""
        fewest, max_num_proc = deprecated_bounds(min_num_proc, max_num_proc, min_np, max_np)
        known = {f.name for f in dataclasses.fields(ElasticRaySettings)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"ElasticRayExecutor.create_settings: unknown setting(s) {unknown}; known: {sorted(known)}")
        return ElasticRaySettings(
            min_num_proc=min_num_proc if fewest is None else fewest,
            max_num_proc=max_num_proc,
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            nics=nics,
            **kwargs,
        )

    def __init__(
        self,
        settings: ElasticRaySettings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: dict[str, Any] | None = None,
        override_discovery: bool = True,
    ) -> None:
        self.settings, self.env_vars = settings, dict(env_vars or {})
        self._executor = RayExecutor(
            settings,
            cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot,
            min_workers=settings.min_num_proc,
            max_workers=settings.max_num_proc,
            reset_limit=settings.reset_limit,
            cooldown_range=settings.cooldown_range,
            elastic_timeout=settings.elastic_timeout,
            override_discovery=override_discovery,
        )

    def start(self) -> None:
        """Prepare the job (its workers start in run())."""
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any], callbacks: list[Callable[[Any], None]] | None = None) -> list[Any]:
        """`worker_fn()` on every worker the driver plans, until the job ends; the last generation's values in
        rank order."""
        return self._executor.run(worker_fn, callbacks=callbacks)
