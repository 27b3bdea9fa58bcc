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

from collections.abc import Iterable
from typing import Any

import torch

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.data.adasum import check_adasum_size
from hvdplus.common.ops import Adasum, Average, ReduceOp
from hvdplus.common.optimizer_options import check_compression, check_passes, check_predivide, merge_num_groups
from hvdplus.torch._adasum_optimizer import _DistributedAdasumOptimizer
from hvdplus.torch._optimizer import AllreduceInFlightError, _DistributedOptimizer
from hvdplus.torch.compression import Compression, Compressor

__all__ = ["DistributedOptimizer", "AllreduceInFlightError"]


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[Any] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that `step()` applies gradients averaged (`op`) over the ranks of `process_set`.

    Returns an instance of a subclass of `type(optimizer)` sharing its param_groups and state.
    `named_parameters` (usually `model.named_parameters()`) names the allreduces; `compression` is the
    wire codec (e.g. `Compression.fp16`); `gradient_predivide_factor` f divides by f before the sum and
    by size/f after (Average only); `groups` (an int, or lists of parameters) allreduces each group's
    gradients in one grouped allreduce once all of them are ready; sparse gradients are allgathered
    (`sparse_allreduce_async`) unless `sparse_as_dense`. With `op=Adasum` each rank steps the wrapped
    optimizer on its own gradients and the parameters move by the Adasum of the ranks' updates (Horovod's
    delta optimizer; power-of-two process sets only). See the module docstring for `backward_passes_per_step`.
    Collective: every rank in the process set must wrap its optimizer and step it the same number of times."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_hvd_base"):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the original optimizer only once")
    if any(hasattr(p, "_hvdplus_zero3") for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "these parameters are sharded by hvd.shard_parameters (ZeRO-3): wrap the optimizer with "
            "hvd.ZeroOptimizer, which steps the shards"
        )
    check_passes(backward_passes_per_step)
    check_predivide(gradient_predivide_factor, op)
    check_compression(compression)
    groups = merge_num_groups(num_groups, groups)
    methods = dict(_DistributedOptimizer.__dict__)
    if op == Adasum and process_set.included() and process_set.size() > 1:
        check_adasum_size(process_set.size())
        if groups is not None:
            raise ValueError("groups/num_groups are not supported with op=Adasum; leave them unset")
        methods.update(_DistributedAdasumOptimizer.__dict__)
    members = dict(methods, _hvd_base=optimizer.__class__, _hvd_defaults=dict(optimizer.defaults))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), members)
    wrapped: torch.optim.Optimizer = cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    wrapped.state.update(optimizer.state)  # keep state the user loaded before wrapping (Horovod drops it)
    return wrapped
