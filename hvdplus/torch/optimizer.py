"""horovod.torch's DistributedOptimizer: allreduce every gradient as soon as backward produces it.

`DistributedOptimizer(opt)` returns an instance of a dynamic subclass of `type(opt)` (so
`isinstance(wrapped, type(opt))` holds and the wrapped class's `step` does the update). A
post-accumulate-grad hook on each parameter starts an asynchronous in-place allreduce of `p.grad`;
`step()` waits for all of them (`synchronize()`) and then runs the wrapped optimizer's step.

Gradient accumulation: with `backward_passes_per_step=k` the hooks let `p.grad` accumulate locally for
k backward passes and allreduce the sum once (Average over ranks by default). For the update to equal
one step on the combined batch of all ranks and passes, the user divides each pass's loss by k
(with a mean loss and equal micro-batches), exactly as in Horovod's examples::

    for micro_batch in split(batch, k):
        (loss_fn(model(micro_batch)) / k).backward()
    optimizer.step()
"""

from __future__ import annotations

import inspect
import warnings
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch

from hvdplus.common.basics import ProcessSet, global_process_set, size
from hvdplus.common.ops import Adasum, Average, ReduceOp
from hvdplus.torch.compression import Compression, Compressor
from hvdplus.torch.mpi_ops import allreduce_async_
from hvdplus.torch.mpi_ops import synchronize as _synchronize_handle

__all__ = ["DistributedOptimizer"]

_ZERO_GRAD_IN_FLIGHT = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                        "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")


class AllreduceInFlightError(RuntimeError, AssertionError):
    """Optimizer misuse while gradient allreduces are pending.

    A RuntimeError (hvdplus's rule for misuse of state) that is also the AssertionError Horovod raises,
    so code written against either keeps working."""


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer class; never instantiated itself.

    `_hvd_base` (the user's class) and `_hvd_defaults` (its instance's defaults) are set per dynamic class.
    Base methods are called through `self._hvd_base`, never `super(self.__class__, ...)`, so subclassing
    the wrapped class cannot make them recurse."""

    _hvd_base: type
    _hvd_defaults: dict[str, Any]

    def __init__(self, params: Any, named_parameters: Any, compression: Compressor,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                 groups: Any = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set) -> None:
        base = self._hvd_base
        base.__init__(self, params, **_constructor_kwargs(base, self._hvd_defaults))
        self._compression = compression
        self._parameter_names = _parameter_names(self.param_groups, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._groups = groups
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._handles: dict[torch.Tensor, tuple[int | None, Any]] = {}
        self._requires_update: list[torch.Tensor] = []
        self._hook_handles: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        if process_set.included() and size() > 1:
            self._register_hooks()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Allreduce every `passes`-th backward pass from now on (gradients accumulate in between)."""
        _check_passes(passes)
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.append(p)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AllreduceInFlightError(_TOO_MANY_PASSES)
            self._allreduce_delay[p] -= 1
            self._handles[p] = self._allreduce_grad_async(p) if self._allreduce_delay[p] == 0 else (None, None)
        return hook

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[int, Any]:
        if p.grad is None:
            # This rank did not use p (dynamic forward), but other ranks may have: contribute zeros.
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            if not self.sparse_as_dense:
                raise ValueError(f"parameter {self._parameter_names[p]!r} has a sparse gradient; hvdplus reduces "
                                 "sparse gradients as dense ones: pass sparse_as_dense=True to DistributedOptimizer")
            p.grad = p.grad.to_dense()
        compressed, ctx = self._compression.compress(p.grad)
        # Average is split across prescale/postscale (the core applies the extra 1/size for Average).
        predivide = self.gradient_predivide_factor if self.op == Average else 1.0
        handle = allreduce_async_(compressed, name=self._parameter_names[p], op=self.op,
                                  prescale_factor=1.0 / predivide, postscale_factor=predivide,
                                  process_set=self.process_set)
        return handle, ctx

    def synchronize(self) -> None:
        """Wait for every gradient allreduce and write the results into `p.grad`.

        Parameters whose hook did not fire this step (unused in forward, or fewer backward passes than
        `backward_passes_per_step`) are allreduced here, as zeros if they have no gradient.
        Collective: every rank in the process set must call this (step() does)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        try:
            for p in self._requires_update:
                if self._handles.get(p, (None, None))[0] is None:
                    self._handles[p] = self._allreduce_grad_async(p)
            for p, (handle, ctx) in self._handles.items():
                result = self._compression.decompress(_synchronize_handle(handle), ctx)
                if result is not p.grad:
                    p.grad.copy_(result)
        finally:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context `step()` does not call `synchronize()` (call it yourself before, e.g. to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradient allreduces (unless skipped), then step the wrapped optimizer."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        base_step = self._hvd_base.step
        # torch wraps each optimizer class's step to run the step hooks; ours already ran them.
        inner = base_step.__wrapped__ if getattr(base_step, "hooked", False) else base_step
        return inner(self) if closure is None else inner(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; raises while gradient allreduces are pending."""
        if self._handles:
            raise AllreduceInFlightError(_ZERO_GRAD_IN_FLIGHT)
        return self._hvd_base.zero_grad(self, set_to_none)


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The wrapped optimizer's hyperparameters that its constructor accepts by keyword.

    Passing them lets optimizers with required hyperparameters be rebuilt, and keeps `defaults`
    (used by add_param_group) equal to the user's instead of the class defaults."""
    try:
        parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # skip self, params
    except (TypeError, ValueError):
        return {}
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in defaults.items() if k in named}


def _parameter_names(param_groups: list[dict[str, Any]], named_parameters: Any) -> dict[torch.Tensor, str]:
    """Map every optimized parameter to its allreduce name, checking Horovod's rules."""
    if named_parameters is None:
        params = [p for group in param_groups for p in group["params"]]
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters()")
    duplicates = sorted(name for name, count in Counter(name for name, _ in named).items() if count > 1)
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(duplicates)}")
    names = {p: name for name, p in named}
    unnamed = [p for group in param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} optimizer parameter(s) were not named "
                         f"(shapes {[tuple(p.shape) for p in unnamed]}); pass model.named_parameters() of the model "
                         f"whose parameters the optimizer holds")
    return names


def _check_passes(passes: Any) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor = Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that `step()` applies gradients averaged (`op`) over the ranks of `process_set`.

    Returns an instance of a subclass of `type(optimizer)` sharing its param_groups and state.
    `named_parameters` (usually `model.named_parameters()`) names the allreduces; `compression` is the
    wire codec (e.g. `Compression.fp16`); `gradient_predivide_factor` f divides by f before the sum and
    by size/f after (Average only); `groups`/`num_groups` are accepted for compatibility: hvdplus already
    fuses the gradients that are ready together. See the module docstring for `backward_passes_per_step`.
    Collective: every rank in the process set must wrap its optimizer and step it the same number of times."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_hvd_base"):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the original optimizer only once")
    _check_passes(backward_passes_per_step)
    if op == Adasum:
        raise ValueError("op=Adasum is not supported by hvdplus yet; use op=Average")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must be a Compressor such as hvd.Compression.fp16, got {compression!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    members = dict(_DistributedOptimizer.__dict__, _hvd_base=optimizer.__class__,
                   _hvd_defaults=dict(optimizer.defaults))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), members)
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, groups, sparse_as_dense, process_set)
    wrapped.state.update(optimizer.state)  # keep state the user loaded before wrapping (Horovod drops it)
    return wrapped
