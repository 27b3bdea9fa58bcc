"""ResponseCache lookups, LRU eviction and what is (not) stored."""

from hvdplus.common.control.messages import Request, Response
from hvdplus.common.control.response_cache import Lookup, ResponseCache
from hvdplus.common.ops import OpKind


def req(name, kind=OpKind.ALLREDUCE, **kw):
    return Request(name=name, kind=kind, shape=(4,), **kw)


def resp(name, kind=OpKind.ALLREDUCE, error=None, requests=None, **kw):
    request = req(name, kind, **kw)
    return Response((0, name), kind, requests or (request, request), error=error, members=(0, 1))


def test_miss_when_not_cached():
    assert ResponseCache(4).lookup(0, req("a")) == (Lookup.MISS, -1)


def test_hit_after_put():
    cache = ResponseCache(4)
    assert cache.put(resp("a")) is None
    status, bit = cache.lookup(1, req("a"))
    assert status == Lookup.HIT and bit == 0
    assert cache.peek(bit).key == (0, "a")


def test_invalid_when_parameters_change():
    cache = ResponseCache(4)
    cache.put(resp("a"))
    assert cache.lookup(0, Request(name="a", kind=OpKind.ALLREDUCE, shape=(5,))) == (Lookup.INVALID, 0)


def test_a_rank_outside_the_set_finds_nothing():
    """The coordinator passes no position for a set it is not in (or one removed meanwhile)."""
    cache = ResponseCache(4)
    cache.put(resp("a"))
    assert cache.lookup(None, req("a")) == (Lookup.MISS, -1)


def test_bits_are_distinct_and_reuse_freed_bits():
    cache = ResponseCache(4)
    for name in "abc":
        cache.put(resp(name))
    assert cache.bits() == [0, 1, 2]
    cache.erase(1)
    assert cache.lookup(0, req("b")) == (Lookup.MISS, -1)
    cache.put(resp("d"))
    assert cache.lookup(0, req("d")) == (Lookup.HIT, 1)


def test_a_put_takes_the_lowest_free_bit_whatever_the_order_of_frees():
    """Every rank applies the same puts and erases, so choosing the lowest free bit gives every rank the same
    bits without sending them; a full cache keeps doing so as unnamed collectives churn through it."""
    cache = ResponseCache(64)
    for i in range(64):
        cache.put(resp(f"t{i}"))
    for bit in (40, 7, 63, 20):
        cache.erase(bit)
    taken = []
    for name in ("w", "x", "y", "z"):
        cache.put(resp(name))
        taken.append(cache.bit_of((0, name)))
    assert taken == [7, 20, 40, 63]
    for i in range(200):  # a full cache: each put evicts the least recently used and reuses its bit
        evicted = cache.put(resp(f"churn{i}"))
        assert evicted is not None and cache.bit_of((0, f"churn{i}")) == evicted
    assert len(cache) == 64 and sorted(cache.bits()) == list(range(64))


def test_lru_eviction_returns_evicted_bit():
    cache = ResponseCache(2)
    cache.put(resp("a"))
    cache.put(resp("b"))
    evicted = cache.put(resp("c"))
    assert evicted == 0
    assert len(cache) == 2
    assert cache.lookup(0, req("a"))[0] == Lookup.MISS
    assert cache.lookup(0, req("c")) == (Lookup.HIT, 0)


def test_get_refreshes_recency():
    cache = ResponseCache(2)
    cache.put(resp("a"))
    cache.put(resp("b"))
    assert cache.get(0).key == (0, "a")
    assert cache.put(resp("c")) == 1  # "b" is now least recently used
    assert cache.lookup(0, req("a"))[0] == Lookup.HIT


def test_peek_does_not_refresh_recency():
    cache = ResponseCache(2)
    cache.put(resp("a"))
    cache.put(resp("b"))
    order = cache.bits()
    assert cache.peek(0).key == (0, "a")
    assert cache.bits() == order
    assert cache.put(resp("c")) == 0


def test_errors_are_not_stored():
    cache = ResponseCache(4)
    assert cache.put(resp("a", error="boom")) is None
    assert len(cache) == 0


def test_uncacheable_kinds_are_not_stored():
    cache = ResponseCache(4)
    for kind in (OpKind.JOIN, OpKind.ADD_PROCESS_SET, OpKind.REMOVE_PROCESS_SET):
        cache.put(resp("x", kind))
    assert len(cache) == 0


def test_responses_with_joined_ranks_are_not_stored():
    cache = ResponseCache(4)
    cache.put(resp("a", requests=(req("a"), None)))
    assert len(cache) == 0


def test_zero_capacity_disables_cache():
    cache = ResponseCache(0)
    assert cache.put(resp("a")) is None
    assert len(cache) == 0


def test_putting_same_key_twice_keeps_one_entry():
    cache = ResponseCache(4)
    cache.put(resp("a"))
    cache.put(resp("a"))
    assert len(cache) == 1
