"""Framework-agnostic collectives on host (numpy) buffers: argument checks, names, submission.

Adapters turn their tensors into numpy views, call these, and wrap the results back; every
check that two adapters would both need lives here.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from typing import Any, overload

import numpy as np

from hvdplus.common.basics import ProcessSet, global_process_set, runtime
from hvdplus.common.control.messages import Request
from hvdplus.common.data.adasum import check_adasum_size
from hvdplus.common.data.executor import even_splits
from hvdplus.common.data.pickled import pickled
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.handles import Handle
from hvdplus.common.naming import grouped_call
from hvdplus.common.ops import OpKind, ReduceOp, check_reducible, storage_dtype

__all__ = [
    "resolve_op",
    "process_set_ranks",
    "process_set_size",
    "check_root",
    "check_counts",
    "check_reducescatter_op",
    "submit_allreduce",
    "allreduce_now",
    "submit_allgather",
    "submit_broadcast",
    "submit_alltoall",
    "submit_reducescatter",
    "submit_barrier",
    "submit_join",
    "broadcast_object",
    "allgather_object",
]


# How many checked named allreduce requests a runtime keeps (each a few hundred bytes; a training step has one per
# gradient or bucket).
CHECKED_REQUESTS_KEPT = 4096


def resolve_op(average: bool | None, op: ReduceOp | None, default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """Horovod's deprecated `average=` flag and `op=` cannot both be given."""
    if average is not None and op is not None:
        raise ValueError("average and op cannot both be set; use op=Average or op=Sum")
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    if op is None:
        return default
    if not isinstance(op, ReduceOp):
        raise ValueError(f"op must be one of Average, Sum, Min, Max, Product, Adasum; got {op!r}")
    return op


def _set_id(process_set: ProcessSet) -> int:
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered; call hvd.add_process_set() on every rank first")
    if process_set.process_set_id != 0 and process_set.registered_in is not runtime():
        raise ValueError(
            f"{process_set} belongs to a job that has ended (an elastic reset or a shutdown started "
            "a new one, whose ranks may differ): register the ranks you want in this one with "
            "hvd.add_process_set(), for instance in a reset callback"
        )
    return process_set.process_set_id


def process_set_ranks(set_id: int) -> tuple[int, ...]:
    """The global ranks of process set `set_id`, or ValueError if it does not exist."""
    ranks = runtime().coordinator.process_set_ranks(set_id)
    if ranks is None:
        raise ValueError(f"process set {set_id} does not exist")
    return ranks


def process_set_size(set_id: int) -> int:
    """The number of ranks in process set `set_id`, or ValueError if it does not exist."""
    return len(process_set_ranks(set_id))


def _request(
    kind: OpKind, array: np.ndarray, dtype: str, name: str | None, process_set: ProcessSet, device: str, **fields: Any
) -> Request:
    storage_dtype(dtype)
    set_id = _set_id(process_set)
    named = name is not None
    name = name if name is not None else runtime().auto_name(kind.name.lower(), set_id)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if named and fields.get("group", 0) > 0 and fields.get("parts") is None:
        fields["call"] = grouped_call(name, fields["group"])
    return Request(name, kind, set_id, dtype, tuple(array.shape), device, **fields)


def submit_allreduce(
    array: np.ndarray,
    output: np.ndarray,
    dtype: str,
    name: str | None,
    op: ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set: ProcessSet = global_process_set,
    device: str = "cpu",
    parts: tuple[tuple[int, ...], ...] | None = None,
    group: int = 0,
) -> Handle:
    """Reduce `array` into `output`. `parts`: `array` packs a group of tensors of these shapes (checked against
    the other ranks' like the shape; Adasum, which reduces tensor by tensor, cannot be packed). `group`: the
    number of tensors of the grouped call this belongs to, so that ranks grouping different numbers of tensors
    get an error instead of waiting for members that never come (0: not part of a group of several).

    Collective: every rank in the process set must call this, in the same order."""
    request = _allreduce_request(array, dtype, name, op, prescale, postscale, process_set, device, parts, group)
    return runtime().coordinator.submit(request, array, output)


