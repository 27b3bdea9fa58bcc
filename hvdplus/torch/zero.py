"""ZeroOptimizer: ZeRO-style optimizer-state sharding that wraps the optimizer the user already has.

Each rank of the process set owns 1/N of every parameter dtype's elements (common/sharding.py: all trainable
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
Checkpoints: zero_state.py."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, runtime
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.ops import ReduceOp
from hvdplus.common.optimizer_options import check_compression, check_passes
from hvdplus.common.sharding import bucket_ranges, counts_within, parameter_mismatch, partition
from hvdplus.common.subclassing import disguised_subclass
from hvdplus.torch._optimizer import (_TOO_MANY_PASSES, _ZERO_GRAD_IN_FLIGHT, AllreduceInFlightError,
                                      _constructor_kwargs, _parameter_names)
from hvdplus.torch.compression import Compression, Compressor
from hvdplus.torch.mpi_ops import _dtype_name, _numpy
from hvdplus.torch.zero_state import ZeroStateDicts

__all__ = ["ZeroOptimizer"]


class _Bucket:
    """A run of whole parameters of one partition, reduce-scattered together."""

    __slots__ = ("partition", "start", "end", "params", "ready", "pending")

    def __init__(self, partition: int, start: int, end: int, params: tuple[int, ...]) -> None:
        self.partition, self.start, self.end, self.params = partition, start, end, params
        self.ready = 0
        self.pending: tuple[Any, torch.Tensor, Any, int, int] | None = None  # handle, sent, ctx, offset, count


class _Shards:
    """The flat buffers, buckets and shard parameters of one ZeroOptimizer (everything but the optimizer)."""

    def __init__(self, params: list[torch.Tensor], names: list[str], group_of: list[int],
                 compression: Compressor, passes: int, process_set: ProcessSet) -> None:
        self.params, self.names, self.group_of = params, names, group_of
        self.compression, self.passes, self.process_set = compression, passes, process_set
        self.size, self.index = process_set.size(), process_set.rank()
        self.plan = partition([p.numel() for p in params], [p.dtype for p in params], self.size)
        self.flat_params = [torch.empty(part.total, dtype=part.kind) for part in self.plan]
        self.flat_grads = [torch.zeros(part.total, dtype=part.kind) for part in self.plan]
        self.where: dict[int, tuple[int, int]] = {}  # parameter index -> (partition, flat offset)
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                for i, offset in zip(part.params, part.offsets):
                    view = self.flat_params[k][offset:offset + params[i].numel()]
                    view.copy_(params[i].detach().reshape(-1))
                    params[i].data = view.view_as(params[i])
                    self.where[i] = (k, offset)
        bucket_bytes = runtime().bucket_bytes
        self.buckets = [_Bucket(k, start, end, members) for k, part in enumerate(self.plan)
                        for start, end, members in bucket_ranges(part, part.kind.itemsize, bucket_bytes)]
        self.bucket_of = {i: bucket for bucket in self.buckets for i in bucket.params}
        self.left = [passes] * len(params)
        self.written = [False] * len(params)
        # The shard parameters: one per parameter piece in this rank's range, shaped like the parameter when the
        # piece is all of it (a 0-d one stays 1-D: 0-d state means one value per shard, like Adam's step). The
        # wrapped optimizer then sees the tensors it would see unsharded (per-tensor rules such as LAMB's trust
        # ratio hold, and its temporaries are no bigger than one parameter), except for the parameters that
        # straddle a rank boundary, which it sees as 1-D pieces.
        self.shards: list[tuple[int, int, int, int]] = []  # (partition, group, start, end)
        self.shard_shapes: list[torch.Size] = []
        for k, part in enumerate(self.plan):
            for piece in part.pieces(*part.shard(self.index)):
                whole = piece.length == params[piece.param].numel() and params[piece.param].dim() > 0
                self.shards.append((k, group_of[piece.param], piece.offset, piece.offset + piece.length))
                self.shard_shapes.append(params[piece.param].shape if whole else torch.Size([piece.length]))
        self.shard_params = [torch.nn.Parameter(view) for view in self.shard_views(self.flat_params)]
        self.synchronized = False

    def shard_views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shard pieces of the flat buffers `flats` (parameters or gradients), in shard order."""
        return [flats[k][start:end].view(shape) for (k, _, start, end), shape in zip(self.shards, self.shard_shapes)]

    # ------------------------------------------------------------------ backward
    def gradient_ready(self, i: int) -> None:
        """Hook body: add p.grad into the flat buffer, free it, and start its bucket once the bucket is full."""
        p, bucket = self.params[i], self.bucket_of[i]
        if bucket.pending is not None or self.left[i] <= 0:
            raise AllreduceInFlightError(_TOO_MANY_PASSES)
        if p.grad.is_sparse:
            raise TypeError(f"ZeroOptimizer shards dense gradients only; parameter {self.names[i]!r} has a sparse "
                            f"one (use DistributedOptimizer for sparse embeddings)")
        k, offset = self.where[i]
        view = self.flat_grads[k][offset:offset + p.numel()]
        with torch.no_grad():
            if self.written[i]:
                view.add_(p.grad.reshape(-1))
            else:
                view.copy_(p.grad.reshape(-1))
        self.written[i] = True
        p.grad = None
        self.left[i] -= 1
        if self.left[i] == 0:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self.start(bucket)

    def start(self, bucket: _Bucket) -> None:
        """Reduce-scatter one bucket (zeros for parameters this rank did not use), in place: this rank's slice
        of the bucket receives the average over the set."""
        k = bucket.partition
        for i in bucket.params:
            if not self.written[i]:
                k_i, offset = self.where[i]
                self.flat_grads[k_i][offset:offset + self.params[i].numel()].zero_()
                self.written[i] = True
        counts = counts_within(self.plan[k].bounds, bucket.start, bucket.end)
        offset, count = sum(counts[:self.index]), counts[self.index]
        sent, ctx = self.compression.compress(self.flat_grads[k][bucket.start:bucket.end])
        array = _numpy(sent)
        handle = core.submit_reducescatter(array, _dtype_name(sent), f"ZeroOptimizer.{self.names[bucket.params[0]]}",
                                           ReduceOp.AVERAGE, process_set=self.process_set, counts=counts,
                                           output=array[offset:offset + count])
        bucket.pending = (handle, sent, ctx, offset, count)

    # ------------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Start the buckets whose hooks did not all fire, wait for every reduce-scatter, and point the shard
        parameters' gradients at this rank's averaged slice. Collective."""
        try:
            for bucket in self.buckets:
                if bucket.pending is None:
                    self.start(bucket)
            for bucket in self.buckets:
                handle, sent, ctx, offset, count = bucket.pending
                handle.wait()
                if count and sent.data_ptr() != self.flat_grads[bucket.partition].data_ptr() + \
                        bucket.start * sent.element_size():
                    mine = self.flat_grads[bucket.partition][bucket.start + offset:bucket.start + offset + count]
                    mine.copy_(self.compression.decompress(sent[offset:offset + count], ctx))
        finally:
            for bucket in self.buckets:
                bucket.pending, bucket.ready = None, 0
            self.left = [self.passes] * len(self.params)
            self.written = [False] * len(self.params)
        for shard, grad in zip(self.shard_params, self.shard_views(self.flat_grads)):
            shard.grad = grad
        self.synchronized = True

    def gather(self) -> None:
        """Allgather every rank's updated shard into the flat parameter buffers, in place. Collective."""
        handles = []
        for k, part in enumerate(self.plan):
            start, end = part.shard(self.index)
            flat = _numpy(self.flat_params[k])
            handles.append(core.submit_allgather(flat[start:end], _dtype_name(self.flat_params[k]),
                                                 f"ZeroOptimizer.gather.{self.names[part.params[0]]}",
                                                 process_set=self.process_set, counts=part.counts, output=flat))
        for handle in handles:
            handle.wait()

    def grad_norm(self, norm_type: float) -> float:
        """The norm of the whole averaged gradient, from every rank's shard. Collective."""
        grads = [shard.grad for shard in self.shard_params if shard.numel()]
        if math.isinf(norm_type):
            local = max((float(g.abs().max()) for g in grads), default=0.0)
            op = ReduceOp.MAX
        else:
            local = sum(float(torch.linalg.vector_norm(g.double(), norm_type)) ** norm_type for g in grads)
            op = ReduceOp.SUM
        total = np.array([local], dtype=np.float64)
        core.submit_allreduce(total, total, "float64", f"ZeroOptimizer.norm.{self.names[0]}", op,
                              process_set=self.process_set).wait()
        return float(total[0]) if math.isinf(norm_type) else float(total[0]) ** (1.0 / norm_type)


