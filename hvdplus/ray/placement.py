"""Where a static job's actors go, as Horovod's strategies decide: `num_workers` packs one bundle per worker
(PACK), `num_hosts` x `num_workers_per_host` spreads one bundle per host (STRICT_SPREAD), and an enclosing
placement group (a Ray Tune trial's) is used as it is when `use_current_placement_group`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hvdplus.ray.strategy import create_placement_group
from hvdplus.ray.worker import BaseHorovodWorker

__all__ = ["Placement"]

log = logging.getLogger("hvdplus.ray")


@dataclass
class Placement:
    """The actors of one static job: how many, their resources, and the bundle each one takes."""

    num_workers: int | None
    num_hosts: int | None
    num_workers_per_host: int
    cpus_per_worker: float
    gpus_per_worker: float  # 0 without use_gpu
    use_current_placement_group: bool
    timeout_s: float
    group: PlacementGroup | None = None
    created: bool = False  # this placement made `group` (and removes it)
    spread: bool = False  # one bundle per host (num_hosts x num_workers_per_host)

    @property
    def size(self) -> int:
        return self.num_workers or (self.num_hosts or 0) * self.num_workers_per_host

    def reserve(self) -> None:
        """Find or create the placement group, as Horovod's strategies do."""
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            log.info("hvdplus.ray: using the current placement group (use_current_placement_group=False to not)")
            self.group = current
        elif self.num_workers:
            self.group, _ = create_placement_group(self._bundle(1), self.num_workers, self.timeout_s, "PACK")
            self.created = True
        else:
            assert self.num_hosts is not None
            bundle = self._bundle(self.num_workers_per_host)
            self.group, _ = create_placement_group(bundle, self.num_hosts, self.timeout_s, "STRICT_SPREAD")
            self.created = self.spread = True

    def start_actor(self, index: int) -> Any:
        """Start the actor of worker `index` in its bundle (any bundle of an enclosing group)."""
        if self.group is None:
            raise RuntimeError("hvdplus.ray: Placement.reserve() must run before actors start")
        if not self.created:
            bundle = -1
        else:
            bundle = index // self.num_workers_per_host if self.spread else index
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=False,
        )
        remote = ray.remote(BaseHorovodWorker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, scheduling_strategy=strategy
        )
        return remote.remote(world_rank=index, world_size=self.size)

    def release(self) -> None:
        """Remove the placement group if this placement created it."""
        if self.created and self.group is not None:
            ray.util.remove_placement_group(self.group)
        self.group, self.created = None, False

    def _bundle(self, workers: int) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker * workers, "GPU": self.gpus_per_worker * workers}
        return {name: amount for name, amount in bundle.items() if amount}
