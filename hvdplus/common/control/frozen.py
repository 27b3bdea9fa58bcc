"""Frozen, hung or failed ranks: a peer that stops answering the control rounds is named, warned about, and, after
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, fails every live rank; a peer whose runtime failed says so (the engine's
`announce_failure`), and every rank waiting for it fails at its next inspection, naming that peer's error.

The control round is a collective, so while one rank is frozen (SIGSTOP, a hung driver call, a dead NFS mount)
the others wait in it and learn nothing from it. So a rank that has waited HOROVOD_STALL_CHECK_TIME_SECONDS
sends a beacon to every other rank of the rounds (the engine's `send_beacon`, point to point, never blocking; a
process set's rounds use a stream of beacons of their own, to their members), and the ranks that have not sent one
for this round after a grace second are the silent ones. The lowest live rank logs the
warning; at the shutdown time every live rank raises, naming them.
"""

from __future__ import annotations

import logging
import time

from hvdplus.common.engines.base import Engine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.settings import Settings

__all__ = ["FrozenPeerInspector", "peer_failure", "failure_of", "ranks_that_shut_down"]

log = logging.getLogger("hvdplus")

_GRACE_S = 1.0  # how long after its own beacon a rank waits for the others' before naming the silent ones
_NOTICE_POLL_S = 0.05


class FrozenPeerInspector:
    """Watches one rank's waits for the control rounds of one set of ranks (the whole job, or a process set's own
    rounds: `stream`, its id), or for the collectives of a frozen step plan (a stream of its own, `what` "a planned
    step": common/planned_steps.py); `waiting` raises once a peer has been silent too long."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        stream: int = 0,
        ranks: tuple[int, ...] | None = None,
        what: str = "a control round",
        hint: str = "it may be frozen or hung (every collective waits for it)",
    ) -> None:
        """`ranks`: the global ranks of the rounds (None: every rank). `what`: what a silent peer did not answer;
        `hint`: what the warning says it may mean."""
        self._engine, self._settings, self._stream, self._what, self._hint = engine, settings, stream, what, hint
        self._ranks = tuple(range(engine.size)) if ranks is None else ranks
        self._beaconed_round = -1
        self._warned_round = -1

    def waiting(self, round_number: int, waited_s: float) -> None:
        """Called while this rank has waited `waited_s` for control round `round_number`."""
        failed = peer_failure(self._engine)
        if failed is not None:
            raise failed
        if self._settings.stall_check_disable and self._settings.stall_shutdown_time_seconds <= 0:
            return
        check = self._settings.stall_check_time_seconds
        shutdown = self._settings.stall_shutdown_time_seconds
        first_limit = min(check, shutdown) if shutdown > 0 else check
        if waited_s < first_limit:
            return
        if self._beaconed_round != round_number:
            self._engine.send_beacon(round_number, self._stream, self._ranks)
            self._beaconed_round = round_number
            return  # the peers' beacons need a moment
        silent = self._silent(round_number)
        if shutdown > 0 and waited_s >= shutdown:
            raise self._verdict(silent, waited_s)
        if (
            not self._settings.stall_check_disable
            and waited_s >= check + _GRACE_S
            and self._warned_round != round_number
            and self._engine.rank == self._lowest_live(silent)
        ):
            self._warned_round = round_number
            log.warning(
                "%s %s not answered %s for %.0f s: %s%s",
                _names(silent),
                "have" if len(silent) > 1 else "has",
                self._what,
                waited_s,
                self._hint,
                f"; the job fails after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={shutdown:g}" if shutdown > 0 else "",
            )

    def stalled(self, round_number: int, waited_s: float) -> HorovodInternalError | None:
        """After an engine ended the wait for round `round_number` with an error of its own (Gloo's timeout, at the
        shutdown time; a peer's broken connection): the error that names the peers that did not answer it, if
        this rank has asked them (its beacon) and some stayed silent, unless a peer announced a failure of its own
        (that failure is the cause); else None."""
        if self._beaconed_round != round_number:
            return None
        silent = self._silent(round_number)
        return self._verdict(silent, waited_s) if silent and peer_failure(self._engine) is None else None

    def raise_if_stalled(self, round_number: int, waited_s: float, cause: BaseException) -> None:
        """An engine error `cause` ended this rank's wait for round `round_number` (Gloo's timeout, which is the
        stall shutdown time on the rounds' groups too): raise the verdict that names the silent peers instead, if
        there is one (`stalled`). Returns otherwise (the caller re-raises), and for hvdplus's own errors (the
        verdict `waiting` raised, a peer's failure), which say it already."""
        if isinstance(cause, HorovodInternalError):
            return
        stalled = self.stalled(round_number, waited_s)
        if stalled is None:
            return
        try:
            raise stalled from cause
        finally:  # a local holding the error (whose traceback holds this frame) would keep the engine's work in
            del stalled  # the caller's frames alive: a reference cycle until the next collection

    def _verdict(self, silent: list[int], waited_s: float) -> HorovodInternalError:
        shutdown = self._settings.stall_shutdown_time_seconds
        return HorovodInternalError(
            f"{_names(silent)} did not answer {self._what} for {waited_s:.0f} s (frozen or hung; "
            f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={shutdown:g}); the collective cannot complete"
        )

    def _silent(self, round_number: int) -> list[int]:
        heard = self._engine.beacons(self._stream, self._ranks)
        return [peer for peer in self._ranks if peer != self._engine.rank and heard.get(peer, -1) < round_number]

    def _lowest_live(self, silent: list[int]) -> int:
        return min(set(self._ranks) - set(silent))


