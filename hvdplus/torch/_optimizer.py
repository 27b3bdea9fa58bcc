"""The hooks behind DistributedOptimizer: allreduce each gradient as backward produces it (see optimizer.py)."""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hvdplus.common.basics import ProcessSet, elastic_worker, global_process_set, size
from hvdplus.common.ops import Adasum, Average, ReduceOp, Sum
from hvdplus.common.optimizer_options import check_passes, predivide_scales
from hvdplus.common.plans.grouping import bucket_indices, build_groups
from hvdplus.common.plans.step_plan import Decision
from hvdplus.torch.compression import Compressor
from hvdplus.torch.device_plane import scale_in_place
from hvdplus.torch.mpi_ops import allreduce_async_, grouped_allreduce_async_
from hvdplus.torch.planned.planned import bucket_sizes, try_freeze, wire_dtype
from hvdplus.torch.planned.reducer import Reducer
from hvdplus.torch.sparse import sparse_allreduce_async

__all__ = ["AllreduceInFlightError"]

ZERO_GRAD_IN_FLIGHT = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
# The handle of a gradient that a process set of one rank reduces itself (_reduce_alone), once its passes are in.
_LOCAL = object()


class AllreduceInFlightError(RuntimeError, AssertionError):
    """Optimizer misuse while gradient allreduces are pending.

    A RuntimeError (hvdplus's rule for misuse of state) that is also the AssertionError Horovod raises,
    so code written against either keeps working."""


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer class; never instantiated itself.

    `_hvd_base` (the user's class) and `_hvd_defaults` (its instance's defaults) are set per dynamic class.
    Base methods are called through `self._hvd_base`, never `super(self.__class__, ...)`, so subclassing
    the wrapped class cannot make them recurse. `_handles[p]` is (handle, compression context): the
    Completion of its allreduce, a (group's Completion, index) pair, `_LOCAL` once a process set of one rank has
    it (reduced in synchronize() with no collective), or None while the parameter waits for more passes or its
    group."""

    _hvd_base: type[torch.optim.Optimizer]
    _hvd_defaults: dict[str, Any]

    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Compressor,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        base = self._hvd_base
        base.__init__(self, params, **constructor_kwargs(base, self._hvd_defaults))
        self._compression = compression
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles: dict[torch.Tensor, tuple[Any, Any]] = {}
        self._requires_update = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._groups_given = groups is not None
        self._reducer: Reducer | None = None  # the planned path's, once the ranks froze a step plan
        self._plan_decision = Decision.RETRY  # NEVER once the ranks agreed that they cannot freeze one
        self._backward_since_step = False  # a planned hook ran since the last synchronize
        if groups is None and op != Adasum:  # Adasum reduces tensor by tensor
            groups = self._buckets()
        self._p_to_group = build_groups(self._requires_update, groups)
        self._group_counts = {group: 0 for group in set(self._p_to_group.values())}
        self._hook_handles: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included() and (size() > 1 or elastic_worker() is not None):  # elastic: size may grow
            self._hook_handles = [
                p.register_post_accumulate_grad_hook(self._make_hook(p)) for p in self._requires_update
            ]
            weakref.finalize(self, remove_hooks, self._hook_handles)

    def _buckets(self) -> list[list[torch.Tensor]] | None:
        """Default groups: DDP-style buckets of `HVDPLUS_BUCKET_BYTES`, each allreduced as one packed buffer once
        backward has produced all of its gradients (None, one allreduce per gradient, when set to 0)."""
        params = self._requires_update
        plan = bucket_indices(
            [p.numel() * p.element_size() for p in params], [p.dtype for p in params], *bucket_sizes(params)
        )
        return [[params[i] for i in bucket] for bucket in plan] or None

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Allreduce every `passes`-th backward pass from now on (gradients accumulate in between)."""
        check_passes(passes)
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _make_hook(self, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        # The parameters outlive an optimizer the program drops: their hooks hold it weakly (so that it, its plan
        # and its communicator are freed), and its finalizer removes them.
        owner = weakref.ref(self)

        def hook(_: torch.Tensor) -> None:
            optimizer = owner()
            if optimizer is not None:
                optimizer._on_gradient(p)

        return hook

    def _on_gradient(self, p: torch.Tensor) -> None:
        """p's post-accumulate-grad hook: count the pass, and hand p on once its gradient is complete."""
        reducer = self._planned()
        if reducer is not None:
            if self._allreduce_delay[p] <= 0 and reducer.launched(p):
                raise AllreduceInFlightError(TOO_MANY_PASSES)
            self._backward_since_step = True
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                reducer.mark_ready(p)
            return
        if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
            raise AllreduceInFlightError(TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        self._handles[p] = (None, None)
        if self._allreduce_delay[p] == 0:
            self._gradient_ready(p)

    def _planned(self) -> Reducer | None:
        """The reducer of the frozen step plan, if there is one for the current job (an elastic reset starts a new
        job, whose ranks agree afresh)."""
        reducer = self._reducer
        if reducer is not None and reducer.stale:
            reducer.close()
            reducer = self._reducer = None
        return reducer

    def _alone(self) -> bool:
        """Whether the process set is this rank alone and its allreduce of the gradients is the identity (Average
        or Sum; Adasum goes through the core, as in Horovod): `_reduce_alone` then does what the core would."""
        return (self.op == Average or self.op == Sum) and self.process_set.size() == 1

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """Start p's allreduce, or its group's once every member of the group is ready."""
        if self._alone():  # reduced in synchronize(), with no collective; the handle marks its passes as done
            self._handles[p] = (_LOCAL, None)
            return
        group = self._p_to_group.get(p)
        if group is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        self._group_counts[group] += 1
        if self._group_counts[group] == len(group):
            self._start_group(group)

    def _gradient(self, p: torch.Tensor) -> torch.Tensor:
        """p's gradient as it is sent: zeros if this rank did not use p, a dense copy with sparse_as_dense
        (p.grad itself stays sparse: `synchronize` hands the optimizer a sparse result, as Horovod does)."""
        if p.grad is None:
            # This rank did not use p (dynamic forward), but other ranks may have: contribute zeros.
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and self.sparse_as_dense:
            return p.grad.to_dense()
        return p.grad

    def _scales(self) -> tuple[float, float]:
        """(prescale, postscale): Average splits gradient_predivide_factor across them (the core divides by size)."""
        return predivide_scales(self.gradient_predivide_factor, self.op)

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        grad = self._gradient(p)
        name = self._parameter_names[p]
        if grad.is_sparse:
            return sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set), None
        compressed, ctx = self._compression.compress(grad)
        prescale, postscale = self._scales()
        return allreduce_async_(
            compressed,
            name=name,
            op=self.op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=self.process_set,
        ), ctx

    def _start_group(self, group: tuple[torch.Tensor, ...]) -> None:
        """One grouped allreduce for the dense gradients of `group`; sparse ones go the sparse path."""
        self._group_counts[group] = 0
        dense, gradients = [], []
        for p in group:
            gradient = self._gradient(p)
            if gradient.is_sparse:
                self._handles[p] = self._allreduce_grad_async(p)
            else:
                dense.append(p)
                gradients.append(gradient)
        if not dense:
            return
        compressed, contexts = zip(*(self._compression.compress(g) for g in gradients))
        prescale, postscale = self._scales()
        result = grouped_allreduce_async_(
            list(compressed),
            name=self._parameter_names[dense[0]],
            op=self.op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=self.process_set,
        )
        for index, (p, ctx) in enumerate(zip(dense, contexts)):
            self._handles[p] = ((result, index), ctx)

    def _start_missing(self) -> None:
        """Start the allreduces whose hooks did not fire (unused parameters, fewer passes than expected)."""
        for p in self._requires_update:
            if self._handles.get(p, (None, None))[0] is None:
                group = self._p_to_group.get(p)
                if group is None:
                    self._handles[p] = self._allreduce_grad_async(p)
                else:
                    self._start_group(group)

    def synchronize(self) -> None:
        """Wait for every gradient allreduce and write the results into `p.grad`.

        Parameters whose hook did not fire this step (unused in forward, or fewer backward passes than
        `backward_passes_per_step`) are allreduced here, as zeros if they have no gradient.
        Collective: every rank in the process set must call this (step() does)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        reducer = self._planned()
        if reducer is not None:
            try:
                reducer.finish()
            except Exception:
                self._reducer = None  # every rank raised: negotiate the next steps
                reducer.close()
                raise
            finally:
                self.discard_pending()
            self._synchronized = True
            return
        if self._alone():
            try:
                self._reduce_alone()
            finally:
                self.discard_pending()
            self._synchronized = True
            return
        try:
            self._start_missing()
            for p, (handle, ctx) in self._handles.items():
                output = handle[0].wait()[handle[1]] if isinstance(handle, tuple) else handle.wait()
                result = self._compression.decompress(output, ctx)
                grad = p.grad
                assert grad is not None  # an allreduced parameter has a gradient (zeros if backward gave none)
                if grad.is_sparse:  # a sparse optimizer (SparseAdam) needs a sparse gradient back
                    p.grad = result if result.is_sparse else result.to_sparse()
                elif result is not grad:
                    grad.copy_(result)
        finally:
            self.discard_pending()
        self._synchronized = True
        if self._plan_decision == Decision.RETRY and size() > 1:  # alone: no backward to overlap
            plan = try_freeze(
                self._requires_update,
                self._parameter_names,
                self.op,
                self._scales(),
                self._groups_given,
                self._compression,
                self.process_set,
            )
            if isinstance(plan, Reducer):
                self._reducer = plan
            else:
                self._plan_decision = plan

    def _reduce_alone(self) -> None:
        """What the allreduce of a process set of one rank leaves in p.grad, with no collective: the gradient itself
        (zeros where backward gave none), rounded through the compression and scaled by
        gradient_predivide_factor's two factors as the core would; a sparse gradient coalesced, one sent as dense
        (sparse_as_dense) made sparse again."""
        dense: list[torch.Tensor] = []
        densified: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in self._requires_update:
            grad = self._gradient(p)
            if grad.is_sparse:  # the sparse allreduce's coalesced sum, of this rank's gradient alone
                p.grad = grad.coalesce()
                continue
            dense.append(grad)
            if grad is not p.grad:
                densified.append((p, grad))
        prescale, postscale = self._scales()
        if wire_dtype(self._compression) == (True, None):  # Compression.none: the gradients are the answer
            for factor in (prescale, postscale):
                if factor != 1.0 and dense:
                    torch._foreach_mul_(dense, factor)
        else:  # the compressed tensor is what the core would reduce (and scale, on the wire's dtype)
            for grad in dense:
                compressed, ctx = self._compression.compress(grad)
                for factor in (prescale, postscale):
                    scale_in_place(compressed, factor)
                result = self._compression.decompress(compressed, ctx)
                if result is not grad:
                    grad.copy_(result)
        for p, grad in densified:
            p.grad = grad.to_sparse()

    def discard_pending(self) -> None:
        """Forget the gradient allreduces in flight and the backward passes counted towards the next one: after
        synchronize(), and after an elastic reset, whose new job never finishes the old job's handles."""
        self._handles.clear()
        self._backward_since_step = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for group in self._group_counts:
            self._group_counts[group] = 0

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context `step()` does not call `synchronize()` (call it yourself before, e.g. to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _base_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's step, without running the step hooks again (ours already ran them)."""
        base_step: Any = self._hvd_base.step  # torch's step hooks wrap it: `hooked` and `__wrapped__`, not in its stub
        inner = base_step.__wrapped__ if getattr(base_step, "hooked", False) else base_step
        return inner(self) if closure is None else inner(self, closure)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradient allreduces (unless skipped), then step the wrapped optimizer."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                    "your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return self._base_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; raises while gradient allreduces are pending. On the planned path
        the gradients stay views of the reducer's buckets, zeroed in place (set_to_none changes nothing)."""
        reducer = self._planned()
        if self._handles or self._backward_since_step:
            raise AllreduceInFlightError(ZERO_GRAD_IN_FLIGHT)
        if reducer is None:
            return self._hvd_base.zero_grad(self, set_to_none)
        reducer.zero_grad()
        for group in self.param_groups:  # parameters outside the plan (trainable later, added later): as torch
            for p in group["params"]:
                if p.grad is not None and not reducer.owns(p):
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().requires_grad_(False).zero_()


def remove_hooks(handles: list[Any]) -> None:
    """A dropped optimizer's hooks leave its parameters (which a new optimizer may wrap)."""
    for handle in handles:
        handle.remove()


def constructor_kwargs(cls: type[torch.optim.Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The wrapped optimizer's hyperparameters that its constructor accepts by keyword.

    Passing them lets optimizers with required hyperparameters be rebuilt, and keeps `defaults`
    (used by add_param_group) equal to the user's instead of the class defaults."""
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # skip self, params
    except (TypeError, ValueError):
        return {}
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in defaults.items() if k in named}


def parameter_names(param_groups: list[dict[str, Any]], named_parameters: Any) -> dict[torch.Tensor, str]:
    """Map every optimized parameter to its allreduce name, checking Horovod's rules."""
    if named_parameters is None:
        params = [p for group in param_groups for p in group["params"]]
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()"
        )
    duplicates = sorted(name for name, count in Counter(name for name, _ in named).items() if count > 1)
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    names = {p: name for name, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} optimizer parameter(s) were not named "
            f"(shapes {[tuple(p.shape) for p in unnamed]}); pass model.named_parameters() of the model "
            f"whose parameters the optimizer holds"
        )
    return names
