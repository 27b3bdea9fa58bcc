"""A commit of a state dict in preallocated host tensors: one copy per tensor per commit, no allocation.

Horovod's TorchState deep-copies the model's and the optimizer's state dicts at every commit (a new allocation
of the whole state each time). Here the first commit allocates one host buffer per tensor, and later commits copy
into those buffers as long as the tensors keep their shapes and dtypes: the commit costs one copy of the state,
and the memory one extra copy of it. Values that are not tensors (hyperparameters, step counts) are deep-copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["Snapshot"]


def _buffer_for(value: torch.Tensor, old: Any) -> torch.Tensor:
    """`old` if it can hold `value`, else a new host buffer (pinned for a device tensor, to copy at full speed)."""
    if (
        isinstance(old, torch.Tensor)
        and old.shape == value.shape
        and old.dtype == value.dtype
        and old.layout == value.layout
    ):
        return old
    if value.is_sparse:
        return value.detach().to("cpu", copy=True)
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)


def _copy_into(value: Any, old: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_sparse:
            return value.detach().to("cpu", copy=True)
        buffer = _buffer_for(value, old)
        buffer.copy_(value.detach(), non_blocking=value.is_cuda)
        return buffer
    if isinstance(value, dict):
        previous = old if isinstance(old, dict) else {}
        return type(value)((key, _copy_into(item, previous.get(key))) for key, item in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        before_items = old if isinstance(old, (list, tuple)) and len(old) == len(value) else [None] * len(value)
        return type(value)(_copy_into(item, before) for item, before in zip(value, before_items))
    return copy.deepcopy(value)


def _fresh(value: Any) -> Any:
    """`value` with every tensor cloned: what a consumer that keeps tensors by reference may hold."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _fresh(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_fresh(item) for item in value)
    return copy.deepcopy(value)


class Snapshot:
    """The last committed copy of a state dict."""

    def __init__(self, state: Any) -> None:
        self._tree: Any = None
        self.save(state)

    def save(self, state: Any) -> None:
        """Copy `state` into the buffers (reallocating only what changed shape or dtype)."""
        self._tree = _copy_into(state, self._tree)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are done before training goes on

    @property
    def tree(self) -> Any:
        """The committed state, by reference (for load_state_dict calls that copy it into live tensors)."""
        return self._tree

    def fresh(self) -> Any:
        """The committed state with its own tensors (for load_state_dict calls that keep them)."""
        return _fresh(self._tree)
