"""Response cache: collectives agreed once are later agreed with one bit each per cycle.

All ranks apply the same puts, uses and erases in the same order, so bit positions agree
everywhere without being sent (Horovod's design).
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict

from hvdplus.common.control.messages import Key, Request, Response, SameRequest
from hvdplus.common.ops import OpKind

__all__ = ["ResponseCache", "Lookup", "CACHEABLE"]

CACHEABLE = frozenset(
    {OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.BROADCAST, OpKind.ALLTOALL, OpKind.REDUCESCATTER, OpKind.BARRIER}
)


class Lookup(enum.Enum):
    HIT = "hit"  # same collective as cached: announce it by its bit
    INVALID = "invalid"  # same name, different parameters: every rank must drop the entry
    MISS = "miss"  # not cached: announce it in full


class ResponseCache:
    """Least-recently-used map from (process set, name) to an agreed response and its bit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_bit: OrderedDict[int, Response] = OrderedDict()
        self._bit_of: dict[Key, int] = {}
        # The free bits as a min-heap: a put takes the lowest, the same on every rank, in O(log capacity) (a scan of
        # the used bits cost ~25 us a put in a full cache of 1024, which every unnamed collective fills anew).
        self._free = list(range(max(capacity, 0)))

    def __len__(self) -> int:
        return len(self._by_bit)

    def lookup(self, set_rank: int | None, request: Request) -> tuple[Lookup, int]:
        """Compare a request with what the rank at `set_rank` in its process set announced when the entry was
        cached (an index, not a search of the members: the cost is the same at any job size). None (not a
        member, or the set is gone) finds nothing."""
        bit = self._bit_of.get(request.key)
        if bit is None or set_rank is None:
            return Lookup.MISS, -1
        requests = self._by_bit[bit].requests
        # Every rank announced the same request (the usual case): read it without SameRequest's indexing call (and
        # its range check: `set_rank` is this rank's index in the set, in range by construction).
        cached = requests.request if type(requests) is SameRequest else requests[set_rank]
        return (Lookup.HIT if cached is request or cached == request else Lookup.INVALID), bit

    def bit_of(self, key: Key) -> int | None:
        """The bit of the cached response of `key`, if there is one."""
        return self._bit_of.get(key)

    def get(self, bit: int) -> Response:
        """The response of `bit`, marked as recently used."""
        self._by_bit.move_to_end(bit)
        return self._by_bit[bit]

    def peek(self, bit: int) -> Response:
        """The response of `bit`, without touching the recency order (which must stay equal on all ranks)."""
        return self._by_bit[bit]

    def bits(self) -> list[int]:
        return list(self._by_bit)

    def put(self, response: Response) -> int | None:
        """Remember a successful response; return the bit evicted to make room, if any."""
        if (
            self.capacity <= 0
            or response.error is not None
            or response.kind not in CACHEABLE
            or response.key in self._bit_of
            or None in response.requests
        ):
            return None
        evicted = None
        if len(self._by_bit) >= self.capacity:
            evicted = next(iter(self._by_bit))
            self.erase(evicted)
        bit = heapq.heappop(self._free)
        self._by_bit[bit] = response
        self._bit_of[response.key] = bit
        return evicted

    def erase(self, bit: int) -> None:
        response = self._by_bit.pop(bit, None)
        if response is not None:
            del self._bit_of[response.key]
            heapq.heappush(self._free, bit)
