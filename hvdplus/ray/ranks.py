"""Ranks of a Ray job: contiguous per Ray node, as hvdplusrun fills hosts (runner/cluster_env.py), and the GPUs
each rank sees.

Ray's test clusters run several raylets on one machine, so a node is named by its IP and its Ray node id
(`host_name`): hvdplus then sees distinct hosts, as it would on distinct machines."""

from __future__ import annotations

from dataclasses import dataclass

from hvdplus.runner.cluster_env import place_by_host
from hvdplus.runner.hosts import Slot

__all__ = ["WorkerNode", "host_name", "place_ranks", "cuda_visible_devices"]


@dataclass(frozen=True)
class WorkerNode:
    """Where one actor runs: its Ray node's id and IP, and the GPU ids Ray gave it."""

    node_id: str
    ip: str
    gpu_ids: tuple[str, ...] = ()

    @property
    def host(self) -> str:
        return host_name(self.ip, self.node_id)


def host_name(ip: str, node_id: str) -> str:
    """The host name hvdplus gives a Ray node (HOROVOD_HOSTNAME): unique per node, even on one machine."""
    return f"{ip}-{node_id[:8]}"


def place_ranks(nodes: list[WorkerNode]) -> list[Slot]:
    """Each actor's slot (`nodes[i]`: where actor i runs): nodes in order of their first actor, ranks contiguous
    per node, local ranks in actor order; local and cross ranks as Horovod computes them."""
    return place_by_host([node.host for node in nodes])


def cuda_visible_devices(nodes: list[WorkerNode], slots: list[Slot]) -> dict[int, str]:
    """CUDA_VISIBLE_DEVICES per actor, as Horovod sets it: every GPU Ray gave the actors of a node, in local rank
    order, so that local rank i drives device i and CUDA sees its neighbours (peer-to-peer copies)."""
    on_host: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
    for node, slot in zip(nodes, slots):
        on_host.setdefault(slot.hostname, []).append((slot.local_rank, node.gpu_ids))
    visible = {host: ",".join(g for _, ids in sorted(entries) for g in ids) for host, entries in on_host.items()}
    return {index: visible[slot.hostname] for index, slot in enumerate(slots) if visible[slot.hostname]}
