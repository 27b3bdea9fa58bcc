"""horovod.torch's broadcast helpers: start every rank from the root's parameters and optimizer state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.collectives import broadcast_object
from hvdplus.torch.mpi_ops import _DTYPE_NAMES, broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite, in place, each tensor of `params` with the root's values.

    `params` is a `model.state_dict()`, `model.named_parameters()` (pairs (name, tensor)) or a list of
    tensors. Collective: every rank in the process set must call this, in the same order."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, str)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}; pass model.state_dict() or "
                         f"model.named_parameters()")
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters can only broadcast tensors; {name!r} is a "
                             f"{type(tensor).__name__} (use hvd.broadcast_object for other values)")
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
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and value.dtype in _DTYPE_NAMES


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


def _fill(value: Any, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    """Inverse of `_strip`: a fresh zero tensor for each slot, appended to `tensors` in the same order."""
    if isinstance(value, _TensorSlot):
        tensor = torch.zeros(value.shape, dtype=value.dtype)
        tensors.append((value.path, tensor))
        return tensor
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank the root's optimizer state and param_group options (lr, momentum, ...).

    The root sends the structure of `optimizer.state_dict()` (scalars, options, tensor shapes) with
    `broadcast_object`, its tensors are broadcast as tensors, and the other ranks `load_state_dict` the
    result. This works before the first step too: an empty state on the root empties it everywhere, so
    every rank initializes it identically on its first step (no zero-gradient step is taken, unlike Horovod).
    Collective: every rank in the process set must call this, in the same order."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    is_root = process_set.rank() == root_rank
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = _strip(optimizer.state_dict(), "optimizer_state", tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, "broadcast_optimizer_state.structure", process_set)
    state_dict = skeleton if is_root else _fill(skeleton, tensors)
    handles = [broadcast_async_(tensor, root_rank, name, process_set) for name, tensor in tensors]
    for handle in handles:
        synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(state_dict)
