"""Horovod's RayExecutor: start ranks as Ray actors, then run functions on all of them.

Ray only starts the ranks and hands each one an authenticated rendezvous; everything after hvd.init() is
hvdplus's own runtime over Gloo, as under hvdplusrun."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import ray

from hvdplus.ray.elastic_job import ElasticJob, RayHostDiscovery
from hvdplus.ray.placement import Placement
from hvdplus.ray.settings import RaySettings, settings_env
from hvdplus.ray.static import StaticJob
from hvdplus.runner.job_spec import ElasticOptions

__all__ = ["RayExecutor"]

_MPI_VARIABLES = ("HVDPLUS_CPU_OPERATIONS", "HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER")


class RayExecutor:
    """Horovod's RayExecutor (horovod.ray). A static job with `num_workers` (or `num_hosts` x
    `num_workers_per_host`); an elastic job with `min_workers` (and `max_workers`, `reset_limit`,
    `cooldown_range`, `elastic_timeout`), whose workers come from Ray's live nodes.

    ```python
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=4, use_gpu=True)
    executor.start()
    results = executor.run(train, kwargs={"epochs": 3})   # one value per rank, in rank order
    executor.shutdown()
    ```
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: set[str] | None = None,
    ) -> RaySettings:
        """Horovod's settings object. `timeout_s`: rendezvous and engine timeout; `placement_group_timeout_s`:
        how long to wait for the placement group; `nics`: the interfaces to use. `ssh_identity_file` and `ssh_str`
        are accepted for Horovod's callers and unused: Ray starts the workers, no key is written."""
        return RaySettings(
            ssh_identity_file=ssh_identity_file,
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )

    def __init__(
        self,
        settings: RaySettings,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | list[float] | None = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
    ) -> None:
        _check(num_workers, num_hosts, num_workers_per_host, min_workers, max_workers, use_gpu, gpus_per_worker)
        gpus = (gpus_per_worker or 1) if use_gpu else 0
        self.settings = settings
        self._job: StaticJob | None = None
        self._elastic: ElasticJob | None = None
        if min_workers is not None:
            settings.elastic = True
            discovery = getattr(settings, "discovery", None)
            if override_discovery or discovery is None:
                discovery = RayHostDiscovery(use_gpu, cpus_per_worker, gpus)
            options = ElasticOptions(
                np=min_workers,
                min_np=min_workers,
                max_np=max_workers,
                discover=discovery.find_available_hosts_and_slots,
                timeout=float(elastic_timeout),
                reset_limit=reset_limit,
                cooldown_range=(float(cooldown_range[0]), float(cooldown_range[1])) if cooldown_range else None,
            )
            self._elastic = ElasticJob(options, discovery, cpus_per_worker, gpus, settings.verbose >= 2)
            self._elastic.env.update({**settings_env(settings), "PYTHONUNBUFFERED": "1"})
        else:
            placement = Placement(
                num_workers,
                num_hosts,
                num_workers_per_host,
                cpus_per_worker,
                gpus,
                use_current_placement_group,
                settings.placement_group_timeout_s,
            )
            self._job = StaticJob(settings, placement)

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: list[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
        extra_env_vars: dict[str, Any] | None = None,
    ) -> None:
        """Start the workers (actors in a placement group), rank them by node and create `executable_cls(*args,
        **kwargs)` in each. `extra_env_vars` are set in every worker. Elastic jobs start their workers in run()."""
        _refuse_unsupported(extra_env_vars or {})
        if self._elastic is not None:
            if executable_cls is not None:
                raise ValueError(
                    "hvdplus.ray: an elastic job's workers live for one run(), so they hold no executable: "
                    "drop executable_cls, or use num_workers for a static job"
                )
            self._elastic.env.update({k: str(v) for k, v in (extra_env_vars or {}).items()})
            return
        self._static().start(executable_cls, executable_args, executable_kwargs, extra_env_vars)

    def run(
        self,
        fn: Callable[..., Any],
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        callbacks: list[Callable[[Any], None]] | None = None,
    ) -> list[Any]:
        """`fn(*args, **kwargs)` on every worker; the values in rank order. A worker's error is raised here,
        naming its rank, within seconds (its peers' collectives are released)."""
        _no_callbacks(callbacks)
        args, kwargs = list(args or []), dict(kwargs or {})
        if self._elastic is not None:
            return self._elastic.run(lambda: fn(*args, **kwargs))
        return self._static().run(lambda actor, env: actor.execute.remote(lambda _: fn(*args, **kwargs), env))

    def run_remote(
        self, fn: Callable[..., Any], args: list[Any] | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Start `fn(*args, **kwargs)` on every worker; its ObjectRefs in rank order (ray.get them)."""
        args, kwargs = list(args or []), dict(kwargs or {})
        return self._static("run_remote").submit(
            lambda actor, env: actor.execute.remote(lambda _: fn(*args, **kwargs), env)
        )

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[[Any], None]] | None = None) -> list[Any]:
        """`fn(executable)` on every worker (the object start() created there); the values in rank order."""
        _no_callbacks(callbacks)
        return self._static("execute").run(lambda actor, env: actor.execute.remote(fn, env))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(executable)` on the rank 0 worker only; its value."""
        return self._static("execute_single").run(lambda actor, env: actor.execute.remote(fn, env), ranks=[0])[0]

    def shutdown(self) -> None:
        """End the workers, close the rendezvous servers and release the placement group."""
        if self._job is not None:
            self._job.shutdown()

    def _static(self, method: str = "") -> StaticJob:
        if self._job is None:
            raise NotImplementedError(
                f"hvdplus.ray: {method}() is for static jobs; an elastic job (min_workers) runs functions with "
                "run(), its workers living only for that call (as in Horovod)"
            )
        if ray.util.client.ray.is_connected():
            raise NotImplementedError(
                "hvdplus.ray does not run through Ray Client (ray://) yet: the workers must reach the driver's "
                "rendezvous. Run the driver on the cluster (ray job submit)"
            )
        return self._job


def _check(
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int,
    min_workers: int | None,
    max_workers: int | None,
    use_gpu: bool,
    gpus_per_worker: float | None,
) -> None:
    """Horovod's argument checks, with the fix in each message."""
    if max_workers and (not min_workers or min_workers <= 0):
        raise ValueError("max_workers is given without a positive min_workers: elastic jobs need min_workers >= 1")
    if min_workers is not None and (num_workers is not None or num_hosts is not None):
        raise ValueError(
            "give either num_workers/num_hosts (a static job) or min_workers/max_workers (an elastic job), not both"
        )
    if max_workers is not None and min_workers is not None and max_workers < min_workers:
        raise ValueError(f"max_workers {max_workers} is below min_workers {min_workers}")
    if num_workers is not None and num_hosts is not None:
        raise ValueError("give num_workers, or num_hosts with num_workers_per_host, not both")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_hosts is not None and (num_hosts < 1 or num_workers_per_host < 1):
        raise ValueError(f"num_hosts and num_workers_per_host must be >= 1, got {num_hosts} and {num_workers_per_host}")
    if gpus_per_worker and not use_gpu:
        raise ValueError("gpus_per_worker is set but use_gpu is False: pass use_gpu=True")
    if use_gpu and gpus_per_worker is not None and gpus_per_worker < 1:
        raise ValueError(f"gpus_per_worker must be >= 1, got {gpus_per_worker}")
    if min_workers is None and num_workers is None and num_hosts is None:
        raise ValueError("give num_workers (or num_hosts and num_workers_per_host), or min_workers for elastic")


def _refuse_unsupported(extra_env_vars: dict[str, Any]) -> None:
    """MPI does not run under Ray (nor did it in Horovod's RayExecutor): ranks meet through Gloo."""
    asked = [f"{k}={v}" for k, v in extra_env_vars.items() if k in _MPI_VARIABLES and str(v).lower() == "mpi"]
    if asked:
        raise ValueError(
            f"hvdplus.ray runs ranks over Gloo, not MPI ({', '.join(asked)}): Ray starts the workers, and no "
            "mpirun connects them. Drop the setting, or launch with hvdplusrun --mpi / mpirun outside Ray"
        )


def _no_callbacks(callbacks: list[Callable[[Any], None]] | None) -> None:
    if callbacks:
        warnings.warn(
            "hvdplus.ray: callbacks are not supported yet and are ignored (Horovod's static RayExecutor ignored "
            "them too); log from rank 0 instead",
            stacklevel=3,
        )
