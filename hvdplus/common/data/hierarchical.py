"""Hierarchical collectives: work within each host first, so the slow link between hosts carries less.

Allreduce: reduce-scatter within a host, allreduce of this rank's slice across hosts, allgather within the host.
Across hosts each rank moves 1/local_size of the buffer, so the link carries the data once per host instead of
once per rank pair a host-blind algorithm happens to route over it. The cross-host step is chosen, not left to
the library's default: ring, or recursive halving then doubling (Rabenseifner), both built from the engine's
point-to-point `sendrecv`, which keep both directions of the link busy at once (a library's reduce-then-broadcast
uses one direction at a time). A buffer of several chunks (HVDPLUS_HIERARCHICAL_CHUNK_BYTES) is pipelined: each
chunk's cross-host step runs on a thread of its own (cross_lane.py) while the next chunk is reduced within
the host and the previous one gathered, so the link is not idle during the local steps.

Allgather (Horovod's HOROVOD_HIERARCHICAL_ALLGATHER): gather within each host, exchange whole host blocks
between the local rank 0s, broadcast within each host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdplus.common.data import halfops
from hvdplus.common.data.cross_lane import CrossLane
from hvdplus.common.data.layout import balanced_counts
from hvdplus.common.data.mpi_tool import han_serves_allreduce
from hvdplus.common.engines.base import Engine
from hvdplus.common.engines.waited import Waited
from hvdplus.common.handles import Handle
from hvdplus.common.ops import ReduceOp
from hvdplus.common.topology import Topology

__all__ = [
    "HierarchicalGroups",
    "hierarchical_groups",
    "hierarchical_allreduce",
    "hierarchical_allgather",
    "cross_allreduce",
    "p2p_reducescatter",
    "p2p_allgather",
    "resolve_algorithm",
]

# Below this many bytes per rank the cross-host step is latency-bound: one library call beats log2(n) or
# 2(n-1) Python-driven exchanges.
_P2P_MIN_BYTES = 64 * 1024
# Engines whose own allreduce is the better cross-host step: Gloo's point-to-point measured slower than its
# allreduce over the shaped link (2 hosts x 2 ranks, 64 MB: 1299 ms composed against 971 ms; docs/performance.md).
_OWN_CROSS_STEP = ("gloo",)


def _no_mark(step: str) -> None:
    return None


@dataclass(frozen=True)
class HierarchicalGroups:
    """A process set's communicators for hierarchical collectives, and where this rank sits in them."""

    local: Any  # this rank's host
    cross: Any  # the ranks with this rank's local index, one per host (the local rank 0s: the host leaders)
    local_size: int
    local_rank: int
    cross_size: int  # hosts
    cross_rank: int  # this rank's host, in order of the hosts' lowest ranks
    host_members: tuple[tuple[int, ...], ...]  # per host: the set indices of its ranks, ascending
    contiguous: bool  # every host's ranks are consecutive in set order (hierarchical allgather needs it)
    lane: CrossLane  # where a pipelined allreduce runs its cross-host steps


