"""The planned path's reducer: DistributedOptimizer's gradients live in flat bucket buffers, reduced straight from
the backward hooks.

Once the ranks have frozen a step plan (common/step_plan.py), the reducer owns the gradient memory, as DDP's
Reducer does with `gradient_as_bucket_view`: each bucket is one persistent flat buffer per dtype, and every
`p.grad` is a view into it, so backward accumulates into the buffer and nothing is copied in or out. When the
last gradient of a bucket arrives, the hook starts the bucket's allreduce on the plan's own communicator
(`PlannedGroup`) without waiting for it; buckets start in plan order, so every rank starts the same collectives
in the same order even when its gradients arrive in another. `finish()` (from synchronize) starts what backward
did not (unused parameters contribute zeros, as in Horovod), waits, reads the step's guard (common/step_plan.py)
and scales. Compression (fp16, bf16) casts the whole bucket into a persistent wire buffer.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from hvdplus.common import basics
from hvdplus.common.engines.base import PlannedGroup, PlannedRequest
from hvdplus.common.exceptions import HorovodInternalError, PlanMismatchError
from hvdplus.common.ops import ReduceOp
from hvdplus.common.step_plan import (
    GUARD_DIFFERS,
    GUARD_TRAINING,
    Guard,
    consistency_words,
    read_consistency,
    read_guard,
)
from hvdplus.torch.mpi_ops import _dtype_name, _numpy

__all__ = ["Reducer", "serve_joined"]

log = logging.getLogger("hvdplus")

# Reducers whose plan is frozen on this rank: join() runs their steps with zeros while other ranks still train.
# Held weakly: an optimizer the program dropped releases its buffers and communicator with it (weakref.finalize).
# Every member must serve the same plans, so join() first runs a full garbage collection, after which the plans
# left are those the program still holds, the same on every rank.
_FROZEN: weakref.WeakSet[Reducer] = weakref.WeakSet()
_JOIN_POLL_S = 1e-3


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    flat: torch.Tensor  # the gradients' memory: each p.grad is a view into it
    views: list[torch.Tensor]
    addresses: list[int]  # where each view starts: a view whose data was swapped (module.double()) is no view
    wire: torch.Tensor | None  # the compressed copy that travels, when compression casts
    missing: int = 0  # gradients still to come this step
    request: PlannedRequest | None = None
    zeros: torch.Tensor | None = field(default=None, repr=False)  # what a joined rank sends, made at its first join

    @property
    def sent(self) -> torch.Tensor:
        return self.flat if self.wire is None else self.wire


class Reducer:
    """The gradient buckets of one DistributedOptimizer with a frozen plan, on one process set."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: dict[torch.Tensor, str],
        plan: Sequence[Sequence[int]],
        group: PlannedGroup,
        ranks: Sequence[int],
        digest: int,
        wire_dtype: torch.dtype | None,
        scales: tuple[float, float],
        host: bool = True,
    ) -> None:
        """`plan`: positions in `params` of each bucket's gradients, in launch order, covering every parameter.
        `ranks`: the process set's global ranks. `scales`: (before, after) the sum. `host`: whether `group` is the
        host engine's, which takes numpy views of CPU buffers (else a device plane's, which takes the tensors)."""
        self.runtime = basics.runtime()
        self._names = names
        self._group, self._ranks, self._digest = group, tuple(ranks), digest
        self._set_rank = self._ranks.index(self.runtime.rank)
        self._prescale, self._postscale = scales
        self._host, self._device = host, params[0].device
        self._buckets: list[_Bucket] = []
        self._where: dict[torch.Tensor, tuple[_Bucket, int]] = {}
        for number, positions in enumerate(plan):
            members = [params[i] for i in positions]
            guard = 1 if number == len(plan) - 1 else 0  # the last bucket to start carries the step's guard
            flat = torch.zeros(sum(p.numel() for p in members) + guard, dtype=members[0].dtype, device=self._device)
            views, offset = [], 0
            for p in members:
                views.append(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            addresses = [view.data_ptr() for view in views]
            wire = None
            if wire_dtype is not None and flat.is_floating_point() and flat.dtype != wire_dtype:
                wire = torch.empty(flat.numel(), dtype=wire_dtype, device=self._device)
            bucket = _Bucket(members, flat, views, addresses, wire, len(members))
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
        _FROZEN.add(self)
        self._release = weakref.finalize(self, group.close)  # at close(), or when the optimizer is collected

    # ----------------------------------------------------------------- backward
    def launched(self, p: torch.Tensor) -> bool:
        """Whether p's bucket has started its allreduce this step."""
        return self._where[p][0].request is not None

    @property
    def in_flight(self) -> bool:
        return any(bucket.request is not None for bucket in self._buckets)

    @property
    def closed(self) -> bool:
        """Whether the plan was dropped (a failed step, an engine error, a new job): the optimizer negotiates."""
        return self not in _FROZEN

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
                request.test()  # MPI moves a collective only inside its calls

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
        if sent is None:
            sent = bucket.sent
            if bucket.wire is not None:
                sent.copy_(bucket.flat)
            if self._prescale != 1.0:  # on the wire's dtype, as Horovod scales a compressed gradient
                sent.mul_(self._prescale)
            if bucket is self._buckets[-1]:
                sent[-1] = GUARD_DIFFERS if self._differs else GUARD_TRAINING
        with self._engine_errors():
            bucket.request = self._group.start_allreduce(self._buffer(sent), _dtype_name(sent), ReduceOp.SUM)

    def _buffer(self, tensor: torch.Tensor) -> Any:
        """What the plan's group reduces: a numpy view of a CPU tensor for the host engine, else the tensor."""
        return _numpy(tensor) if self._host else tensor

    # ----------------------------------------------------------------- synchronize
    def finish(self) -> None:
        """Start the buckets backward left (their missing gradients are zeros or the values in place), wait, read
        the step's guard, and leave the averaged gradients in p.grad. Collective over the process set."""
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
        """Wait for this step's collectives."""
        alive = _Alive(self.runtime, self._group.size)
        with self._engine_errors():
            for bucket in self._buckets:
                if bucket.request is not None:
                    bucket.request.wait(alive)
                    bucket.request = None

    def _guard(self, joined: bool = False) -> float:
        """The step's summed guard (in the zeros a rank in join() sent, if `joined`), once it has completed."""
        last = self._buckets[-1]
        sent = last.zeros if joined and last.zeros is not None else last.sent
        return float(sent[-1])

    @contextmanager
    def _engine_errors(self) -> Iterator[None]:
        """An engine's error (a peer died: Gloo's connection closed) becomes the HorovodInternalError the
        negotiated path raises, which elastic training recovers from; the plan is dropped."""
        try:
            yield
        except HorovodInternalError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise HorovodInternalError(
                f"planned gradient allreduce failed on rank {self.runtime.rank}: {type(exc).__name__}: {exc}"
            ) from exc

    def _fail(self, differs: list[str], training: bool) -> None:
        """A rank's step differed: every rank exchanges one consistency word to learn which, and raises."""
        words = consistency_words(self._set_rank, self._group.size, self._digest, training, bool(differs))
        sent = torch.from_numpy(words).to(self._device)  # on the host: the same memory
        with self._engine_errors():
            self._group.start_allreduce(self._buffer(sent), "int64", ReduceOp.SUM).wait(
                _Alive(self.runtime, self._group.size)
            )
        consistency = read_consistency(sent.cpu().numpy(), self._group.size, self._digest)
        who = [self._ranks[i] for i in consistency.differing]
        text = (
            f"the planned gradient allreduce of DistributedOptimizer cannot complete this step: the step of "
            f"rank(s) {who} differs from the plan frozen on every rank (a changed model)"
        )
        if not consistency.digests_agree:
            text += " (and the ranks ran plans with different digests)"
        if differs:
            text += f"; here: {'; '.join(differs[:3])}"
        self.close()
        raise PlanMismatchError(
            text + ". The step's gradients are partly reduced and not usable; the next step negotiates again."
        )

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
        with self._engine_errors():
            return all(bucket.request is None or bucket.request.test() for bucket in self._buckets)

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

    def close(self) -> None:
        """Drop the plan: release its communicator (once; later calls do nothing)."""
        _FROZEN.discard(self)
        self._release()


class _Alive:
    """Called between polls while a planned step waits: raise once hvdplus has failed, warn once about a stall."""

    def __init__(self, runtime: basics.Runtime, size: int) -> None:
        self._runtime, self._started, self._warned = runtime, time.monotonic(), False
        self._size = size

    def __call__(self) -> None:
        if not self._runtime.coordinator.running:
            raise HorovodInternalError("hvdplus stopped while a planned gradient allreduce was in flight")
        settings = self._runtime.settings
        waited = time.monotonic() - self._started
        if not self._warned and not settings.stall_check_disable and waited > settings.stall_check_time_seconds:
            self._warned = True
            log.warning(
                "a planned gradient allreduce has waited %.0f s for the other %d rank(s) of its process set: "
                "a rank may have stopped calling optimizer.step() (or join())",
                waited,
                self._size - 1,
            )
        limit = settings.stall_shutdown_time_seconds
        if limit > 0 and waited > limit:
            raise HorovodInternalError(
                f"a planned gradient allreduce stalled longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={limit:g}"
            )


def serve_joined() -> None:
    """join(): while other ranks still train, run every frozen plan's steps with zeros, as the negotiated path
    contributes zeros to their allreduces. Each plan is served until a step's guard shows that no rank trains
    any more (every rank then stops at that same step)."""
    current = basics.runtime()
    gc.collect()  # plans of optimizers the program dropped go now, on every rank alike
    for stale in [reducer for reducer in _FROZEN if reducer.runtime is not current]:  # an earlier job's
        stale.close()
    serving = list(_FROZEN)
    for reducer in serving:
        reducer.start_joined_step()
    alive = _Alive(current, current.size)
    while serving:
        time.sleep(_JOIN_POLL_S)
        alive()
        for reducer in [reducer for reducer in serving if reducer.joined_step_done()]:
            if reducer.end_joined_step():
                serving.remove(reducer)
            else:
                reducer.start_joined_step()
