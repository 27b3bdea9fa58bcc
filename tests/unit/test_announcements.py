"""The announcement exchange gives every rank the same merged list, by allgather and by recursive doubling,
and the coordinator negotiates correctly over it (ranks simulated as threads of this process)."""

import threading

import numpy as np
import pytest

from hvdplus.common.control.announcements import exchange_announcements
from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.engines.threads import ThreadWorld
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.ops import OpKind
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology

ALLGATHER, DOUBLING = 10**6, 1  # values of doubling_from: never, always


def run_ranks(size, body):
    """body(rank) on `size` threads; the results in rank order (an exception in any rank fails the test)."""
    results, errors = [None] * size, []

    def target(rank):
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def requests_of(rank, size):
    """Shared names in a rank-dependent order, one name only this rank has, and one rank 0 sends differently."""
    shared = [Request(name=f"t{i}", kind=OpKind.ALLREDUCE, shape=(4,)) for i in range(6)]
    order = shared[rank % 3 :] + shared[: rank % 3]
    return order + [
        Request(name=f"own{rank}", kind=OpKind.ALLREDUCE),
        Request(name="odd", kind=OpKind.ALLREDUCE, shape=(1,) if rank == 0 else (2,)),
    ]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 9])
def test_both_exchanges_give_every_rank_the_same_merged_list(size):
    everyone = (1 << size) - 1
    results = {}
    for doubling_from in (ALLGATHER, DOUBLING):
        world = ThreadWorld(size)
        results[doubling_from] = run_ranks(
            size,
            lambda rank: exchange_announcements(world.engines[rank], "world", requests_of(rank, size), doubling_from),
        )
    merged = results[ALLGATHER][0]
    for per_rank in results.values():
        assert all(result == merged for result in per_rank)
    masks = {request: mask for request, mask in merged}
    for i in range(6):
        assert masks[Request(name=f"t{i}", kind=OpKind.ALLREDUCE, shape=(4,))] == everyone
    for rank in range(size):
        assert masks[Request(name=f"own{rank}", kind=OpKind.ALLREDUCE)] == 1 << rank
    assert masks[Request(name="odd", kind=OpKind.ALLREDUCE, shape=(1,))] == 1
    if size > 1:
        assert masks[Request(name="odd", kind=OpKind.ALLREDUCE, shape=(2,))] == everyone ^ 1
    # the order is each request's earliest (position, rank): rank 0's list first at every position
    assert [request.name for request, _ in merged][:6] == [f"t{i}" for i in range(6)]


def test_doubling_receives_fewer_bytes_than_allgather_once_ranks_agree():
    size, names = 16, 200
    requests = [Request(name=f"gradient/{i}", kind=OpKind.ALLREDUCE, shape=(1024,)) for i in range(names)]
    received = {}
    for doubling_from in (ALLGATHER, DOUBLING):
        world = ThreadWorld(size)
        run_ranks(size, lambda rank: exchange_announcements(world.engines[rank], "world", requests, doubling_from))
        received[doubling_from] = max(engine.bytes_received for engine in world.engines)
    # allgather: 15 copies of the list; doubling: 4 swaps of one merged list (one mask for all entries)
    assert received[DOUBLING] < received[ALLGATHER] / 3


@pytest.mark.parametrize("size", [3, 5])
def test_coordinators_negotiate_over_recursive_doubling(size):
    """Real coordinators on simulated ranks: sums are right, a cached second step agrees, a mismatch errors
    on every rank naming the odd rank."""
    world = ThreadWorld(size)
    settings = Settings.from_env({}, negotiation_doubling_ranks=2)
    coordinators = [
        Coordinator(engine, settings, Topology.single_host(engine.rank, engine.size)) for engine in world.engines
    ]

    def body(rank):
        coordinator, sums = coordinators[rank], []
        for _ in range(2):
            handles = [
                coordinator.submit(
                    Request(name=f"g{i}", kind=OpKind.ALLREDUCE, shape=(3,)),
                    np.full(3, rank + i, np.float32),
                    np.empty(3, np.float32),
                )
                for i in range(4)
            ]
            sums.append([handle.wait(30).tolist() for handle in handles])
        shape = (2,) if rank == size - 1 else (3,)
        handle = coordinator.submit(
            Request(name="bad", kind=OpKind.ALLREDUCE, shape=shape),
            np.zeros(shape, np.float32),
            np.empty(shape, np.float32),
        )
        with pytest.raises(CollectiveMismatchError, match=f"rank {size - 1} has"):
            handle.wait(30)
        return sums

    try:
        results = run_ranks(size, body)
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
    total = sum(range(size))
    expected = [[float(total + size * i)] * 3 for i in range(4)]
    assert all(result == [expected, expected] for result in results)
