"""What a control round agrees on: which collectives every member is ready to run, in one order on every rank.

A collective agreed once is cached; later it is announced by its bit in the response cache, and one bitwise AND of
every rank's words ([~flags, hit bits, ~hit bits, ~invalid bits(, autotune configuration)]) gives the flags any rank
raised, the bits every rank hit (ready), any rank hit, and any rank invalidated. Collectives not in the cache are
announced in full and matched in the message table (negotiation.py), whose stall inspector names missing ranks.
Every rank applies the same puts, uses and evictions in the same order, so the cache's bits agree without being
sent (Horovod's design). The round itself is one non-blocking bitwise AND (`exchange`); the coordinator executes
what it agrees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdplus.common.bitmask import bits, mask_of
from hvdplus.common.control.announcements import exchange_announcements
from hvdplus.common.control.frozen import FrozenPeerInspector
from hvdplus.common.control.in_flight import Names
from hvdplus.common.control.messages import Key, Request, Response
from hvdplus.common.control.negotiation import MessageTable, is_join, join_key
from hvdplus.common.control.response_cache import Lookup, ResponseCache
from hvdplus.common.control.stall import StallInspector
from hvdplus.common.data.executor import Submission
from hvdplus.common.engines.base import Engine
from hvdplus.common.ops import OpKind
from hvdplus.common.settings import Settings

__all__ = ["Agreement", "HAS_UNCACHED", "SHUTDOWN", "STALL_ABORT", "BUSY"]

HAS_UNCACHED, SHUTDOWN, STALL_ABORT, BUSY = 1, 2, 4, 8
# How long an entry waits for this rank before it tells the entry's rounds of the same name held on another set: a
# name that another set's rounds have just finished with is released a moment later, and a shadow sent in that
# moment would name two sets that do not wait on each other.
_SHADOW_AFTER_S = 0.25
_BUILT_WORDS = 64  # distinct round words kept built (a training loop sends a handful)


class Agreement:
    """The response cache, message table and stall inspector of the control rounds on one engine group, and the
    work announced in them that is not agreed yet."""

    def __init__(
        self,
        engine: Engine,
        group: Callable[[], Any],
        settings: Settings,
        members: Callable[[int], tuple[int, ...]],
        index_in: Callable[[int], int | None],
        set_id: int = 0,
        names: Names | None = None,
    ) -> None:
        """`group()`: the rounds' engine group, asked for at each use (holding it would keep a Gloo group's
        connections open after the engine's shutdown, and peers blocked on this rank would wait for its exit).
        `members(set_id)`: a process set's ranks; `index_in(set_id)`: this rank's place in it (None: not in it).
        `set_id`: whose rounds these are: the whole job's (0), or one process set's own. `names`: this rank's
        collectives in flight on every set's rounds (shadow_held)."""
        self._engine, self._group, self._settings = engine, group, settings
        self._members, self._index_in = members, index_in
        self.set_id = set_id
        self._table = MessageTable(join_key(set_id))
        self.stalls = StallInspector(index_in(set_id) or 0, settings, self._table, members)
        self._cache = ResponseCache(-(-settings.cache_capacity // 64) * 64)
        self._words = self._cache.capacity // 64
        self._full = (1 << self._cache.capacity) - 1
        self._hits: dict[int, Submission] = {}
        # Cache bits of responses on process sets this rank is not in: it raises them in the all-hit word every
        # round (it has nothing to announce there), or the members' cached collectives would never be ready.
        self._foreign = 0
        self._to_send: list[Submission] = []
        self._shadows: list[Request] = []  # to send: collectives this rank holds on other sets' rounds (shadow_held)
        self._shadowed: dict[Key, Request] = {}  # entries here this rank sent a shadow for: its request elsewhere
        self._names = Names() if names is None else names
        self._invalid: set[int] = set()
        # Words by (flags, masks, config), with their bytes (see `words`); the bytes and masks of the last ones sent.
        self._built: dict[tuple[int | None, ...], tuple[np.ndarray, bytes]] = {}
        self._sent: tuple[bytes, tuple[int, int, int]] = (b"", (0, 0, 0))
        # lone_words's words by cache bit, with what they send (one per cache bit at most).
        self._lone_built: dict[int, tuple[np.ndarray, tuple[bytes, tuple[int, int, int]]]] = {}

    def announce(self, work: Submission) -> None:
        """Announce `work` in the next round: by its cache bit if cached as it is, else in full."""
        status, bit = self._cache.lookup(self._index_in(work.request.process_set), work.request)
        if status == Lookup.HIT:
            self._hits[bit] = work
        else:
            if status == Lookup.INVALID:
                self._invalid.add(bit)
            self._to_send.append(work)

    def shadow_held(self) -> None:
        """Tell the next round of the collectives this rank holds on another process set's rounds under the name of
        an entry that waits for it here, once each, as shadows: then the message table can name the two sets that
        groups of ranks wait on each other with (MessageTable._deadlocks), although each set's rounds keep a
        table of their own. Also send the shadows other sets' rounds posted for these (`_pass_on`)."""
        self._shadows += self._names.take_posted(self.set_id)
        for key in self._table.missing_here(self._engine.rank, _SHADOW_AFTER_S):
            if key in self._shadowed or is_join(key) or self._index_in(key[0]) is None:
                continue
            request = self._names.undecided(key[1])
            if request is not None and request.process_set != key[0]:
                self._shadowed[key] = request
                self._shadows.append(request._replace(shadow=1 << self._engine.rank))

    def _pass_on(self, errors: list[Response]) -> None:
        """An entry that a shadow of this rank failed (two sets whose ranks wait on each other): its ranks' request
        goes, as a shadow, to the rounds of the set this rank holds the name on, where that entry waits for them, so
        that it fails too, even if they have already dropped the name (their entry failed first)."""
        for response in errors:
            held = self._shadowed.get(response.key)
            if held is not None:
                mask = mask_of(
                    rank for rank, request in zip(response.members, response.requests) if request is not None
                )
                self._names.post(held.process_set, response.first._replace(shadow=mask))

    def words(self, flags: int, joined: bool, config: int | None) -> np.ndarray:
        """This rank's words for the round: `flags` (plus HAS_UNCACHED and STALL_ABORT, which are this object's),
        its hit and invalid bits, and `config` (rank 0's autotune configuration, -1 elsewhere) if not None. A
        joined rank hits every cached allreduce of its sets (it contributes zeros) and invalidates the rest."""
        hits, invalid = mask_of(self._hits), mask_of(self._invalid)
        if joined:
            for bit in self._cache.bits():
                response = self._cache.peek(bit)
                if self._index_in(response.key[0]) is not None:
                    if response.kind == OpKind.ALLREDUCE:
                        hits |= 1 << bit
                    else:
                        invalid |= 1 << bit
        flags |= HAS_UNCACHED if self._to_send or self._shadows else 0
        flags |= STALL_ABORT if self.stalls.abort_due() else 0
        return self._build(flags, hits, invalid, config)

    @property
    def quiet(self) -> bool:
        """Whether this rank has nothing announced, pending or counted in these rounds, and raises no bit for process
        sets it is not in: then a round that announces one cached collective alone is decided by its own bit
        (`lone_words`, `lone_response`), as `responses` would decide it on every rank that sent the same words."""
        return not (
            self._foreign
            or self._hits
            or self._to_send
            or self._shadows
            or self._invalid
            or len(self._table)
            or self.stalls.counting
            or self._names.has_posted(self.set_id)
        )

    def cached_bit(self, request: Request) -> int:
        """The cache bit that announces `request` as it is (-1: announce it in full)."""
        status, bit = self._cache.lookup(self._index_in(request.process_set), request)
        return bit if status == Lookup.HIT else -1

    def lone_words(self, bit: int) -> np.ndarray:
        """This rank's words for a round that announces the cached collective of `bit` alone (the rounds are busy,
        and `quiet`: no flag of this object's own can be raised)."""
        built = self._lone_built.get(bit)
        if built is None:  # `quiet` raises no foreign bit: the words depend on the bit alone
            self._lone_built[bit] = built = (self._build(BUSY, 1 << bit, 0, None), self._sent)
        self._sent = built[1]
        return built[0]

    def lone_response(self, words: np.ndarray, bit: int) -> Response | None:
        """After a round of `lone_words`: the response of `bit`, if every rank sent the same words (it is then the
        one collective every rank is ready for, and no rank raised a flag or invalidated a bit); None: decide the
        round as any (`responses`), with the collective announced."""
        return self._cache.get(bit) if words.tobytes() == self._sent[0] else None

    def _build(self, flags: int, hits: int, invalid: int, config: int | None) -> np.ndarray:
        """The words that send `flags`, these hit and invalid bits and `config`, remembered as the ones sent."""
        masks = (hits | self._foreign, self._full ^ hits, self._full ^ invalid)
        # A training loop sends the same few words round after round: build each once (~4 us a round saved).
        key = (flags, *masks, config)
        built = self._built.get(key)
        if built is None:
            words = np.empty(1 + 3 * self._words + (config is not None), dtype=np.int64)
            words[0] = ~flags
            if config is not None:
                words[-1] = config
            words[1 : 1 + 3 * self._words] = np.frombuffer(b"".join(self._bytes(m) for m in masks), dtype=np.int64)
            words.flags.writeable = False
            if len(self._built) >= _BUILT_WORDS:
                self._built.clear()
            self._built[key] = built = (words, words.tobytes())
        self._sent = (built[1], masks)
        return built[0]

    def exchange(self, words: np.ndarray, spin_s: float, frozen: FrozenPeerInspector, round_number: int) -> np.ndarray:
        """Control round `round_number`: the AND of every rank's `words`. An engine whose waits poll spins for
        `spin_s` (while work is in flight the peers usually join within microseconds, and a sleep would add its
        length to every collective), then sleeps between tests. A wait is inspected for frozen peers every second
        (`frozen` raises once one has been silent too long)."""
        started = time.monotonic()
        try:
            result: np.ndarray = self._engine.start_bitwise_and(words, self._group(), spin_s).wait(
                lambda: frozen.waiting(round_number, time.monotonic() - started)
            )
        except Exception as exc:  # Gloo's own timeout (at the stall shutdown time) may end the wait first
            frozen.raise_if_stalled(round_number, time.monotonic() - started, exc)
            raise
        return result

    @staticmethod
    def flags(words: np.ndarray) -> int:
        """The flags any rank raised in the round whose AND is `words`."""
        return int(~words[0])

    @staticmethod
    def config(words: np.ndarray) -> int:
        """Rank 0's autotune configuration in the round whose AND is `words` (the others send -1, all bits set)."""
        return int(words[-1])

    def responses(self, words: np.ndarray) -> list[Response]:
        """After the round (the AND of every rank's words): the responses every rank runs now, in one order: the
        cached ones every member hit, then those that full negotiation (if any rank asked for it) agreed."""
        sent, masks = self._sent
        if words.tobytes() == sent:  # every rank sent the same words: nothing to decode
            all_hit, not_any_hit, not_any_invalid = masks
        else:
            n = self._words
            all_hit, not_any_hit, not_any_invalid = (
                int.from_bytes(words[1 + i * n : 1 + (i + 1) * n].tobytes(), "little") for i in range(3)
            )
        any_hit, any_invalid = self._full ^ not_any_hit, self._full ^ not_any_invalid
        self._invalid.clear()
        for bit in bits(any_invalid | self.stalls.stale_partials(all_hit, any_hit)):
            self._evict(bit)
        ready_bits = list(bits(all_hit & ~any_invalid))
        responses = [self._cache.get(bit) for bit in ready_bits]
        for bit in ready_bits:
            self._hits.pop(bit, None)
        if self.flags(words) & HAS_UNCACHED:
            responses += self._negotiate()
            for response in responses:
                self._remember(response)
        return responses

    def _remember(self, response: Response) -> None:
        """Cache a response full negotiation agreed (a cached one is there already: `put` keeps it as it is)."""
        evicted = self._cache.put(response)
        if evicted is not None:
            self._evict(evicted)
        cached_bit = self._cache.bit_of(response.key)
        if cached_bit is not None and self._index_in(response.key[0]) is None:
            self._foreign |= 1 << cached_bit

    def forget_work(self) -> None:
        """The job failed: drop the work announced and not agreed (its handles fail with the rest)."""
        self._hits.clear()
        self._to_send.clear()
        self._shadows.clear()

    def _bytes(self, mask: int) -> bytes:
        return mask.to_bytes(self._words * 8, "little")

    def _evict(self, bit: int) -> None:
        self._cache.erase(bit)
        self._foreign &= ~(1 << bit)
        self.stalls.forget(bit)
        work = self._hits.pop(bit, None)
        if work is not None:
            self._to_send.append(work)

    def _negotiate(self) -> list[Response]:
        """Full negotiation: every rank's uncached announcements, matched in the table; the errors it found, then
        the collectives every member has announced."""
        requests = [work.request for work in self._to_send] + self._shadows
        self._to_send.clear()
        self._shadows.clear()
        errors: list[Response] = []
        for request, ranks in exchange_announcements(
            self._engine,
            self._group(),
            requests,
            self._settings.negotiation_doubling_ranks,
            self._members(self.set_id),
        ):
            problem = self._table.add(request, ranks)
            if problem:
                members = self._members(request.process_set)
                errors.append(Response(request.key, request.kind, (request,), error=problem, members=members))
        decided = errors + self._table.take_ready(self._members)
        self._pass_on([response for response in decided if response.error])
        self._shadowed = {key: held for key, held in self._shadowed.items() if key in self._table}
        return decided