def hierarchical_groups(
    engine: Engine, topology: Topology, ranks: Sequence[int]
) -> tuple[HierarchicalGroups | None, str]:
    """Collective over all ranks of the job: build the local and cross groups of the process set `ranks` (global
    ranks, ascending), or return None and why the layout cannot use them, or why the MPI library's own allreduce is
    hierarchical already (Open MPI's han, mpi_tool.py). Every rank creates every group in the same order, as the
    engines require."""
    ranks = tuple(ranks)
    hosts: dict[str, list[int]] = {}
    for rank in ranks:
        hosts.setdefault(topology.hostnames[rank], []).append(rank)
    sizes = sorted({len(members) for members in hosts.values()})
    if len(hosts) < 2:
        return None, "all its ranks are on one host"
    if len(sizes) > 1:
        return None, "its hosts run different numbers of ranks (" + ", ".join(
            f"{host}: {len(members)}" for host, members in hosts.items()
        ) + ")"
    if sizes[0] == 1:
        return None, "each host runs one rank of it, so there is nothing to do within a host"
    if engine.name == "mpi":
        said = engine.allgather_bytes(han_serves_allreduce().encode(), engine.world)  # every rank takes the same way
        if any(said):
            return None, next(s for s in said if s).decode()
    local = cross = None
    for members in hosts.values():
        group = engine.new_group(members)
        if engine.rank in members:
            local = group
    local_size = sizes[0]
    for index in range(local_size):
        peers = [members[index] for members in hosts.values()]
        group = engine.new_group(peers)
        if engine.rank in peers:
            cross = group
    if engine.rank not in ranks:
        return None, "this rank is not a member"
    host_members = tuple(tuple(ranks.index(r) for r in members) for members in hosts.values())
    contiguous = all(list(m) == list(range(m[0], m[0] + len(m))) for m in host_members)
    host, local_rank = next(
        (h, members.index(engine.rank)) for h, members in enumerate(hosts.values()) if engine.rank in members
    )
    lane = CrossLane(f"hvdplus-cross-{ranks[0]}-{len(ranks)}")
    return (
        HierarchicalGroups(local, cross, local_size, local_rank, len(hosts), host, host_members, contiguous, lane),
        "",
    )


def resolve_algorithm(algorithm: str, hosts: int, nbytes: int, engine: str = "mpi") -> str:
    """The cross-host algorithm that runs: 'auto' picks halving-doubling for a power-of-two number of hosts,
    ring otherwise, and the engine's own call for slices too small to gain from either and on engines whose
    point-to-point is slower than their allreduce."""
    if algorithm == "halving-doubling" and hosts & (hosts - 1):
        return "ring"
    if algorithm != "auto":
        return algorithm
    if nbytes < _P2P_MIN_BYTES or engine in _OWN_CROSS_STEP:
        return "engine"
    return "halving-doubling" if hosts & (hosts - 1) == 0 else "ring"


def hierarchical_allreduce(
    engine: Waited,
    groups: HierarchicalGroups,
    buffer: np.ndarray,
    dtype: str,
    op: ReduceOp,
    algorithm: str = "auto",
    mark: Callable[[str], None] = _no_mark,
    chunk_bytes: int = 0,
) -> str:
    """Reduce `buffer` in place over the whole set in three steps; the result equals a flat allreduce. Slices
    may differ by one element, so no padding copy is made. Returns the cross-host algorithm that ran, prefixed
    'pipelined-' when chunks were; `mark` is called as each step starts (the timeline's sub-steps). `chunk_bytes`:
    a buffer of at least two such chunks is pipelined (0: never)."""
    chunks = _chunks(buffer, chunk_bytes, groups.local_size)
    if len(chunks) > 1:
        return "pipelined-" + _pipelined_allreduce(engine, groups, chunks, dtype, op, algorithm, mark)
    counts, shard = _reduce_within_host(engine, groups, buffer, dtype, op, mark)
    mark("CROSS_ALLREDUCE")
    ran = cross_allreduce(engine, groups.cross, groups.cross_rank, groups.cross_size, shard, dtype, op, algorithm)
    mark("LOCAL_ALLGATHER")
    engine.allgather(None, buffer, counts, groups.local)
    return ran


