"""ZeroOptimizer's frozen step plan (stages 1 and 2): its buckets' reduce-scatters start from the backward hooks,
in plan order, on the plan's own communicator, with no negotiation, and so do the allgathers of the updated
shards at step() (shards.py moves the data; this module runs the collectives and the step's agreement).

A reduce-scatter leaves each rank only its own slice, so the guard cannot ride in the data as it does in
DistributedOptimizer's last bucket: it is one more element, allreduced after the step's last bucket starts
(1 from a rank that trains, 0 from a rank in join(), NaN from a rank whose step differs). On a device plane it is
a host word summed on a planned group of the host engine, as the reducer's (torch/planned/reducer.py): reading a GPU
element would hold the training thread until the GPU drained, and each rank knows its own guard on the host.
A NaN makes every rank raise PlanMismatchError, naming the ranks that differ. A rank in join() makes the others
raise the error Horovod gives a reduce-scatter while a rank has joined, as the negotiated path does, and the plan
ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hvdplus.common.control.negotiation import NOT_WITH_JOIN
from hvdplus.common.engines.base import DataEngine, PlannedGroup
from hvdplus.common.exceptions import PlanMismatchError
from hvdplus.common.handles import Work
from hvdplus.common.ops import OpKind, ReduceOp
from hvdplus.common.planned_steps import PlannedStep
from hvdplus.common.plans.step_plan import GUARD_DIFFERS, GUARD_TRAINING, Guard, read_guard
from hvdplus.common.timeline import Timeline
from hvdplus.torch.buffers import dtype_name, planned_buffer_of

__all__ = ["ShardPlan"]


class ShardPlan(PlannedStep):
    """The collectives of one ZeroOptimizer's frozen plan: a reduce-scatter per bucket, then the guard."""

    what = "a planned gradient reduce-scatter"
    title = "the planned gradient reduce-scatter of ZeroOptimizer"

    def __init__(
        self,
        engine: DataEngine,
        group: PlannedGroup,
        ranks: Sequence[int],
        digest: int,
        host: bool,
        buckets: Sequence[tuple[int, torch.dtype, Sequence[int]]],
        device: torch.device,
        guard_group: PlannedGroup | None = None,
    ) -> None:
        """`buckets`: in plan order, each bucket's (elements, dtype on the wire, elements each rank keeps).
        `device`: the buckets' (a joined rank's zeros live there too). `guard_group`: the host engine's group that
        sums the guard, for a device plane's plan (None: the guard is an element on the plan's own group)."""
        super().__init__(engine, group, ranks, digest, host, planned_buffer_of(host), guard_group)
        self._device = device
        self._buckets = list(buckets)
        self._guard = torch.zeros(1, dtype=torch.float32, device=device) if guard_group is None else None
        self._guard_request: Work | None = None
        self._joined: list[Work] = []
        self._zeros: list[torch.Tensor] = []
        self._traced: dict[int, tuple[Timeline | None, str]] = {}  # requests in flight: their timeline and row
        self.steps = 0  # planned steps completed

    def reducescatter(self, sent: torch.Tensor, counts: Sequence[int], name: str) -> Work:
        """Start summing `sent` (a bucket, in plan order) across the set; this rank's run of it gets its slice.
        `name`: the bucket's row in the timeline."""
        traced = self._trace_start([name], "REDUCESCATTER")
        with self._engine_errors():
            request = self._start_reducescatter(sent, counts)
        self._traced[id(request)] = (traced, name)
        return request

    def allgather(self, full: torch.Tensor, counts: Sequence[int], name: str) -> Work:
        """Start gathering every rank's run of `full` (its updated shard) into every rank's `full`, in place."""
        traced = self._trace_start([name], "ALLGATHER")
        with self._engine_errors():
            buffer = self._buffer(full)
            request = self._engine.start_allgather(None, buffer, counts, self._group)
        self._traced[id(request)] = (traced, name)
        return request

    def _start_reducescatter(self, sent: torch.Tensor, counts: Sequence[int]) -> Work:
        """Start the in-place sum of `sent` of which this rank keeps its run (DataEngine.start_reducescatter)."""
        return self._engine.start_reducescatter(
            None, self._buffer(sent), counts, dtype_name(sent), ReduceOp.SUM, self._group
        )

    def poke(self, request: Work) -> None:
        """Test `request` without waiting, which moves it along on an engine whose collectives progress only inside
        its calls, and raises its error early if it failed."""
        with self._engine_errors():
            request.done()

    def wait(self, request: Work) -> None:
        alive = self._alive()
        with self._engine_errors(alive):
            request.wait(alive)
        traced = self._traced.pop(id(request), None)
        if traced is not None:
            self._trace_end(traced[0], [traced[1]])

    def start_guard(self, differs: bool) -> None:
        """After the step's last bucket: this rank's guard (NaN if its step `differs` from the plan)."""
        self._guard_request = self._send_guard(GUARD_DIFFERS if differs else GUARD_TRAINING)

    def _send_guard(self, value: float) -> Work:
        """Start summing this rank's guard `value` across the set (common/plans/step_plan.py says what sums mean)."""
        with self._engine_errors():
            if self._guard is None:
                return self._start_guard_word(value)
            self._guard.fill_(value)
            return self._engine.start_allreduce(self._buffer(self._guard), "float32", ReduceOp.SUM, self._group)

    def _summed_guard(self) -> float:
        return float(self._guard_word[0] if self._guard is None else self._guard[0])

    def check_guard(self, differs: list[str]) -> None:
        """Once the step's reduce-scatters are done: raise on every rank alike if a rank's step differed
        (PlanMismatchError) or a rank is in join() (Horovod's RuntimeError); the plan then ends."""
        assert self._guard_request is not None, "start_guard() comes first"
        request, self._guard_request = self._guard_request, None
        self.wait(request)
        summed = self._summed_guard()
        if read_guard(summed) == Guard.DIFFERS:
            self._fail(differs, training=True)
        if summed != self._group.size:
            self.close()
            raise RuntimeError(NOT_WITH_JOIN[OpKind.REDUCESCATTER])
        self.steps += 1

    def _abandon(self) -> None:
        self._guard_request, self._joined = None, []
        self._traced.clear()

    # ----------------------------------------------------------------- join
    def start_joined_step(self) -> None:
        if not self._zeros:
            self._zeros = [
                torch.zeros(elements, dtype=dtype, device=self._device) for elements, dtype, _ in self._buckets
            ]
        else:
            for zeros in self._zeros:
                zeros.zero_()  # the last step left the others' sums in them
        with self._engine_errors():
            self._joined = [
                self._start_reducescatter(z, counts) for z, (_, _, counts) in zip(self._zeros, self._buckets)
            ]
        self._joined.append(self._send_guard(0.0))

    def joined_step_done(self) -> bool:
        return self._joined_waits_done() == len(self._joined)

    def _joined_waits_done(self) -> int:
        """The served step's requests complete here, in the order the training members wait for them."""
        with self._engine_errors(self._serving):
            done = 0
            while done < len(self._joined) and self._joined[done].done():
                done += 1
            return done

    def end_joined_step(self) -> bool:
        """One step served is all: either every rank has joined (the plan stays), or the training ranks raised
        Horovod's join error and ended the plan (so does this rank), or a rank differed (every rank raises)."""
        for request in self._joined:
            self.wait(request)
        self._joined = []
        summed = self._summed_guard()
        if read_guard(summed) == Guard.DIFFERS:
            try:
                self._fail([], training=False)
            except PlanMismatchError:
                pass
        elif summed != 0:
            self.close()
        return True
