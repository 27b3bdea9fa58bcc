"""Ranks for workers a cluster engine started (Spark tasks, Ray actors): Horovod's rank variables and the rendezvous.

A cluster engine only starts the workers; hvdplus gives each one its place from the hosts they run on (ranks on one
host contiguous, local ranks counted per host, as hvdplusrun's slots are) and the environment a Gloo rank needs to
reach the job's authenticated rendezvous. Stdlib only, like the rest of the launcher.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from hvdplus.runner.agent import thread_share
from hvdplus.runner.env import INHERITED_LAUNCH_VARIABLES
from hvdplus.runner.hosts import Host, Slot, assign_slots

__all__ = ["place_by_host", "rank_variables", "rank_env", "worker_environ", "deprecated_bounds"]


def place_by_host(hosts: Sequence[str]) -> list[Slot]:
    """The slot of each worker, given the host each one runs on (in the workers' order).

    Hosts are taken in the order of their first worker, and a host's workers in their own order, so worker 0 is
    rank 0, the ranks of one host are contiguous and share a local rank space (Horovod's grouping by host)."""
    if not hosts:
        raise ValueError("place_by_host needs at least one worker's host")
    order = list(dict.fromkeys(hosts))
    counts = {host: 0 for host in order}
    for host in hosts:
        counts[host] += 1
    slots = assign_slots([Host(host, counts[host]) for host in order], len(hosts))
    by_host = {host: [s for s in slots if s.hostname == host] for host in order}
    placed = []
    for host in hosts:
        placed.append(by_host[host].pop(0))
    return placed


def rank_variables(slot: Slot, address: str, port: int, secret: str) -> dict[str, str]:
    """Horovod's rank variables of `slot` and how to reach the rendezvous: what every Gloo rank reads at
    hvd.init(), whoever started it (hvdplusrun's agents, Spark tasks, Ray actors)."""
    return {
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_HOSTNAME": slot.hostname,
        "HVDPLUS_RENDEZVOUS_ADDR": address,
        "HVDPLUS_RENDEZVOUS_PORT": str(port),
        "HVDPLUS_SECRET_KEY": secret,
    }


def rank_env(slot: Slot, address: str, port: int, secret: str, nics: Sequence[str] | None = None) -> dict[str, str]:
    """The variables a Gloo rank a cluster engine starts reads at hvd.init(): `rank_variables`, on Gloo."""
    env = rank_variables(slot, address, port, secret)
    env["HVDPLUS_CPU_OPERATIONS"] = "gloo"  # Spark and Ray start the ranks: there is no mpirun
    if nics:
        env["GLOO_SOCKET_IFNAME"] = nics[0]
    return env


def worker_environ(base: Mapping[str, str], user: Mapping[str, str], launch: Mapping[str, str]) -> dict[str, str]:
    """A worker process's whole environment: `base` (the engine's process) without launch variables it may have
    inherited, then the user's `env=`, then the launch variables, which nothing overrides; and, unless one of these
    sets OMP_NUM_THREADS (Spark sets it to the executor's cores), the rank's share of this host's cores."""
    env = {k: v for k, v in base.items() if k not in INHERITED_LAUNCH_VARIABLES}
    env.update(user)
    env.update(launch)
    env.update(thread_share(env))
    return env


def deprecated_bounds(
    min_num_proc: int | None, max_num_proc: int | None, min_np: int | None, max_np: int | None
) -> tuple[int | None, int | None]:
    """(min_num_proc, max_num_proc), taking Horovod's deprecated `min_np`/`max_np` where given, with its warnings
    (attributed to the caller of the public function that took them)."""
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=3)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=3)
        max_num_proc = max_np
    return min_num_proc, max_num_proc
