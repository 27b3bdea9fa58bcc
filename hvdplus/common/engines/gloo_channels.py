"""Gloo's point-to-point pieces of the torch.distributed engine: the doorbell on a group of its own, the channel
and its transfers, and a collective in flight (the control round's bitwise AND), whose wait calls `alive`
(torch_collectives.py `wait_work`). Gloo reports their completion only through a blocking wait, so each waits on
a thread that may sleep."""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdplus.common.engines.base import bell_targets
from hvdplus.common.engines.torch_collectives import TensorTransfer, wait_work

__all__ = ["GlooChannel", "GlooDoorbell", "GlooRound"]

log = logging.getLogger("hvdplus")


class GlooDoorbell:
    """Rings travel on a Gloo group of their own. Gloo's point-to-point works report completion only through a
    wait, and a wait that times out breaks the group, so a thread sleeps in an any-source receive (the group's
    timeout is a year: an idle job may stay idle) and wakes the coordinator; another thread sends."""

    polled = False

    _TAG = 0
    NEVER = datetime.timedelta(days=365)

    def __init__(self, dist: Any, torch: Any, members: list[int], group: Any, on_ring: Callable[[], None]) -> None:
        """`members`: the doorbell's global ranks, this rank among them; `group`: their Gloo group."""
        self._dist, self._torch, self._members, self._group = dist, torch, members, group
        self._index = members.index(dist.get_rank())
        self._on_ring = on_ring
        self._heard = -1
        self._outbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=target, name=f"hvdplus-doorbell-{role}", daemon=True)
            for role, target in (("receive", self._receive), ("send", self._send))
        ]
        for thread in self._threads:
            thread.start()

    def ring(self, round_number: int) -> None:
        self._outbox.put(round_number)

    def rung(self, round_number: int) -> bool:
        return self._heard >= round_number

    def close(self) -> None:
        """Stop the sender once its rings are out, and destroy the group. The receiver stays in its receive
        (Gloo cannot cancel one, and destroying the group does not end it): a daemon, it ends with the process."""
        self._outbox.put(None)
        self._threads[1].join(1.0)
        if self._dist.is_initialized():
            self._dist.destroy_process_group(self._group)

    def _receive(self) -> None:
        buf = self._torch.zeros(1, dtype=self._torch.int64)
        try:
            while True:
                self._dist.irecv(buf, src=None, group=self._group, tag=self._TAG).wait()
                self._heard = max(self._heard, int(buf[0]))
                self._on_ring()
        except Exception as exc:  # the group was destroyed at shutdown, or a peer is gone
            log.debug("doorbell receiver stopped: %s", exc)

    def _send(self) -> None:
        try:
            while (round_number := self._outbox.get()) is not None:
                bell = self._torch.tensor([round_number])
                for work in [
                    self._dist.isend(bell, dst=self._members[peer], group=self._group, tag=self._TAG)
                    for peer in bell_targets(self._index, len(self._members))
                ]:
                    work.wait()
        except Exception as exc:  # as above
            log.debug("doorbell sender stopped: %s", exc)


class GlooChannel:
    """Point to point on a Gloo group of all ranks of its own; buffers travel as bytes, moved by Gloo's threads."""

    max_tag = 2**31 - 1

    def __init__(self, dist: Any, torch: Any, group: Any) -> None:
        self._dist, self._torch, self._group = dist, torch, group

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> TensorTransfer:
        tensor = self._torch.from_numpy(buf.reshape(-1).view(np.uint8))
        return TensorTransfer(self._dist.isend(tensor, dst=peer, group=self._group, tag=tag), tensor)

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> TensorTransfer:
        tensor = self._torch.from_numpy(buf.reshape(-1).view(np.uint8))
        return TensorTransfer(self._dist.irecv(tensor, src=peer, group=self._group, tag=tag), tensor)

    def close(self) -> None:
        self._dist.destroy_process_group(self._group)


class GlooRound:
    """A control round's collective in flight on Gloo (a handles.Work): Gloo's own threads move the data, and `wait`
    sleeps on its completion, waking each `ALIVE_EVERY_S` to call `alive` if given."""

    __slots__ = ("_work", "_out")

    def __init__(self, work: Any, out: np.ndarray) -> None:
        self._work, self._out = work, out

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, alive: Callable[[], None] | None = None) -> np.ndarray:
        wait_work(self._work, alive)
        return self._out
