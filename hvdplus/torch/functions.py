"""horovod.torch's broadcast helpers: start every rank from the root's parameters and optimizer state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hvdplus.common.basics import ProcessSet, global_process_set, rank
from hvdplus.common.collectives import broadcast_object, check_root
from hvdplus.torch.buffers import DTYPE_NAMES
from hvdplus.torch.mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrite, in place, each tensor of `params` with the root's values.

    `params` is a `model.state_dict()`, `model.named_parameters()` (pairs (name, tensor)) or a list of
    tensors. Collective: every rank in the process set must call this, in the same order."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, str)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(
            f"invalid params of type: {type(params).__name__}; pass model.state_dict() or model.named_parameters()"
        )
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"broadcast_parameters can only broadcast tensors; {name!r} is a "
                f"{type(tensor).__name__} (use hvd.broadcast_object for other values)"
            )
    handles = [broadcast_async_(tensor, root_rank, name, process_set) for name, tensor in items]
    for handle in handles:
        synchronize(handle)


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for a tensor in the pickled optimizer state; the data travels by broadcast."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _movable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and value.dtype in DTYPE_NAMES


def _strip(value: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    """`value` with each broadcastable tensor replaced by a `_TensorSlot`, appended to `tensors` in order."""
    if _movable(value):
        tensors.append((path, value))
        return _TensorSlot(path, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, f"{path}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_strip(v, f"{path}.{i}", tensors) for i, v in enumerate(value))
    return value


def _fill(value: Any, tensors: list[tuple[str, torch.Tensor]], own: dict[str, torch.Tensor]) -> Any:
    """Inverse of `_strip`: for each slot the tensor the broadcast fills, appended to `tensors` in the same order:
    this rank's own state tensor at that path when it has the slot's shape and dtype (received in place), else a
    new one."""
    if isinstance(value, _TensorSlot):
        tensor = own.get(value.path)
        if (
            tensor is None
            or tuple(tensor.shape) != value.shape
            or tensor.dtype != value.dtype
            or not tensor.is_contiguous()
        ):
            tensor = torch.empty(value.shape, dtype=value.dtype)
        tensors.append((value.path, tensor))
        return tensor
    if isinstance(value, dict):
        return {k: _fill(v, tensors, own) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_fill(v, tensors, own) for v in value)
    return value


def _initialize_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's start-up step: zero gradients for every parameter that requires one (sparse for SparseAdam and
    for `model`'s sparse embeddings), then one step of the wrapped optimizer, so that its state exists."""
    sparse = {
        id(p)
        for m in (model.modules() if model is not None else ())
        if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()
    }
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    # A DistributedOptimizer's own step would allreduce (every rank would have to step): step the wrapped one.
    base_step = getattr(optimizer, "_base_step", optimizer.step)
    base_step()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Give every rank the root's optimizer state and param_group options (lr, momentum, ...).

    As in Horovod, an optimizer without state is first initialized on each rank by one step on zero gradients
    (sparse ones for SparseAdam and for the sparse embeddings of `model`), so `p.grad` is a zero tensor
    afterwards. Parameters that need no gradient (frozen) have no state and are skipped. The root then sends
    the structure of its `state_dict()` (scalars, options, tensor shapes) with `broadcast_object`, its tensors
    as tensors, and the other ranks `load_state_dict` it. `root_rank` is a global rank. LBFGS raises ValueError,
    as in Horovod. Collective: every rank in the process set must call this, in the same order."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "cannot broadcast torch.optim.LBFGS state (its state holds nested closures); "
            "save and load it with torch.save on every rank instead"
        )
    broadcast_state(optimizer, root_rank, model, process_set, initialize_everywhere=True)


def broadcast_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None,
    process_set: ProcessSet,
    initialize_everywhere: bool,
) -> None:
    """broadcast_optimizer_state's work. Without `initialize_everywhere` only the root initializes an empty state
    (an elastic state sync: the others take the root's state anyway and the model is broadcast afterwards, so
    their start-up step, a whole optimizer step, would be thrown away)."""
    is_root = rank() == check_root(root_rank, process_set)
    if not optimizer.state and (is_root or initialize_everywhere):
        _initialize_state(optimizer, model)
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = _strip(optimizer.state_dict(), "optimizer_state", tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, "broadcast_optimizer_state.structure", process_set)
    if not is_root:
        own: list[tuple[str, torch.Tensor]] = []
        _strip(optimizer.state_dict(), "optimizer_state", own)  # state_dict() holds the live state tensors
        skeleton = _fill(skeleton, tensors, dict(own))
    state_dict = skeleton
    handles = [broadcast_async_(tensor, root_rank, name, process_set) for name, tensor in tensors]
    for handle in handles:
        synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(state_dict)