def allreduce_now(
    array: np.ndarray,
    output: np.ndarray,
    dtype: str,
    name: str | None,
    op: ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set: ProcessSet = global_process_set,
    device: str = "cpu",
    parts: tuple[tuple[int, ...], ...] | None = None,
    group: int = 0,
) -> None:
    """`submit_allreduce(...).wait()` for host buffers (`device`: the tensor's device, which a tensor staged through
    host memory keeps): a named allreduce checked before takes the lone lane when its rounds have nothing else to
    do (control/set_rounds.py), with no handle of its own.

    Collective: every rank in the process set must call this, in the same order."""
    request = _allreduce_request(array, dtype, name, op, prescale, postscale, process_set, device, parts, group)
    runtime().coordinator.allreduce_now(request, array, output)


def _allreduce_request(
    array: np.ndarray,
    dtype: str,
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet,
    device: str,
    parts: tuple[tuple[int, ...], ...] | None,
    group: int,
) -> Request:
    """The checked request of an allreduce (`submit_allreduce`): a named one checked once before is not checked
    again (the dynamic API's fast path)."""
    rt = runtime()
    key = None
    if name is not None:
        key = (name, dtype, op, prescale, postscale, process_set.process_set_id, array.shape, device, parts, group)
        checked = rt.checked_requests.get(key)
        if checked is not None and (process_set.registered_in is rt or process_set.process_set_id == 0):
            return checked
    check_reducible(dtype, op, "allreduce")
    if op == ReduceOp.ADASUM:
        if parts is not None:
            raise ValueError("Adasum reduces each tensor on its own: submit the tensors of a group separately")
        check_adasum_size(process_set_size(_set_id(process_set)))
    request = _request(
        OpKind.ALLREDUCE,
        array,
        dtype,
        name,
        process_set,
        device,
        op=op,
        prescale=float(prescale),
        postscale=float(postscale),
        parts=parts,
        group=group,
    )
    if key is not None:
        if len(rt.checked_requests) >= CHECKED_REQUESTS_KEPT:  # names made afresh at every call: start over
            rt.checked_requests.clear()
        rt.checked_requests[key] = request
    return request


def _need_dims(array: np.ndarray, what: str) -> None:
    if array.ndim == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension, got a scalar; reshape it to (1,)")


@overload
def check_counts(
    counts: Sequence[int], shape: Sequence[object], process_set: ProcessSet, what: str
) -> tuple[int, ...]: ...


@overload
def check_counts(
    counts: Sequence[int] | None, shape: Sequence[object], process_set: ProcessSet, what: str
) -> tuple[int, ...] | None: ...


# shape: the tensor's dimensions (None where unknown), or one text for a shape that is not known at all (TF)
def check_counts(
    counts: Sequence[int] | None, shape: Sequence[object], process_set: ProcessSet, what: str
) -> tuple[int, ...] | None:
    """Explicit per-rank element counts of a flat collective: a tensor of `shape` (1-D) and one non-negative
    entry per member of the set. Adapters call it when they build an op, the core again at submit."""
    if counts is None:
        return None
    counts = tuple(int(c) for c in counts)
    set_size = process_set_size(_set_id(process_set))
    if len(shape) != 1 or len(counts) != set_size or any(c < 0 for c in counts):
        raise ValueError(
            f"{what} with counts needs a flat (1-D) tensor and one non-negative count per rank of the "
            f"process set ({set_size}); got a tensor of shape {tuple(shape)} and counts "
            f"{list(counts)}"
        )
    return counts


def _elements(buffer: Any) -> int:
    """The number of elements of a buffer: a numpy array, or a device plane's tensor."""
    return math.prod(buffer.shape)


def _check_output(output: np.ndarray | None, elements: int | None, what: str) -> None:
    if output is not None and elements is not None and _elements(output) != elements:
        raise ValueError(f"{what}: the output must hold {elements} elements, got {_elements(output)}")


