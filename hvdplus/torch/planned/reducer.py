"""The planned path's reducer: DistributedOptimizer's gradients live in flat bucket buffers, reduced straight from
the backward hooks.

Once the ranks have frozen a step plan (common/plans/step_plan.py), the reducer owns the gradient memory, as DDP's
Reducer does with `gradient_as_bucket_view`: each bucket is one persistent flat buffer per dtype, and every
`p.grad` is a view into it, so backward accumulates into the buffer and nothing is copied in or out. When the
last gradient of a bucket arrives, the hook starts the bucket's allreduce on the plan's own communicator (a
`PlannedGroup` of the engine) without waiting for it; buckets start in plan order, so every rank starts the same
collectives in the same order even when its gradients arrive in another. `finish()` (from synchronize) starts what
backward did not (unused parameters contribute zeros, as in Horovod), waits, reads the step's guard
(common/plans/step_plan.py) and scales. Compression (fp16, bf16) casts the whole bucket into a persistent wire buffer.

Where the guard travels. On the host engine it is one more element of the last bucket, read for free once the
bucket is reduced. On a device plane (CUDA tensors on NCCL) reading an element of a reduced bucket is a
device-to-host copy that blocks the training thread until the GPU has finished the backward and every bucket's
allreduce, so the optimizer's update and the next step's kernels would be launched only once the GPU has drained.
Reading the guard a step late is no way out: the update of a step whose guard says a rank differs would already
be applied on every rank (an optimizer's update cannot be undone), and the guarantee is that it never is. So a
device plane's guard does not ride in a bucket at all: every rank knows its own guard on the host (a rank's step
differs by what its training thread saw before the last bucket started), so the guards are summed by a one-element
allreduce on a planned group of the host engine (`guard_group`), started with the last bucket and waited for in
`finish()` before the update. The wait depends on the other ranks' training threads reaching their last bucket,
never on the GPU: it is over long before the GPU's allreduces that need the same ranks, and the verdict still comes
before the optimizer's step on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hvdplus.common.engines.base import DataEngine, PlannedGroup
from hvdplus.common.exceptions import PlanMismatchError
from hvdplus.common.handles import Work
from hvdplus.common.ops import ReduceOp
from hvdplus.common.planned_steps import PlannedStep
from hvdplus.common.plans.step_plan import GUARD_DIFFERS, GUARD_TRAINING, Guard, read_guard
from hvdplus.common.timeline import Timeline
from hvdplus.torch.buffers import dtype_name, planned_buffer_of

__all__ = ["Reducer"]


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    flat: torch.Tensor  # the gradients' memory: each p.grad is a view into it
    views: list[torch.Tensor]
    addresses: list[int]  # where each view starts: a view whose data was swapped (module.double()) is no view
    wire: torch.Tensor | None  # the compressed copy that travels, when compression casts
    missing: int = 0  # gradients still to come this step
    request: Work | None = None
    zeros: torch.Tensor | None = field(default=None, repr=False)  # what a joined rank sends, made at its first join
    row: str = ""  # its timeline row: its first gradient's name, as a negotiated bucket's grouped allreduce
    traced: Timeline | None = None  # the timeline its step's spans went to

    @property
    def sent(self) -> torch.Tensor:
        return self.flat if self.wire is None else self.wire


class Reducer(PlannedStep):
    """The gradient buckets of one DistributedOptimizer with a frozen plan, on one process set."""

    what = "a planned gradient allreduce"
    title = "the planned gradient allreduce of DistributedOptimizer"

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: dict[torch.Tensor, str],
        plan: Sequence[Sequence[int]],
        engine: DataEngine,
        group: PlannedGroup,
        ranks: Sequence[int],
        digest: int,
        wire_dtype: torch.dtype | None,
        scales: tuple[float, float],
        host: bool = True,
        guard_group: PlannedGroup | None = None,
    ) -> None:
        """`plan`: positions in `params` of each bucket's gradients, in launch order, covering every parameter.
        `scales`: (before, after) the sum. `guard_group`: the host engine's group that sums the step's guard, for a
        device plane's buckets (None: the guard rides in the last bucket). The other arguments: PlannedStep's."""
        super().__init__(engine, group, ranks, digest, host, planned_buffer_of(host), guard_group)
        self._device = params[0].device
        self._guard_request: Work | None = None
        self._names = names
        self._prescale, self._postscale = scales
        self._buckets: list[_Bucket] = []
        self._where: dict[torch.Tensor, tuple[_Bucket, int]] = {}
        for number, positions in enumerate(plan):
            members = [params[i] for i in positions]
            # The last bucket to start carries the step's guard, unless the guard group does.
            guard = 1 if number == len(plan) - 1 and guard_group is None else 0
            flat = torch.zeros(sum(p.numel() for p in members) + guard, dtype=members[0].dtype, device=self._device)
            views, offset = [], 0
            for p in members:
                views.append(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            addresses = [view.data_ptr() for view in views]
            wire = None
            if wire_dtype is not None and flat.is_floating_point() and flat.dtype != wire_dtype:
                wire = torch.empty(flat.numel(), dtype=wire_dtype, device=self._device)
            bucket = _Bucket(members, flat, views, addresses, wire, len(members), row=names[members[0]])
            self._buckets.append(bucket)
            for index, p in enumerate(members):
                self._where[p] = (bucket, index)
        self._next = 0  # the first bucket not started this step
        self._differs: list[str] = []  # how this rank's step differs from the plan (a changed model)
        self.copies = 0  # gradients copied into their bucket (p.grad replaced by something else than its view)
        self.steps = 0  # planned steps completed
        for bucket in self._buckets:
            for index, p in enumerate(bucket.params):
                if p.grad is not None:
                    self._adopt(p, bucket, index)
                    self.copies -= 1  # taking over the gradients of the last negotiated step is not a step's copy
                else:
                    p.grad = bucket.views[index]

    # ----------------------------------------------------------------- backward
    def launched(self, p: torch.Tensor) -> bool:
        """Whether p's bucket has started its allreduce this step."""
        return self._where[p][0].request is not None

    @property
    def in_flight(self) -> bool:
        return any(bucket.request is not None for bucket in self._buckets)

    def owns(self, p: torch.Tensor) -> bool:
        """Whether p's gradient lives in one of the plan's buckets."""
        return p in self._where

    def mark_ready(self, p: torch.Tensor) -> None:
        """From p's hook, once its gradient for this step is complete: start its bucket (and the full buckets
        queued behind it) if it was the last one missing."""
        bucket, index = self._where[p]
        self._adopt(p, bucket, index)
        bucket.missing -= 1
        if bucket.missing == 0:
            self._start_ready()
        elif self._next:
            request = self._buckets[self._next - 1].request
            if request is not None:
                with self._engine_errors():
                    request.done()  # MPI moves a collective only inside its calls

    def _adopt(self, p: torch.Tensor, bucket: _Bucket, index: int) -> None:
        """Make p.grad its view again (the user may have set it to None or replaced it), copying if needed."""
        grad, view = p.grad, bucket.views[index]
        if grad is view:
            if view.data_ptr() != bucket.addresses[index]:  # module.double() and the like swap a grad's data
                self._differs.append(f"parameter {self._names[p]!r} now has a {view.dtype} gradient elsewhere")
            return
        if grad is None:
            view.zero_()
        elif grad.is_sparse or grad.shape != view.shape or grad.dtype != view.dtype or grad.device != view.device:
            self._differs.append(
                f"parameter {self._names[p]!r} has a {'sparse ' if grad.is_sparse else ''}gradient of shape "
                f"{tuple(grad.shape)} {grad.dtype} on {grad.device}, the plan {tuple(view.shape)} {view.dtype}"
            )
            return
        else:
            view.copy_(grad)
            self.copies += 1
        try:
            p.grad = view
        except RuntimeError as exc:  # the parameter itself changed (model.half(), a new .data)
            self._differs.append(f"parameter {self._names[p]!r} no longer matches the plan ({exc})")

    def _start_ready(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].missing == 0:
            self._start(self._buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket, sent: torch.Tensor | None = None) -> None:
        """Start `bucket`'s allreduce (of `sent`, a joined rank's zeros, if given) and, with the last, the guard's."""
        guard = 0.0  # a rank in join()
        if sent is None:
            sent = bucket.sent
            if bucket.wire is not None:
                sent.copy_(bucket.flat)
            if self._prescale != 1.0:  # on the wire's dtype, as Horovod scales a compressed gradient
                sent.mul_(self._prescale)
            guard = GUARD_DIFFERS if self._differs else GUARD_TRAINING
            if bucket is self._buckets[-1] and self._guard_group is None:
                sent[-1] = guard
            bucket.traced = self._trace_start([bucket.row], "ALLREDUCE")
        with self._engine_errors():
            bucket.request = self._engine.start_allreduce(
                self._buffer(sent), dtype_name(sent), ReduceOp.SUM, self._group
            )
            if bucket is self._buckets[-1] and self._guard_group is not None:
                self._guard_request = self._start_guard_word(guard)

    # ----------------------------------------------------------------- synchronize
    def finish(self) -> None:
        """Start the buckets backward left (their missing gradients are zeros or the values in place), wait, read
        the step's guard (with no device-to-host copy: see the module's docstring), and leave the averaged gradients
        in p.grad. Raises PlanMismatchError on every rank, before any rank's update, if a rank's step differed.
        Collective over the process set."""
        for bucket in self._buckets[self._next :]:
            if bucket.missing:
                for index, p in enumerate(bucket.params):
                    self._adopt(p, bucket, index)
                bucket.missing = 0
        self._start_ready()
        differs, self._differs = self._differs, []
        try:
            self._wait()
            # Alone, the guard tells nothing that `differs` does not (and reading it makes the host wait for the
            # GPU): a process set of one rank skips it.
            if differs if self._group.size == 1 else read_guard(self._guard()) == Guard.DIFFERS:
                self._fail(differs, training=True)
        finally:
            self._next = 0
            for bucket in self._buckets:
                bucket.missing, bucket.request = len(bucket.params), None
        self.steps += 1
        for bucket in self._buckets:
            if self._postscale != 1.0:  # on the wire's dtype, as Horovod scales a compressed sum
                bucket.sent.mul_(self._postscale)
            if bucket.wire is not None:
                bucket.flat.copy_(bucket.wire)
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:  # replaced after its bucket started: the average wins, as in Horovod
                    p.grad = view

    def _wait(self) -> None:
        """Wait for this step's collectives (over NCCL, the buckets' wait only makes the current stream wait)."""
        alive = self._alive()
        with self._engine_errors(alive):
            for bucket in self._buckets:
                if bucket.request is not None:
                    bucket.request.wait(alive)
                    bucket.request = None
                    self._trace_end(bucket.traced, [bucket.row])
                    bucket.traced = None
            if self._guard_request is not None:
                self._guard_request.wait(alive)
                self._guard_request = None

    def _guard(self, joined: bool = False) -> float:
        """The step's summed guard (in the zeros a rank in join() sent, if `joined`), once it has completed: from
        host memory with a guard group, else from the last bucket (on the host engine: host memory too)."""
        if self._guard_group is not None:
            return float(self._guard_word[0])
        last = self._buckets[-1]
        sent = last.zeros if joined and last.zeros is not None else last.sent
        return float(sent[-1])

    def zero_grad(self) -> None:
        """Zero the buckets in place, keeping every p.grad a view (the planned path never drops the memory)."""
        for bucket in self._buckets:
            bucket.flat.zero_()
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    try:
                        p.grad = view
                    except RuntimeError as exc:  # the parameter changed: the step's consistency word says so
                        self._differs.append(f"parameter {self._names[p]!r} no longer matches the plan ({exc})")

    # ----------------------------------------------------------------- join and shutdown
    def _abandon(self) -> None:
        for bucket in self._buckets:
            bucket.request = bucket.traced = None
        self._guard_request = None

    def start_joined_step(self) -> None:
        """In join(): start this plan's collectives with zeros (guard 0), as the training ranks start theirs."""
        if self._next or self.in_flight:
            raise RuntimeError(
                "hvd.join() was called between loss.backward() and optimizer.step() while DistributedOptimizer's "
                "planned step was in flight; call optimizer.step() (or optimizer.synchronize()) before join()"
            )
        for bucket in self._buckets:
            if bucket.zeros is None:
                bucket.zeros = torch.zeros_like(bucket.sent)
            else:
                bucket.zeros.zero_()  # the last step left the others' sum in it
            self._start(bucket, bucket.zeros)

    def joined_step_done(self) -> bool:
        """Without blocking: whether the step `start_joined_step` started has completed."""
        requests = [bucket.request for bucket in self._buckets] + [self._guard_request]
        with self._engine_errors(self._serving):
            return all(request is None or request.done() for request in requests)

    def end_joined_step(self) -> bool:
        """After a completed joined step: whether every rank of the set has joined. A step whose guard says
        that a rank differs ends this plan here too, as it does on the training ranks (after their word)."""
        self._wait()
        guard = read_guard(self._guard(joined=True))
        if guard == Guard.DIFFERS:
            try:
                self._fail([], training=False)
            except PlanMismatchError:
                return True
        return guard == Guard.EVERYONE_JOINED
