"""Running a cycle's agreed responses on this rank: fused into batches (fusion.py), each batch by its kind, with the
timeline's spans. The fusable data collectives go to the executor; the rest to the coordinator's `run_control`,
which runs join, process sets and channels itself and hands alltoall and barrier on to the executor. A joined rank
contributes zeros to the allreduces it did not submit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from hvdplus.common.control.in_flight import InFlight
from hvdplus.common.control.messages import Response
from hvdplus.common.control.negotiation import device_kind
from hvdplus.common.data.buffer_ops import DataPlane
from hvdplus.common.data.executor import Executor, Submission
from hvdplus.common.data.fusion import plan_batches
from hvdplus.common.engines.base import Engine
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.handles import Handle
from hvdplus.common.ops import OpKind, ReduceOp, storage_dtype
from hvdplus.common.timeline import Timeline
from hvdplus.common.tunables import Tunables

__all__ = ["Dispatcher"]


class Dispatcher:
    """Runs the responses of each cycle, in the order agreed."""

    def __init__(
        self,
        rank: int,
        executor: Executor,
        in_flight: InFlight,
        planes: dict[str, DataPlane],
        tunables: Tunables,
        engine: Engine,
        run_control: Callable[[Response, Submission], Any],
        joined: Callable[[], bool],
    ) -> None:
        """`planes`: the coordinator's device planes, by kind (it adds them as it builds them); `run_control`: the
        result of a control collective; `joined()`: whether this rank has joined in these rounds."""
        self._rank, self._executor, self._in_flight = rank, executor, in_flight
        self._planes, self._tunables, self._engine, self._run_control = planes, tunables, engine, run_control
        self._joined = joined

    def run(self, responses: list[Response], timeline: Timeline | None) -> None:
        """Run this rank's part of `responses` (every rank got the same list, in the same order)."""
        runnable = [response for response in responses if self._rank in response.members]
        # A lone response is a batch of its own: no fusion plan to make.
        planned = (
            [runnable]
            if len(runnable) == 1
            else plan_batches(runnable, self._tunables.fusion_threshold, self._engine.alone_bytes)
        )
        batches: list[list[tuple[Response, Submission | None]]] = []
        taken: list[str] = []  # the names of the collectives this rank submitted
        try:
            for batch in planned:
                pairs: list[tuple[Response, Submission | None]] = []
                batches.append(pairs)
                for response in batch:  # one by one: a failure puts back what was taken so far
                    pairs.append((response, self._take_work(response, taken)))
            self._in_flight.names.release(taken)  # free again before any of them completes, in one call
            names = [
                [work.request.name for _, work in pairs if work is not None] if timeline else [] for pairs in batches
            ]
            if timeline:  # agreed: each tensor leaves negotiation and queues behind the batches before its own
                for pairs, batch_names in zip(batches, names):
                    timeline.end(batch_names)
                    timeline.begin(batch_names, pairs[0][0].kind.name)
                    timeline.begin(batch_names, "QUEUE")
            for pairs, batch_names in zip(batches, names):
                if timeline:
                    timeline.end(batch_names)
                self._executor.trace(timeline, batch_names)
                self._run_batch(pairs)
                if timeline:
                    timeline.end(batch_names)
        except BaseException:
            # This cycle's work left flight as its batches were planned: put back what is unfinished, so that the
            # failure reaches its handles too instead of leaving their callers waiting.
            for pairs in batches:
                for _, work in pairs:
                    if work is not None and not work.handle.done():
                        self._in_flight.hold(work)
            raise
        finally:
            self._executor.trace(None, [])  # the timeline may be replaced before the next cycle

    def _run_batch(self, pairs: list[tuple[Response, Submission | None]]) -> None:
        head, work = pairs[0]
        # No work is None in a batch that runs: a joined rank's allreduce gets zeros (_take_work), and the other
        # data collectives run only when every member announced (they fail while a rank has joined).
        announced = cast("list[tuple[Response, Submission]]", pairs)
        if head.error is not None:
            for response, work in pairs:
                self._executor.fail(response, work)
        elif head.kind == OpKind.ALLREDUCE:
            self._executor.run_allreduce(announced)
        elif head.kind == OpKind.REDUCESCATTER:
            self._executor.run_reducescatter(announced)
        elif head.kind == OpKind.ALLGATHER:
            self._executor.run_allgather(announced)
        elif head.kind == OpKind.BROADCAST:
            if work is not None:
                self._executor.run_broadcast(head, work)
        elif work is not None:
            work.handle.set_result(self._run_control(head, work))

    def _take_work(self, response: Response, taken: list[str]) -> Submission | None:
        """This rank's work for a response (its name added to `taken`); a joined rank contributes zeros to an
        allreduce. A rank that has not joined always has its work for a response that runs, unless a failure
        elsewhere failed it meanwhile: then it raises rather than send zeros for a collective it submitted."""
        work = self._in_flight.take(response.key)
        if work is not None:
            taken.append(work.request.name)
            return work
        if response.error is not None:
            return None
        if not self._joined():
            raise HorovodInternalError(
                f"{response.first.describe()} was agreed, but it is no longer in flight on rank {self._rank} "
                f"(hvdplus stopped meanwhile)"
            )
        if response.kind == OpKind.ALLREDUCE:
            request = response.first
            plane = self._planes.get(device_kind(request.device)) if request.op != ReduceOp.ADASUM else None
            zeros = (
                plane.ops.zeros(request.shape, request.dtype)
                if plane is not None
                else np.zeros(request.shape, dtype=storage_dtype(request.dtype))
            )
            return Submission(request, Handle(request.name), zeros, zeros)
        return None
