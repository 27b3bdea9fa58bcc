"""ZeroOptimizer: ZeRO-style optimizer-state sharding that wraps the optimizer the user already has.

Each rank of the process set owns 1/N of every parameter dtype's elements (common/plans/sharding.py: all trainable
parameters end to end, cut into N balanced contiguous ranges). The model's parameters become views of one flat
buffer per dtype, and the wrapped optimizer (a dynamic subclass of the user's class, like DistributedOptimizer)
steps flat *shard* parameters that are views of this rank's range, so its state (Adam's moments) has the
shard's size. A step:

1. backward: a hook adds each gradient into a flat gradient buffer (and drops `p.grad`); once every gradient of
   a bucket (whole parameters in reverse order, HVDPLUS_BUCKET_BYTES) is there, the bucket is reduce-scattered
   in place with per-rank counts, so each rank receives only its averaged slice, while backward goes on;
2. `step()`: waits for the buckets, steps the shard, then allgathers the updated shards in place into the flat
   parameter buffers. The bytes sent are one allreduce's (a reduce-scatter plus an allgather).

`p.grad` of the model's parameters is None after backward (the gradients live in the flat buffer, as in
DeepSpeed's ZeRO-2); `optimizer.clip_grad_norm_(max_norm)` clips on the global norm computed across shards.
The flat buffers, buckets and their collectives: shards.py. Checkpoints: zero_state.py.

On CUDA parameters the flat buffers and buckets live on the GPU and the collectives run on the device plane
(NCCL, on its own streams, ordered by events). `offload="optimizer"` keeps this rank's master shard, its
gradient and the optimizer state in pinned host memory, as ZeRO-Offload does: each bucket's reduced slice is
copied to the host on a side stream while backward goes on, the wrapped optimizer steps on the CPU (torch's
fused CPU AdamW, or the user's optimizer), and the updated shard is copied back before the allgather."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, runtime
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.optimizer_options import check_compression, check_passes
from hvdplus.common.plans.sharding import parameter_mismatch
from hvdplus.common.subclassing import disguised_subclass
from hvdplus.torch._optimizer import (
    ZERO_GRAD_IN_FLIGHT,
    AllreduceInFlightError,
    constructor_kwargs,
    parameter_names,
    remove_hooks,
)
from hvdplus.torch.buffers import one_device
from hvdplus.torch.compression import Compression, Compressor
from hvdplus.torch.zero.shards import Shards
from hvdplus.torch.zero.zero3 import sharded_model_of
from hvdplus.torch.zero.zero_state import ZeroStateDicts

__all__ = ["ZeroOptimizer"]


class _ZeroOptimizer(ZeroStateDicts):
    """Mixin placed before the user's optimizer class (see ZeroOptimizer); `_zero` holds the shards."""

    _zero: Shards

    def synchronize(self) -> None:
        """Wait for the gradient reduce-scatters; the shard parameters then hold this rank's averaged slice.

        Collective: every rank in the process set must call this (step() does)."""
        self._zero.synchronize()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Kept for DistributedOptimizer's idiom: step() synchronizes only if that has not happened yet."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that the norm of the whole (unsharded) averaged gradient is at most `max_norm`;
        return that norm, as torch.nn.utils.clip_grad_norm_ does. Call it between backward and step().

        Collective: every rank in the process set must call this."""
        if not self._zero.synchronized:
            self._zero.synchronize()
        total = self._zero.grad_norm(float(norm_type))
        coefficient = float(max_norm) / (total + 1e-6)
        if coefficient < 1.0:
            with torch.no_grad():
                torch._foreach_mul_(self._zero.shard_grads(), coefficient)
        return torch.tensor(total, device=self._zero.flats[0].grad.device if self._zero.flats else None)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure` (if any), synchronize the gradients unless done already, step the shard with the wrapped
        optimizer, and allgather the updated shards into the model's parameters.

        Collective: every rank in the process set must call this."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._zero.synchronized:
            self._zero.synchronize()
        self._zero.host_step_ready()
        super().step()
        self._zero.synchronized = False
        self._zero.clear_gradients()
        self._zero.stepped()
        self._zero.gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the shards' gradients; raises while gradient reduce-scatters are pending."""
        if self._zero.in_flight or any(bucket.fills or bucket.written for bucket in self._zero.buckets):
            raise AllreduceInFlightError(ZERO_GRAD_IN_FLIGHT)
        for p in self._zero.params:
            p.grad = None
        self._zero.clear_gradients()
        self._zero.synchronized = False
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Param groups are fixed once sharded: the partition covers the parameters given at wrapping time."""
        if getattr(self, "_zero", None) is not None:
            raise NotImplementedError(
                "ZeroOptimizer cannot add param groups after wrapping: add them to the "
                "optimizer before hvd.ZeroOptimizer(...)"
            )
        super().add_param_group(param_group)


def ZeroOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    process_set: ProcessSet = global_process_set,
    offload: str | None = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that each rank of `process_set` holds and steps only 1/N of its state.

    Returns an instance of a subclass of `type(optimizer)` whose param groups hold this rank's flat shards (with
    each group's hyper-parameters, so LR schedulers work on it). The model's parameters become views of flat
    buffers; gradients are reduce-scattered (averaged, `compression` on the wire) as backward fills buckets and
    the updated shards are allgathered in `step()`. `backward_passes_per_step`, `named_parameters` and
    `compression` mean what they mean for DistributedOptimizer. The parameters may be on the CPU or on one GPU
    (then buffers and collectives stay on it). `offload="optimizer"`: this rank's master shard, its gradient and
    the optimizer state live in (pinned) host memory and the optimizer steps on the CPU (ZeRO-Offload).

    Collective: every rank in the process set must wrap an optimizer over the same parameters (same number,
    order, shapes and dtypes; checked here: CollectiveMismatchError on every rank naming the parameter)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_zero") or hasattr(optimizer, "_hvd_base"):
        raise ValueError("optimizer is already wrapped; wrap the original optimizer once")
    check_passes(backward_passes_per_step)
    check_compression(compression)
    if offload not in (None, "optimizer"):
        raise ValueError(
            f"offload must be None or 'optimizer' (got {offload!r}); parameters are offloaded by "
            f"hvd.shard_parameters(..., offload='parameters')"
        )
    if not process_set.included():
        raise ValueError(
            f"this rank ({runtime().rank}) is not in {process_set}: only its members can shard an optimizer over it"
        )
    names = parameter_names(optimizer.param_groups, named_parameters)
    params, group_of = [], []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.requires_grad:
                params.append(p)
                group_of.append(g)
    device = one_device(params, lambda p: names[p], "ZeroOptimizer")
    sharded = sharded_model_of(p for group in optimizer.param_groups for p in group["params"])
    if sharded is not None and sharded.gradients is not None:
        raise ValueError("this sharded model already has a ZeroOptimizer; wrap one optimizer per sharded model")
    shape = (lambda p: p.shape) if sharded is None else sharded.shape_of
    described = core.allgather_object(
        [(names[p], tuple(shape(p)), f"{p.dtype} on {p.device.type}") for p in params],
        name=f"ZeroOptimizer.check.{names[params[0]] if params else ''}",
        process_set=process_set,
    )
    problem = parameter_mismatch(described, process_set.ranks or list(range(runtime().size)))
    if problem:
        raise CollectiveMismatchError(problem)
    if sharded is not None and (sharded.process_set.ranks or None) != (process_set.ranks or None):
        raise ValueError(
            f"the model is sharded over {sharded.process_set}, so its ZeroOptimizer must use that "
            f"process set (got {process_set})"
        )
    shards = Shards(
        params,
        [names[p] for p in params],
        group_of,
        compression,
        backward_passes_per_step,
        process_set,
        device,
        offload,
        sharded,
    )
    if sharded is not None:
        sharded.gradients = shards
    groups = [
        dict(
            {k: v for k, v in group.items() if k != "params"},
            params=[s for s, (_, g, _, _) in zip(shards.shard_params, shards.shards) if g == index],
        )
        for index, group in enumerate(optimizer.param_groups)
    ]
    base = type(optimizer)
    cls = disguised_subclass(_ZeroOptimizer, base)
    wrapped = cls.__new__(cls)
    base.__init__(wrapped, groups, **constructor_kwargs(base, dict(optimizer.defaults)))
    wrapped._zero = shards
    wrapped._zero_original_groups = [list(group["params"]) for group in optimizer.param_groups]
    # The hooks hold the shards weakly and leave with the optimizer: a dropped ZeroOptimizer neither lives on in
    # its parameters' hooks nor goes on reduce-scattering (its plan's communicator is released with it).
    owner = weakref.ref(shards)
    handles = [p.register_post_accumulate_grad_hook(functools.partial(_hook, owner, i)) for i, p in enumerate(params)]
    weakref.finalize(wrapped, remove_hooks, handles)
    return wrapped


def _hook(owner: weakref.ref[Shards], i: int, _: torch.Tensor) -> None:
    shards = owner()
    if shards is not None:
        shards.gradient_ready(i)