def submit_allgather(
    array: np.ndarray,
    dtype: str,
    name: str | None,
    process_set: ProcessSet = global_process_set,
    device: str = "cpu",
    group: int = 0,
    counts: Sequence[int] | None = None,
    output: np.ndarray | None = None,
    tag: str = "",
) -> Handle:
    """Concatenate every member's `array` along the first dimension. `counts`: the elements each member sends,
    for flat tensors (checked across ranks, so that a member's output can be sized before the call). `output`:
    where the result goes (needs `counts`); in place when `array` is this rank's own part of it. `group` as in
    `submit_allreduce`. `tag`: what the call is for, checked across ranks like the shape (a name reused for
    different data, such as ZeRO-3's positional gathers, then fails instead of mixing two tensors).

    Collective: every rank in the process set must call this, in the same order."""
    _need_dims(array, "allgather")
    counts = check_counts(counts, array.shape, process_set, "allgather")
    if output is not None and counts is None:
        raise ValueError("allgather into a given output needs counts=, the number of elements of every rank")
    _check_output(output, None if counts is None else sum(counts), "allgather")
    request = _request(OpKind.ALLGATHER, array, dtype, name, process_set, device, group=group, splits=counts, tag=tag)
    return runtime().coordinator.submit(request, array, output)


def check_root(root_rank: int, process_set: ProcessSet = global_process_set) -> int:
    """Horovod's rule: `root_rank` is a global rank (what `rank()` returns), also with `process_set=`.

    Returns it as an int, or raises ValueError naming the set's global ranks. Every member sees the same
    root and set, so every member raises here, before anything is submitted, and the job stays usable."""
    set_id = _set_id(process_set)
    members = runtime().coordinator.process_set_ranks(set_id) or ()
    if (
        isinstance(root_rank, (bool, np.bool_))
        or not isinstance(root_rank, (int, np.integer))
        or root_rank not in members
    ):
        where = "the job" if set_id == 0 else f"process set {set_id}"
        raise ValueError(
            f"root_rank must be the global rank (hvd.rank()) of a member of {where}, whose global "
            f"ranks are {_ranks_text(members)}; got {root_rank!r}"
        )
    return int(root_rank)


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"0..{len(ranks) - 1}" if list(ranks) == list(range(len(ranks))) and len(ranks) > 3 else str(list(ranks))


def submit_broadcast(
    array: np.ndarray,
    output: np.ndarray,
    dtype: str,
    root_rank: int,
    name: str | None,
    process_set: ProcessSet = global_process_set,
    device: str = "cpu",
    group: int = 0,
) -> Handle:
    """Copy the root's `array` into every member's `output`; `root_rank` is a global rank (see `check_root`);
    `group` as in `submit_allreduce`.

    Collective: every rank in the process set must call this, in the same order."""
    root = check_root(root_rank, process_set)
    request = _request(OpKind.BROADCAST, array, dtype, name, process_set, device, root=root, group=group)
    return runtime().coordinator.submit(request, array, output)


def submit_alltoall(
    array: np.ndarray,
    dtype: str,
    splits: Sequence[int] | None,
    name: str | None,
    process_set: ProcessSet = global_process_set,
    device: str = "cpu",
) -> Handle:
    """Collective: every rank in the process set must call this, in the same order."""
    _need_dims(array, "alltoall")
    set_size = process_set_size(_set_id(process_set))
    if splits is None:
        even_splits(array.shape[0], set_size)
        split_tuple = None
    else:
        split_tuple = tuple(int(s) for s in splits)
        if len(split_tuple) != set_size or any(s < 0 for s in split_tuple) or sum(split_tuple) != array.shape[0]:
            raise ValueError(
                f"splits must have one non-negative entry per rank ({set_size}) summing to the first "
                f"dimension ({array.shape[0]}), got {list(split_tuple)}"
            )
    request = _request(OpKind.ALLTOALL, array, dtype, name, process_set, device, splits=split_tuple)
    return runtime().coordinator.submit(request, array)


