"""Hierarchical allreduce: reduce-scatter within a host, allreduce across hosts, allgather within a host.

Across hosts each rank moves 1/local_size of the buffer, so the slow inter-node link carries
the data once per host instead of once per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdplus.common.engines.base import Engine
from hvdplus.common.ops import ReduceOp
from hvdplus.common.topology import Topology

__all__ = ["HierarchicalGroups", "hierarchical_groups", "hierarchical_allreduce"]


@dataclass(frozen=True)
class HierarchicalGroups:
    """The two communicators a hierarchical allreduce needs."""

    local: Any
    cross: Any
    local_size: int


def hierarchical_groups(engine: Engine, topology: Topology) -> HierarchicalGroups | None:
    """Collective over all ranks: build local and cross groups, or None when the layout cannot use them.

    Every rank creates every group in the same order, as the engines require."""
    if not topology.is_homogeneous or topology.local_size == 1 or len(topology.hosts) == 1:
        return None
    local = cross = None
    for host in topology.hosts:
        group = engine.new_group(topology.local_ranks_of(host))
        if host == topology.hostnames[topology.rank]:
            local = group
    for local_rank in range(topology.local_size):
        peers = tuple(topology.local_ranks_of(h)[local_rank] for h in topology.hosts)
        group = engine.new_group(peers)
        if topology.rank in peers:
            cross = group
    return HierarchicalGroups(local, cross, topology.local_size)


def hierarchical_allreduce(engine: Engine, groups: HierarchicalGroups, buffer: np.ndarray, dtype: str,
                           op: ReduceOp) -> None:
    """Reduce `buffer` in place over the whole job in three steps (result equals a flat allreduce)."""
    chunk = -(-buffer.size // groups.local_size)
    if chunk * groups.local_size == buffer.size:
        padded = buffer
    else:
        padded = np.zeros(chunk * groups.local_size, dtype=buffer.dtype)
        padded[:buffer.size] = buffer
    shard = np.empty(chunk, dtype=buffer.dtype)
    counts = [chunk] * groups.local_size
    engine.reducescatter(padded, shard, counts, dtype, op, groups.local)
    engine.allreduce(shard, dtype, op, groups.cross)
    engine.allgather(shard, padded, counts, groups.local)
    if padded is not buffer:
        buffer[...] = padded[:buffer.size]