class _ZeroOptimizer(ZeroStateDicts):
    """Mixin placed before the user's optimizer class (see ZeroOptimizer); `_zero` holds the shards."""

    _zero: _Shards

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
                for shard in self._zero.shard_params:
                    shard.grad.mul_(coefficient)
        return torch.tensor(total)

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
        super().step()
        self._zero.synchronized = False
        self._zero.gather()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the shards' gradients; raises while gradient reduce-scatters are pending."""
        if any(bucket.pending is not None for bucket in self._zero.buckets):
            raise AllreduceInFlightError(_ZERO_GRAD_IN_FLIGHT)
        for p in self._zero.params:
            p.grad = None
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Param groups are fixed once sharded: the partition covers the parameters given at wrapping time."""
        if getattr(self, "_zero", None) is not None:
            raise NotImplementedError("ZeroOptimizer cannot add param groups after wrapping: add them to the "
                                      "optimizer before hvd.ZeroOptimizer(...)")
        super().add_param_group(param_group)


def ZeroOptimizer(optimizer: torch.optim.Optimizer,
                  named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                  compression: Compressor = Compression.none, backward_passes_per_step: int = 1,
                  process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that each rank of `process_set` holds and steps only 1/N of its state.

    Returns an instance of a subclass of `type(optimizer)` whose param groups hold this rank's flat shards (with
    each group's hyper-parameters, so LR schedulers work on it). The model's parameters become views of flat
    buffers; gradients are reduce-scattered (averaged, `compression` on the wire) as backward fills buckets and
    the updated shards are allgathered in `step()`. `backward_passes_per_step`, `named_parameters` and
    `compression` mean what they mean for DistributedOptimizer. CPU parameters only.

    Collective: every rank in the process set must wrap an optimizer over the same parameters (same number,
    order, shapes and dtypes; checked here: CollectiveMismatchError on every rank naming the parameter)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_zero") or hasattr(optimizer, "_hvd_base"):
        raise ValueError("optimizer is already wrapped; wrap the original optimizer once")
    check_passes(backward_passes_per_step)
    check_compression(compression)
    if not process_set.included():
        raise ValueError(f"this rank ({runtime().rank}) is not in {process_set}: only its members can shard an "
                         f"optimizer over it")
    names = _parameter_names(optimizer.param_groups, named_parameters)
    params, group_of = [], []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.requires_grad:
                if p.device.type != "cpu":
                    raise ValueError(f"ZeroOptimizer shards CPU parameters only; {names[p]!r} is on {p.device}")
                params.append(p)
                group_of.append(g)
    described = core.allgather_object([(names[p], tuple(p.shape), str(p.dtype)) for p in params],
                                      name=f"ZeroOptimizer.check.{names[params[0]] if params else ''}",
                                      process_set=process_set)
    problem = parameter_mismatch(described, process_set.ranks or list(range(runtime().size)))
    if problem:
        raise CollectiveMismatchError(problem)
    shards = _Shards(params, [names[p] for p in params], group_of, compression, backward_passes_per_step,
                     process_set)
    groups = [dict({k: v for k, v in group.items() if k != "params"},
                   params=[s for s, (_, g, _, _) in zip(shards.shard_params, shards.shards) if g == index])
              for index, group in enumerate(optimizer.param_groups)]
    base = type(optimizer)
    cls = disguised_subclass(_ZeroOptimizer, base)
    wrapped = cls.__new__(cls)
    base.__init__(wrapped, groups, **_constructor_kwargs(base, dict(optimizer.defaults)))
    wrapped._zero = shards
    wrapped._zero_original_groups = [list(group["params"]) for group in optimizer.param_groups]
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, i=i: shards.gradient_ready(i))
    return wrapped
