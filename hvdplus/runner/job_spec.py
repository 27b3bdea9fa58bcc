"""What a job is, as the launchers take it: JobSpec (the ranks' command, slots, mode and environment) and
ElasticOptions. job.py builds them from the command line; mpi_run, gloo_run, elastic_run, preflight and the Ray and
Spark runners take them, so the types live below all of these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hvdplus.runner.hosts import Host, Slot
from hvdplus.runner.ssh import SshOptions

__all__ = ["ElasticOptions", "JobSpec"]


@dataclass
class JobSpec:
    """Everything needed to start the job's ranks."""

    command: list[str]
    slots: list[Slot]
    mode: str
    env: dict[str, str]
    ssh: SshOptions = field(default_factory=SshOptions)
    nics: list[str] = field(default_factory=list)
    start_timeout: int | None = None
    output_dir: str | None = None
    verbose: bool = False
    mpi_args: list[str] = field(default_factory=list)

    @property
    def hosts(self) -> list[Host]:
        """Hosts in rank order, each with the number of ranks it runs."""
        counts: dict[str, int] = {}
        for slot in self.slots:
            counts[slot.hostname] = counts.get(slot.hostname, 0) + 1
        return [Host(name, n) for name, n in counts.items()]


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic flags: how many workers, where from, and when to give up."""

    np: int  # workers to wait for before the first generation starts
    min_np: int
    max_np: int | None
    discover: Callable[[], dict[str, int]]  # runs the discovery script, or returns the fixed hosts
    timeout: float  # --elastic-timeout
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    wait_for_new_workers: bool = False  # --wait-for-new-workers: pause at the next commit for every new worker
