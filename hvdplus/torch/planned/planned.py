"""When a DistributedOptimizer leaves negotiation for the planned path (common/plans/step_plan.py, reducer.py).

After each negotiated step, every rank of the optimizer's process set checks that the planned path can carry its
step (here: the torch side) and digests the plan; one MIN allreduce decides (common/planned_steps.py
`agree_to_freeze`, the same for every framework). The plan freezes only if every rank is
eligible and has the same digest; a rank that cannot, or plans that differ, keep the optimizer on negotiation for
good (whose errors name any mismatch). A rank in join() contributes zeros: the ranks agree again next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hvdplus.common.basics import ProcessSet, runtime
from hvdplus.common.compression import CastCompressor, NoneCompressor
from hvdplus.common.engines.base import DataEngine, PlannedGroup
from hvdplus.common.ops import Average, ReduceOp, Sum
from hvdplus.common.planned_steps import agree_to_freeze, open_planned_group, settings_allow
from hvdplus.common.plans.grouping import bucket_indices
from hvdplus.common.plans.step_plan import Decision
from hvdplus.torch.buffers import DTYPE_NAMES, in_host_memory, plane_kind
from hvdplus.torch.planned.reducer import Reducer

__all__ = [
    "DEVICE_BUCKET_BYTES",
    "bucket_sizes",
    "freeze_plan",
    "try_freeze",
    "wire_dtype",
]


def wire_dtype(compression: Any) -> tuple[bool, torch.dtype | None]:
    """(whether the planned path can apply it to whole buckets, the dtype buckets travel in)."""
    if compression is NoneCompressor or type(compression) is NoneCompressor:
        return True, None
    if type(compression) is CastCompressor:  # elementwise: casting a bucket casts each gradient (not a subclass's)
        return True, compression.wire_dtype
    return False, None  # a user's compressor sees one gradient at a time, as in Horovod


# Buckets of tensors on a device plane: DDP's default for NCCL. Each planned bucket is one NCCL call, and a GPU
# step is often bound by the CPU's launches (ResNet-50 on an H200: ~30 ms of CPU work a step for ~28 ms of GPU).
DEVICE_BUCKET_BYTES = 25 << 20


def bucket_sizes(params: Sequence[torch.Tensor]) -> tuple[int, int | None, int]:
    """(bucket size, the size from which a gradient goes alone, first bucket's size) of DistributedOptimizer's
    buckets: for tensors on a device plane (CUDA tensors on NCCL) HVDPLUS_BUCKET_BYTES or DEVICE_BUCKET_BYTES,
    none alone; else the host engine's rules. The first bucket follows DDP's rule (HVDPLUS_FIRST_BUCKET_BYTES)."""
    rt = runtime()
    first = rt.settings.first_bucket_bytes
    if params and plane_kind(params[0]) is not None:
        return (DEVICE_BUCKET_BYTES if rt.settings.bucket_bytes is None else rt.settings.bucket_bytes), None, first
    return rt.bucket_bytes, rt.engine.alone_bytes, first


def _carrier(params: Sequence[torch.Tensor]) -> tuple[Any, str] | None:
    """The engine whose planned groups carry these gradients, and the plane's name: the host engine for CPU
    tensors, else the device plane their kind travels on (NCCL for CUDA tensors), built by the negotiated steps
    before the freeze. None where the gradients cannot be planned: several devices, or CUDA tensors staged
    through host memory (HOROVOD_GPU_OPERATIONS=mpi, or CPU tensors under HVDPLUS_STAGED_PATH_ON_CPU=1)."""
    if not params or len({p.device for p in params}) != 1:
        return None
    rt = runtime()
    kind = plane_kind(params[0])
    if kind is None:
        return (rt.engine, "host") if in_host_memory(params[0]) else None
    engine = rt.coordinator.plane_engine(kind)
    return None if engine is None else (engine, kind)


def _eligible(params: Sequence[torch.Tensor], op: ReduceOp, groups_given: bool, compression: Any) -> bool:
    carrier = _carrier(params)
    if carrier is None or not settings_allow(on_device=carrier[1] != "host"):
        return False
    if bucket_sizes(params)[0] <= 0:
        return False  # HVDPLUS_BUCKET_BYTES=0: one allreduce per gradient, as in Horovod
    if op not in (Average, Sum) or groups_given or not wire_dtype(compression)[0]:
        return False
    return all(
        p.layout == torch.strided
        and p.dtype in DTYPE_NAMES
        and p.dtype.is_floating_point
        and (p.grad is None or not p.grad.is_sparse)
        for p in params
    )


def try_freeze(
    params: Sequence[torch.Tensor],
    names: dict[torch.Tensor, str],
    op: ReduceOp,
    scales: tuple[float, float],
    groups_given: bool,
    compression: Any,
    process_set: ProcessSet,
) -> Reducer | Decision:
    """Collective over the process set: agree on freezing this optimizer's step plan; the reducer, or why not.
    `scales`: the (prescale, postscale) of the negotiated allreduces."""
    # In launch order: the last layers' gradients first, as backward makes them.
    size, _, first = bucket_sizes(params)
    plan = bucket_indices([p.numel() * p.element_size() for p in params], [p.dtype for p in params], size, None, first)
    wire = wire_dtype(compression)[1]
    prescale, postscale = scales
    if op == Average:
        postscale /= process_set.size()
    eligible = _eligible(params, op, groups_given, compression)
    items = [op.name, prescale, postscale, wire, plan] + [(names[p], tuple(p.shape), p.dtype) for p in params]
    name = f"hvdplus.plan_agreement.{names[params[0]] if params else ''}"
    frozen = freeze_plan(params, eligible, items, name, process_set)
    if isinstance(frozen, Decision):
        return frozen
    engine, group, ranks, digest, host = frozen
    # A device plane's guard travels on the host engine (reducer.py says why), agreed on every member alike.
    guard_group = None if host or len(ranks) == 1 else open_planned_group(runtime().engine, ranks, process_set)
    return Reducer(
        params,
        names,
        plan,
        engine,
        group,
        ranks,
        digest,
        wire,
        (prescale, postscale),
        host=host,
        guard_group=guard_group,
    )


def freeze_plan(
    params: Sequence[torch.Tensor], eligible: bool, items: list[Any], name: str, process_set: ProcessSet
) -> tuple[DataEngine, PlannedGroup, list[int], int, bool] | Decision:
    """Collective over the process set: agree, under `name`, on freezing the plan that `items` describe (the
    set's ranks and the plane `params` travel on join them); (the engine of that plane, the plan's new group on it,
    the set's global ranks, the digest, whether the engine is the host's), or the decision not to freeze (yet)."""
    carrier = _carrier(params) if eligible else None  # none yet: a device plane no negotiated step has built
    agreed = agree_to_freeze(None if carrier is None else carrier[1], items, name, process_set)
    if isinstance(agreed, Decision):
        return agreed
    assert carrier is not None  # a freeze needs every rank eligible
    ranks, digest = agreed
    engine, plane = carrier
    return engine, open_planned_group(engine, ranks, process_set), ranks, digest, plane == "host"
