"""An engine's data calls, each waited for as soon as it is started: what the composed collectives use.

Hierarchical allreduce and allgather (data/hierarchical.py) and Adasum (data/adasum.py) make many engine calls in
a row, each needed before the next. They take a `Waited` engine, whose calls start the collective on the engine
(DataEngine's `start_*`) and wait for its `Work` with the round's `alive`, so that a peer that freezes inside one of
them is named as in any other wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdplus.common.engines.base import Engine, Group
from hvdplus.common.ops import ReduceOp

__all__ = ["Waited"]


class Waited:
    """`engine`'s data calls, blocking: each returns once its `Work` has completed (its wait given `alive`)."""

    def __init__(self, engine: Engine, alive: Callable[[], None] | None = None) -> None:
        self.engine, self.name, self.rank, self._alive = engine, engine.name, engine.rank, alive

    def unwatched(self) -> Waited:
        """The same engine, its waits given no `alive`: for calls on another thread than the round's, whose `alive`
        (a frozen-peer inspector) expects one caller about once a second."""
        return Waited(self.engine)

    def allreduce(self, buf: Any, dtype: str, op: ReduceOp, group: Group, send: Any | None = None) -> None:
        self.engine.start_allreduce(buf, dtype, op, group, send).wait(self._alive)

    def allgather(self, send: Any | None, recv: Any, counts: Sequence[int], group: Group) -> None:
        self.engine.start_allgather(send, recv, counts, group).wait(self._alive)

    def broadcast(self, buf: Any, root: int, group: Group) -> None:
        self.engine.start_broadcast(buf, root, group).wait(self._alive)

    def reducescatter(
        self, send: Any | None, recv: Any, counts: Sequence[int], dtype: str, op: ReduceOp, group: Group
    ) -> None:
        self.engine.start_reducescatter(send, recv, counts, dtype, op, group).wait(self._alive)

    def sendrecv(self, send: np.ndarray, recv: np.ndarray, peer: int, group: Group, source: int | None = None) -> None:
        self.engine.start_sendrecv(send, recv, peer, group, source).wait(self._alive)