def check_reducescatter_op(op: ReduceOp) -> None:
    """Adasum cannot reduce-scatter: HorovodInternalError, the type horovod.torch raises for it (its core aborts
    the enqueue). Average and Sum are Horovod's; Min, Max and Product are hvdplus's additions."""
    if op == ReduceOp.ADASUM:
        raise HorovodInternalError(
            "Reducescatter does not support Adasum; use op=Average or op=Sum "
            "(Min, Max and Product also work in hvdplus)"
        )


def submit_reducescatter(
    array: np.ndarray,
    dtype: str,
    name: str | None,
    op: ReduceOp,
    prescale: float = 1.0,
    postscale: float = 1.0,
    process_set: ProcessSet = global_process_set,
    device: str = "cpu",
    group: int = 0,
    counts: Sequence[int] | None = None,
    output: np.ndarray | None = None,
    tag: str = "",
) -> Handle:
    """Reduce `array` over the set; each member keeps its slice: Horovod's split of the first dimension, or, for
    a flat tensor, `counts[r]` elements for member r (checked across ranks). `output`: where this rank's slice
    goes; in place (no copy of the input) when it is this rank's own slice of `array`. `group` and `tag` as in
    `submit_allreduce` and `submit_allgather`.

    Collective: every rank in the process set must call this, in the same order."""
    _need_dims(array, "reducescatter")
    check_reducescatter_op(op)
    check_reducible(dtype, op, "reducescatter")
    counts = check_counts(counts, array.shape, process_set, "reducescatter")
    if counts is not None:
        if sum(counts) != _elements(array):
            raise ValueError(
                f"reducescatter counts must add up to the tensor's {_elements(array)} elements, got {list(counts)}"
            )
        members = runtime().coordinator.process_set_ranks(_set_id(process_set))
        assert members is not None  # check_counts found the set
        set_rank = members.index(runtime().rank)
        _check_output(output, counts[set_rank], "reducescatter")
    request = _request(
        OpKind.REDUCESCATTER,
        array,
        dtype,
        name,
        process_set,
        device,
        op=op,
        prescale=float(prescale),
        postscale=float(postscale),
        group=group,
        splits=counts,
        tag=tag,
    )
    return runtime().coordinator.submit(request, array, output)


def submit_barrier(process_set: ProcessSet = global_process_set) -> Handle:
    """Collective: every rank in the process set must call this."""
    set_id = _set_id(process_set)
    request = Request(runtime().auto_name("barrier", set_id), OpKind.BARRIER, set_id)
    return runtime().coordinator.submit(request)


def submit_join() -> Handle:
    """This rank has no more data: contribute zeros to other ranks' allreduces until all have joined."""
    from hvdplus.common.control.negotiation import JOIN_KEY

    rt = runtime()
    rt.coordinator.mark_joined()
    return rt.coordinator.submit(Request(JOIN_KEY[1], OpKind.JOIN, JOIN_KEY[0]))


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Pickle `obj` on the root (a global rank) and return a copy of it on every member.

    Collective: every rank in the process set must call this, in the same order."""
    name = name or runtime().auto_name("broadcast_object", _set_id(process_set))
    root_rank = check_root(root_rank, process_set)
    payload = pickled(obj) if runtime().rank == root_rank else None
    length = np.array([0 if payload is None else payload.size], dtype=np.int64)
    submit_broadcast(length, length, "int64", root_rank, f"{name}.size", process_set).wait()
    buffer = payload if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
    submit_broadcast(buffer, buffer, "uint8", root_rank, f"{name}.data", process_set).wait()
    return obj if payload is not None else pickle.loads(buffer.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Pickle `obj` on every rank and return the list of all ranks' objects, in rank order.

    Collective: every rank in the process set must call this, in the same order."""
    name = name or runtime().auto_name("allgather_object", _set_id(process_set))
    payload = pickled(obj)
    sizes = submit_allgather(np.array([payload.size], dtype=np.int64), "int64", f"{name}.sizes", process_set).wait()
    data = submit_allgather(payload, "uint8", f"{name}.data", process_set).wait()
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[offsets[i] : offsets[i + 1]].tobytes()) for i in range(len(sizes))]