def _reduce_within_host(
    engine: Waited,
    groups: HierarchicalGroups,
    buffer: np.ndarray,
    dtype: str,
    op: ReduceOp,
    mark: Callable[[str], None],
) -> tuple[list[int], np.ndarray]:
    """The first step: the host's ranks' slices of `buffer` (`counts`), and this rank's (`shard`), which now holds
    its host's sum."""
    counts = balanced_counts(buffer.size, groups.local_size)
    mark("LOCAL_REDUCESCATTER")
    local = resolve_algorithm("auto", groups.local_size, buffer.nbytes // groups.local_size)
    if local == "engine":
        engine.reducescatter(None, buffer, counts, dtype, op, groups.local)
    else:
        p2p_reducescatter(engine, groups.local, groups.local_rank, groups.local_size, buffer, counts, dtype, op, local)
    return counts, _pieces(buffer, counts)(groups.local_rank, groups.local_rank + 1)


def _chunks(buffer: np.ndarray, chunk_bytes: int, local_size: int) -> list[np.ndarray]:
    """`buffer` cut into runs of about `chunk_bytes` (none under half of it, none with fewer elements than the
    host has ranks), or `buffer` whole."""
    if chunk_bytes <= 0:
        return [buffer]
    pieces = min(buffer.nbytes // chunk_bytes, buffer.size // max(local_size, 1))
    if pieces < 2:
        return [buffer]
    piece = _pieces(buffer, balanced_counts(buffer.size, pieces))
    return [piece(i, i + 1) for i in range(pieces)]


def _pipelined_allreduce(
    engine: Waited,
    groups: HierarchicalGroups,
    chunks: Sequence[np.ndarray],
    dtype: str,
    op: ReduceOp,
    algorithm: str,
    mark: Callable[[str], None],
) -> str:
    """The three steps chunk by chunk, one cross-host step in flight on the set's lane: chunk k crosses the link
    while chunk k+1 is reduced within the host and chunk k-1 gathered. Every rank runs the same calls in the same
    order on each group. Returns the cross-host algorithm (that of the chunks, which are of one size give or take
    an element)."""
    # The lane's thread waits unwatched: the round's `alive` expects one caller (the round's thread, waiting below).
    lane = engine.unwatched()
    cross = functools.partial(cross_allreduce, lane, groups.cross, groups.cross_rank, groups.cross_size)
    in_flight: tuple[np.ndarray, list[int], Handle] | None = None
    for chunk in chunks:
        counts, shard = _reduce_within_host(engine, groups, chunk, dtype, op, mark)
        crossing = (chunk, counts, groups.lane.start(functools.partial(cross, shard, dtype, op, algorithm)))
        if in_flight is not None:
            _gather_when_crossed(engine, groups, *in_flight, mark)
        in_flight = crossing
    assert in_flight is not None
    return _gather_when_crossed(engine, groups, *in_flight, mark)


def _gather_when_crossed(
    engine: Waited,
    groups: HierarchicalGroups,
    chunk: np.ndarray,
    counts: list[int],
    crossing: Handle,
    mark: Callable[[str], None],
) -> str:
    """The last step of a chunk, once its cross-host step is done; returns the cross-host algorithm that ran."""
    mark("CROSS_ALLREDUCE_WAIT")
    ran: str = crossing.wait()
    mark("LOCAL_ALLGATHER")
    engine.allgather(None, chunk, counts, groups.local)
    return ran


def cross_allreduce(
    engine: Waited, group: Any, rank: int, size: int, buffer: np.ndarray, dtype: str, op: ReduceOp, algorithm: str
) -> str:
    """Allreduce `buffer` in place across `group` with the named algorithm; returns the one that ran."""
    algorithm = resolve_algorithm(algorithm, size, buffer.nbytes, engine.name)
    if algorithm == "engine" or size == 1 or buffer.size < size:
        engine.allreduce(buffer, dtype, op, group)
        return "engine"
    counts = balanced_counts(buffer.size, size)
    p2p_reducescatter(engine, group, rank, size, buffer, counts, dtype, op, algorithm)
    p2p_allgather(engine, group, rank, size, buffer, counts, algorithm)
    return algorithm


def _pieces(buffer: np.ndarray, counts: Sequence[int]) -> Callable[[int, int], np.ndarray]:
    """piece(lo, hi): the contiguous run of parts lo..hi-1 of `buffer` cut by `counts`."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    return lambda lo, hi: buffer[offsets[lo] : offsets[hi]]


def p2p_reducescatter(
    engine: Waited,
    group: Any,
    rank: int,
    size: int,
    buffer: np.ndarray,
    counts: Sequence[int],
    dtype: str,
    op: ReduceOp,
    algorithm: str,
) -> None:
    """Reduce-scatter in place from `sendrecv`: `buffer` holds this rank's whole input, and afterwards its part
    `rank` (counts[rank] elements at its offset) holds the reduction; the rest is left undefined. Ring: n-1
    steps; halving-doubling (n a power of two): log2(n) steps, halves exchanged with partner rank ^ distance.
    Each rank sends (n-1)/n of the buffer either way. Open MPI's own Reduce_scatter measured 7-9x slower than
    this for 64 MB on 2 ranks of one host (it reduces to a root, then scatters)."""
    piece = _pieces(buffer, counts)
    if algorithm == "ring":
        scratch = np.empty(max(counts), dtype=buffer.dtype)
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):  # the part received last is this rank's own
            send, into = (rank - step - 1) % size, (rank - step - 2) % size
            target = piece(into, into + 1)
            incoming = scratch[: target.size]
            engine.sendrecv(piece(send, send + 1), incoming, right, group, source=left)
            halfops.combine_into(dtype, op, incoming, target)
    elif algorithm == "halving-doubling":
        scratch = np.empty(max(sum(counts[: size // 2]), sum(counts[size // 2 :])), dtype=buffer.dtype)  # largest half
        lo, hi, distance = 0, size, size // 2
        while distance:
            partner, middle = rank ^ distance, lo + distance
            keep, give = ((lo, middle), (middle, hi)) if rank & distance == 0 else ((middle, hi), (lo, middle))
            target = piece(*keep)
            incoming = scratch[: target.size]
            engine.sendrecv(piece(*give), incoming, partner, group)
            halfops.combine_into(dtype, op, incoming, target)
            lo, hi = keep
            distance //= 2
    else:
        raise ValueError(f"unknown point-to-point algorithm {algorithm!r}")


def p2p_allgather(
    engine: Waited, group: Any, rank: int, size: int, buffer: np.ndarray, counts: Sequence[int], algorithm: str
) -> None:
    """Allgather in place from `sendrecv`: part `rank` of `buffer` is this rank's; afterwards every part is."""
    piece = _pieces(buffer, counts)
    if algorithm == "ring":
        right, left = (rank + 1) % size, (rank - 1) % size
        for step in range(size - 1):
            send, into = (rank - step) % size, (rank - step - 1) % size
            engine.sendrecv(piece(send, send + 1), piece(into, into + 1), right, group, source=left)
    elif algorithm == "halving-doubling":
        lo, hi, distance = rank, rank + 1, 1
        while distance < size:
            other = lo ^ distance
            engine.sendrecv(piece(lo, hi), piece(other, other + (hi - lo)), rank ^ distance, group)
            lo, hi = min(lo, other), max(hi, other + (hi - lo))
            distance *= 2
    else:
        raise ValueError(f"unknown point-to-point algorithm {algorithm!r}")


def hierarchical_allgather(
    engine: Waited,
    groups: HierarchicalGroups,
    send: np.ndarray | None,
    recv: np.ndarray,
    counts: Sequence[int],
    mark: Callable[[str], None] = _no_mark,
) -> None:
    """An allgather in three steps (needs `groups.contiguous`): gather within the host into the host's
    block of `recv`, exchange host blocks between the hosts' local rank 0s, broadcast `recv` within the host."""
    host_totals = [sum(counts[i] for i in members) for members in groups.host_members]
    start = sum(host_totals[: groups.cross_rank])
    block = recv[start : start + host_totals[groups.cross_rank]]
    mine = groups.host_members[groups.cross_rank]
    mark("LOCAL_ALLGATHER")
    engine.allgather(send, block, [counts[i] for i in mine], groups.local)
    if groups.local_rank == 0:
        mark("CROSS_ALLGATHER")
        engine.allgather(None, recv, host_totals, groups.cross)
    mark("LOCAL_BROADCAST")
    engine.broadcast(recv, 0, groups.local)
