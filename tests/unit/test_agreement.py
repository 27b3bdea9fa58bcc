"""What a control round agrees on (common/control/agreement.py), with ranks simulated as threads of this process: a
collective is negotiated in full once and then agreed by its cache bit alone; a changed one is dropped from the
cache on every rank and compared again; a joined rank hits the cached allreduces of its sets; a rank outside a set
raises the bits of that set's collectives."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hvdplus.common.control.agreement import BUSY, HAS_UNCACHED, Agreement
from hvdplus.common.control.messages import Request
from hvdplus.common.data.executor import Submission
from hvdplus.common.engines.threads import ThreadWorld
from hvdplus.common.handles import Handle
from hvdplus.common.ops import OpKind
from hvdplus.common.settings import Settings

SETS = {0: (0, 1), 1: (0,)}  # set 1: rank 0 alone, so rank 1 is outside it


class Counting:
    """A rank's engine that counts the exchanges of full announcements (negotiation)."""

    def __init__(self, engine: Any) -> None:
        self._engine, self.exchanges = engine, 0

    def allgather_bytes(self, data: bytes, group: Any) -> list[bytes]:
        self.exchanges += 1
        result: list[bytes] = self._engine.allgather_bytes(data, group)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def ranks() -> tuple[list[Counting], list[Agreement]]:
    world = ThreadWorld(2)
    engines = [Counting(engine) for engine in world.engines]
    agreements = [
        Agreement(
            engine,  # type: ignore[arg-type]
            lambda: "world",
            Settings(),
            lambda set_id: SETS[set_id],
            lambda set_id, rank=rank: SETS[set_id].index(rank) if rank in SETS[set_id] else None,  # type: ignore[misc]
        )
        for rank, engine in enumerate(engines)
    ]
    return engines, agreements


def announce(agreement: Agreement, request: Request) -> Submission:
    work = Submission(request, Handle(request.name))
    agreement.announce(work)
    return work


