"""The flat buffers of blocking in-place grouped allreduces, kept from one call to the next (allreduce_ops.py).

Otherwise a packed group is flattened into a new buffer and unflattened into new views at every call: for 256
tensors of 4 KiB that is ~130 us to flatten (into a fresh 1 MiB, touched for the first time) and ~290 us to make
the views, before ~120 us to copy the results back. A group kept under its name reuses its buffer and the buffer's
views in the tensors' shapes, so a call is two foreach copies: in, then out.

Which groups are kept, and where. Only blocking in-place groups with a name: DistributedOptimizer's groups are
asynchronous, and holding a few MB that torch allocated during the first training steps slowed a CNN step over
Gloo by ~15% on the project's VM (FIELD-NOTES). The buffers are anonymous memory maps, outside the allocator's
heap. At most the fusion threshold's bytes are kept (Horovod keeps a fusion buffer of that size); the least
recently used group goes first. A buffer is lent to one call at a time: a call that finds it lent (the same name
from another thread, which the core then rejects as a duplicate) packs into a buffer of its own.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KeptBuffer", "KeptBuffers", "kept_buffers"]

_Key = tuple[str, int]  # (name, process set id)


class KeptBuffer:
    """A group's buffer, its views in the group's shapes, and the layout they were made for."""

    __slots__ = ("layout", "flat", "views", "nbytes")

    def __init__(self, layout: tuple[Any, ...], flat: torch.Tensor, views: list[torch.Tensor]) -> None:
        self.layout, self.flat, self.views = layout, flat, views
        self.nbytes = flat.numel() * flat.element_size()


def _mapped(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor in an anonymous memory map of its own (unmapped once the tensor is freed)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel)


class KeptBuffers:
    """The kept buffers, by (name, process set id): borrowed by a call, given back when it completes."""

    def __init__(self) -> None:
        self._free: OrderedDict[_Key, KeptBuffer] = OrderedDict()  # least recently used first
        self._bytes = 0  # of the free buffers
        self._lock = threading.Lock()
        self.reuses = 0  # calls that packed into a kept buffer (tests)

    def borrow(self, key: _Key, tensors: Sequence[torch.Tensor], parts: tuple[Any, ...]) -> KeptBuffer | None:
        """The buffer kept for `key` if it is free and fits `tensors` (of shapes `parts`), taken off the free
        list; else None."""
        with self._lock:
            entry = self._free.pop(key, None)
            if entry is None:
                return None
            self._bytes -= entry.nbytes
        if entry.layout != (parts, tensors[0].dtype):
            return None
        self.reuses += 1
        return entry

    @staticmethod
    def make(tensors: Sequence[torch.Tensor], parts: tuple[Any, ...]) -> KeptBuffer:
        """A new buffer (and views) for the group, to give back once the call completes."""
        dtype = tensors[0].dtype
        numel = sum(t.numel() for t in tensors)
        flat = _mapped(numel, dtype) if numel else torch.empty(0, dtype=dtype)
        return KeptBuffer((parts, dtype), flat, list(torch._utils._unflatten_dense_tensors(flat, tensors)))

    def give_back(self, key: _Key, entry: KeptBuffer, limit: int) -> None:
        """Keep `entry` for `key`'s next call, dropping the least recently used beyond `limit` bytes in all."""
        if entry.nbytes > limit:
            return
        with self._lock:
            old = self._free.pop(key, None)  # another thread's buffer for the same name, given back first
            if old is not None:
                self._bytes -= old.nbytes
            self._free[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > limit:
                _, dropped = self._free.popitem(last=False)
                self._bytes -= dropped.nbytes


kept_buffers = KeptBuffers()  # this process's