def peer_failure(engine: Engine) -> HorovodInternalError | None:
    """The error that names the peers whose runtime failed (announced with `announce_failure`), if any."""
    try:
        failed = engine.failures()
    except Exception as exc:  # the transport is gone too: nothing more to learn from it
        log.debug("could not read the peers' failure notices: %s", exc)
        return None
    if not failed:
        return None
    lines = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failed.items()))
    return HorovodInternalError(f"{_names(sorted(failed))} failed, so the collective cannot complete ({lines})")


def _awaited_peer_failure(engine: Engine, wait_s: float) -> HorovodInternalError | None:
    """peer_failure, waiting up to `wait_s` seconds for a notice: an elastic job's launcher names a worker that died
    a tenth of a second after its exit, often after its peers' transport already failed."""
    deadline = time.monotonic() + wait_s
    while True:
        found = peer_failure(engine)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(_NOTICE_POLL_S)


def failure_of(engine: Engine, exc: BaseException, notice_wait_s: float = 0.0) -> HorovodInternalError:
    """The error every pending and later call on this rank raises after `exc` ended its cycles. A failure of this
    rank's own is announced to the peers, so that they name it instead of hanging or reporting only its
    consequence; one that follows a peer's failure names that peer (a notice may take `notice_wait_s` to come)."""
    named = isinstance(exc, HorovodInternalError)  # hvdplus's own verdict: a failed, frozen or stalled peer
    caused_by = _awaited_peer_failure(engine, 0.0 if named else notice_wait_s)
    if caused_by is not None:
        return caused_by if named else HorovodInternalError(f"{caused_by} (here: {type(exc).__name__}: {exc})")
    if isinstance(exc, HorovodInternalError):  # `named`, in a form that narrows exc's type
        return exc
    error = HorovodInternalError(f"collective failed on rank {engine.rank}: {type(exc).__name__}: {exc}")
    try:
        engine.announce_failure(str(error))
    except Exception as notice_failed:  # best effort: the transport may be what failed
        log.debug("could not announce this rank's failure: %s", notice_failed)
    return error


def ranks_that_shut_down(engine: Engine, asked: bool) -> str:
    """'rank 1' (or 'ranks [0, 2]'): who asked to shut down (`asked`: whether this rank did), so that a peer's
    error names the rank that failed first rather than only its consequence. Collective over the world: every
    rank calls it in the round that carried the request."""
    try:
        flags = engine.allgather_bytes(b"1" if asked else b"", engine.world)
    except Exception as exc:  # a peer is already gone: say what we know
        log.debug("could not learn which ranks shut down: %s", exc)
        return "one or more ranks"
    ranks = [rank for rank, flag in enumerate(flags) if flag]  # never empty: a rank's request raised the flag
    return _names(ranks) + (" (this rank)" if ranks == [engine.rank] else "")


def _names(ranks: list[int]) -> str:
    if not ranks:
        return "a rank (every rank sent a beacon, yet the round is incomplete)"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
