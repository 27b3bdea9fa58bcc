"""The announcement exchange: every rank learns which ranks announced which new (uncached) requests.

Ranks that announce the same request share one entry: a request, the bit mask of the ranks that sent it, and
its order (the earliest position any rank gave it). Every rank ends with the same entries in the same order,
which is all the message table needs to reach the same decisions everywhere.

Two ways to exchange, with the same result:
* allgather: one round; each rank receives every rank's list, N·T requests on a job's first step. Best for
  small jobs, where one round trip beats several.
* recursive doubling of merged tables: log2(N) pairwise swaps, each carrying the table merged so far. Ranks
  that agree add no entries, so each swap is O(T) and a rank receives O(T log N) bytes, not O(N·T).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdplus.common.control.messages import Request
from hvdplus.common.data.pickled import pickled
from hvdplus.common.engines.base import Engine

__all__ = ["exchange_announcements"]

_Merged = dict[Request, tuple[int, int]]  # request -> (ranks mask, order)


def exchange_announcements(
    engine: Engine, group: Any, requests: Sequence[Request], doubling_from: int, ranks: Sequence[int] | None = None
) -> list[tuple[Request, int]]:
    """Every rank's new requests, merged: (request, mask of global ranks) in an order all ranks share. `ranks`:
    the global ranks of `group`, in its order (None: the whole job). Groups of `doubling_from` ranks or more use
    recursive doubling, smaller ones one allgather."""
    ranks = range(engine.size) if ranks is None else ranks
    index, size = ranks.index(engine.rank), len(ranks)
    if size >= doubling_from:
        merged = _recursive_doubling(engine, group, _own(requests, ranks[index], index, size), index, size)
    else:
        merged = {}
        for peer, data in enumerate(
            engine.allgather_bytes(pickle.dumps(list(requests), pickle.HIGHEST_PROTOCOL), group)
        ):
            _merge(merged, _own(pickle.loads(data), ranks[peer], peer, size))
    return [(request, mask) for request, (mask, _) in sorted(merged.items(), key=lambda item: item[1][1])]


def _own(requests: Sequence[Request], rank: int, index: int, size: int) -> _Merged:
    """One rank's list as entries, under global rank `rank`; order = position * size + index (its place in the
    group), so a merge keeps the earliest (position, index)."""
    return {request: (1 << rank, position * size + index) for position, request in enumerate(requests)}


def _merge(into: _Merged, other: _Merged) -> None:
    """Union of two tables (idempotent: merging a table twice changes nothing)."""
    for request, (mask, order) in other.items():
        current = into.get(request)
        into[request] = (mask, order) if current is None else (current[0] | mask, min(current[1], order))


def _recursive_doubling(engine: Engine, group: Any, merged: _Merged, rank: int, size: int) -> _Merged:
    """All ranks' tables merged. The ranks beyond the largest power of two p fold their tables into rank - p
    first and receive the result from it last; the p others swap with rank XOR 2^k for each k."""
    p = 1 << (size.bit_length() - 1)
    partner = rank - p if rank >= p else rank + p if rank + p < size else None
    if partner is not None:
        _merge(merged, _swap(engine, group, merged, partner))
    if rank < p:
        distance = 1
        while distance < p:
            _merge(merged, _swap(engine, group, merged, rank ^ distance))
            distance <<= 1
    if partner is not None:
        _merge(merged, _swap(engine, group, merged, partner))
    return merged


def _swap(engine: Engine, group: Any, merged: _Merged, peer: int) -> _Merged:
    """Send our table to `peer` and receive its own. Masks are sent once each: when ranks agree, every entry
    has the same mask, so an entry costs its request, not N bits."""
    masks: dict[int, int] = {}
    entries = [(request, masks.setdefault(mask, len(masks)), order) for request, (mask, order) in merged.items()]
    data = pickled((list(masks), entries))
    lengths = np.empty(1, dtype=np.int64)
    engine.start_sendrecv(np.array([data.size], dtype=np.int64), lengths, peer, group).wait()
    received = np.empty(int(lengths[0]), dtype=np.uint8)
    engine.start_sendrecv(data, received, peer, group).wait()
    mask_list, their_entries = pickle.loads(received.tobytes())
    return {request: (mask_list[index], order) for request, index, order in their_entries}
