"""horovod.ray.strategy's `create_placement_group`: a ready Ray placement group, as Horovod's strategies make them
(Horovod's own tests build a group with it to run a RayExecutor inside)."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup

__all__ = ["create_placement_group"]


def create_placement_group(
    resources_per_bundle: dict[str, float], num_bundles: int, pg_timeout: float, pg_strategy: str
) -> tuple[PlacementGroup, list[dict[str, float]]]:
    """Horovod's signature: a placement group of `num_bundles` copies of `resources_per_bundle` (zero amounts left
    out, which Ray refuses) with strategy `pg_strategy` (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD), ready within
    `pg_timeout` seconds, and its bundles. TimeoutError, naming what is missing, removes the group."""
    bundle = {name: amount for name, amount in resources_per_bundle.items() if amount}
    bundles = [dict(bundle) for _ in range(num_bundles)]
    group: PlacementGroup = ray.util.placement_group(bundles, strategy=pg_strategy)
    ready, _ = ray.wait([group.ready()], timeout=pg_timeout)
    if not ready:
        ray.util.remove_placement_group(group)
        raise TimeoutError(
            f"hvdplus.ray: a {pg_strategy} placement group of {num_bundles} x {bundle} was not ready within "
            f"{pg_timeout:g} s; the cluster has {ray.available_resources()} available: add nodes (or use an "
            "autoscaling cluster), or ask for fewer workers or resources per worker"
        )
    return group, bundles