def round_of(agreements: list[Agreement], joined: tuple[bool, bool] = (False, False)) -> tuple[int, list[list[Any]]]:
    """One control round: every rank's words ANDed, then every rank's responses (on threads: negotiation is a
    collective); the flags and each rank's responses."""
    words = [agreement.words(0, joined[rank], None) for rank, agreement in enumerate(agreements)]
    combined = np.bitwise_and.reduce(np.stack(words))
    results: list[list[Any]] = [[], []]
    threads = [
        threading.Thread(target=lambda r=rank: results[r].extend(agreements[r].responses(combined))) for rank in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    return Agreement.flags(combined), results


def test_a_collective_is_negotiated_once_then_agreed_by_its_bit_alone():
    engines, agreements = ranks()
    request = Request("grad", OpKind.ALLREDUCE, shape=(4,))
    for agreement in agreements:
        announce(agreement, request)
    flags, responses = round_of(agreements)
    assert flags & HAS_UNCACHED
    assert [[r.key for r in rank] for rank in responses] == [[(0, "grad")]] * 2
    assert [engine.exchanges for engine in engines] == [1, 1]
    for _ in range(3):
        for agreement in agreements:
            announce(agreement, request)
        flags, responses = round_of(agreements)
        assert not flags & HAS_UNCACHED
        assert [[r.key for r in rank] for rank in responses] == [[(0, "grad")]] * 2
    assert [engine.exchanges for engine in engines] == [1, 1]  # three steps, no negotiation


def test_a_collective_only_one_rank_announced_waits_for_the_other():
    _, agreements = ranks()
    request = Request("grad", OpKind.ALLREDUCE, shape=(4,))
    for agreement in agreements:
        announce(agreement, request)
    round_of(agreements)
    announce(agreements[0], request)
    assert round_of(agreements)[1] == [[], []]  # rank 1 has not announced it yet: nothing is ready
    announce(agreements[1], request)
    assert [[r.key for r in rank] for rank in round_of(agreements)[1]] == [[(0, "grad")]] * 2


def test_a_changed_collective_leaves_the_cache_on_every_rank_and_is_compared_again():
    engines, agreements = ranks()
    for agreement in agreements:
        announce(agreement, Request("grad", OpKind.ALLREDUCE, shape=(4,)))
    round_of(agreements)
    announce(agreements[0], Request("grad", OpKind.ALLREDUCE, shape=(4,)))  # a hit on rank 0
    announce(agreements[1], Request("grad", OpKind.ALLREDUCE, shape=(5,)))  # invalid on rank 1
    flags, responses = round_of(agreements)
    # The round drops the bit everywhere, and rank 1's full announcement makes it a negotiating round, in which
    # rank 0's evicted hit is announced in full too: both ranks reach the same verdict at once.
    assert flags & HAS_UNCACHED and [len(rank) for rank in responses] == [1, 1]
    errors = [rank[0].error for rank in responses]
    assert errors[0] == errors[1] and "Mismatched shapes" in errors[0] and "rank 1 has (5,)" in errors[0], errors
    assert [engine.exchanges for engine in engines] == [2, 2]


def test_a_joined_rank_hits_the_cached_allreduces_of_its_sets_and_invalidates_the_rest():
    engines, agreements = ranks()
    for agreement in agreements:
        announce(agreement, Request("grad", OpKind.ALLREDUCE, shape=(4,)))
        announce(agreement, Request("gather", OpKind.ALLGATHER, shape=(4,)))
    round_of(agreements)
    announce(agreements[0], Request("grad", OpKind.ALLREDUCE, shape=(4,)))
    _, responses = round_of(agreements, joined=(False, True))  # rank 1 joined: it announces nothing itself
    assert [[r.key for r in rank] for rank in responses] == [[(0, "grad")]] * 2
    # The allgather left the cache on both ranks (it cannot run with a joined rank): announced again, it is
    # negotiated in full, while the allreduce is still agreed by its bit.
    exchanged = [engine.exchanges for engine in engines]
    for agreement in agreements:
        announce(agreement, Request("gather", OpKind.ALLGATHER, shape=(4,)))
    flags, responses = round_of(agreements)
    assert flags & HAS_UNCACHED and [engine.exchanges for engine in engines] == [n + 1 for n in exchanged]
    assert [[r.key for r in rank] for rank in responses] == [[(0, "gather")]] * 2
    for agreement in agreements:
        announce(agreement, Request("grad", OpKind.ALLREDUCE, shape=(4,)))
    flags, responses = round_of(agreements)
    assert not flags & HAS_UNCACHED and [[r.key for r in rank] for rank in responses] == [[(0, "grad")]] * 2


def test_a_rank_outside_a_set_lets_the_members_cached_collectives_run():
    engines, agreements = ranks()
    alone = Request("solo", OpKind.ALLREDUCE, process_set=1, shape=(2,))
    announce(agreements[0], alone)
    _, responses = round_of(agreements)
    assert [[r.key for r in rank] for rank in responses] == [[(1, "solo")]] * 2
    for _ in range(2):
        announce(agreements[0], alone)  # rank 1 announces nothing: it raises the bit for the set it is not in
        flags, responses = round_of(agreements)
        assert not flags & HAS_UNCACHED
        assert [[r.key for r in rank] for rank in responses] == [[(1, "solo")]] * 2
    assert [engine.exchanges for engine in engines] == [1, 1]


def _two_rank_agreements_with(request: Request) -> list[Agreement]:
    """Two ranks (both in every set used here) that negotiated `request` once, so it is cached."""
    agreements = ranks()[1]
    for agreement in agreements:
        announce(agreement, request)
    round_of(agreements)
    return agreements


def test_a_lone_round_decides_its_collective_as_a_full_round_would():
    """Rank 0 in the lone lane (its cache bit alone), rank 1 in a full cycle with the same collective announced:
    they sent the same words, so rank 0's lone decision is the response rank 1's full decoding finds; then both
    go on agreeing by the bit alone."""
    request = Request("grad", OpKind.ALLREDUCE, shape=(4,))
    agreements = _two_rank_agreements_with(request)
    lane, full = agreements
    assert lane.quiet
    bit = lane.cached_bit(request)
    assert bit >= 0 and bit == full.cached_bit(request)
    announce(full, request)
    words = [lane.lone_words(bit), full.words(BUSY, False, None)]
    assert words[0].tobytes() == words[1].tobytes()
    combined = np.bitwise_and.reduce(np.stack(words))
    decided = lane.lone_response(combined, bit)
    assert decided is not None and decided.key == (0, "grad")
    assert [r.key for r in full.responses(combined)] == [(0, "grad")]
    assert Agreement.flags(combined) == BUSY and lane.quiet and full.quiet
    for agreement in agreements:
        announce(agreement, request)
    assert [[r.key for r in rank] for rank in round_of(agreements)[1]] == [[(0, "grad")]] * 2


def test_a_lone_round_a_peer_sent_other_words_in_goes_on_as_a_full_round():
    """Rank 1's round came without the collective: rank 0's lone round decides nothing alone; announced by its
    bit, it waits in a full decoding as any, and runs once rank 1 announces it too."""
    request = Request("grad", OpKind.ALLREDUCE, shape=(4,))
    lane, full = _two_rank_agreements_with(request)
    bit = lane.cached_bit(request)
    combined = np.bitwise_and.reduce(np.stack([lane.lone_words(bit), full.words(0, False, None)]))
    assert lane.lone_response(combined, bit) is None
    announce(lane, request)
    assert lane.responses(combined) == [] and full.responses(combined) == []
    assert not lane.quiet  # the collective is announced and the partial hit is counted
    announce(full, request)
    assert [[r.key for r in rank] for rank in round_of([lane, full])[1]] == [[(0, "grad")]] * 2


def test_the_lone_lane_needs_a_quiet_agreement_and_a_cached_request():
    """Anything announced, or a changed request (not a hit), closes the lane; an uncached one has no bit."""
    request = Request("grad", OpKind.ALLREDUCE, shape=(4,))
    lane, _ = _two_rank_agreements_with(request)
    assert lane.cached_bit(Request("grad", OpKind.ALLREDUCE, shape=(5,))) == -1
    assert lane.cached_bit(Request("other", OpKind.ALLREDUCE, shape=(4,))) == -1
    announce(lane, Request("other", OpKind.ALLREDUCE, shape=(4,)))
    assert not lane.quiet
