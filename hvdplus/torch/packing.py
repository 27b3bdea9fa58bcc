"""The flat buffers of blocking in-place grouped allreduces, kept from one call to the next (allreduce_ops.py).

Otherwise a packed group is flattened into a new buffer and unflattened into new views at every call: for 256
tensors of 4 KiB that is ~130 us to flatten (into a fresh 1 MiB, touched for the first time) and ~290 us to make
the views, before ~120 us to copy the results back. A group kept under its name reuses its buffer and the buffer's
views in the tensors' shapes, so a call is two foreach copies: in, then out.

Which groups are kept, and where. Only blocking in-place groups with a name: DistributedOptimizer's groups are
asynchronous, and holding a few MB that torch allocated during the first training steps slowed a CNN step over
Gloo by ~15% on the project's VM (2026-11-28). The buffers are anonymous memory maps, outside the allocator's heap,
and private (a fork()ed DataLoader worker does not share them). At most the fusion threshold's bytes (0 keeps
none; Horovod keeps a fusion buffer of that size) and _MAX_GROUPS groups are kept, counted in whole pages, the
least recently used dropped first; a new runtime (init() after shutdown()) drops them all. A buffer is lent to one
call at a time: a call that finds it lent (the same name from another thread, which the core then rejects as a
duplicate) packs into a buffer of its own.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KeptBuffer", "KeptBuffers", "kept_buffers"]

_Key = tuple[str, int]  # (name, process set id)
# Groups kept at most: each is a memory map of its own, and a process may hold only so many (vm.max_map_count);
# a program that names each call anew (name=f"metrics.{step}") reuses none of them anyway.
_MAX_GROUPS = 64


class KeptBuffer:
    """A group's buffer, its views in the group's shapes, the key it is kept under and the layout it fits."""

    __slots__ = ("key", "layout", "flat", "views", "nbytes")

    def __init__(self, key: _Key, layout: tuple[Any, ...], flat: torch.Tensor, views: list[torch.Tensor]) -> None:
        self.key, self.layout, self.flat, self.views = key, layout, flat, views
        self.nbytes = -(-flat.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # what its map takes: whole pages


def _mapped(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor in a private anonymous memory map of its own (unmapped once the tensor is freed)."""
    return torch.frombuffer(mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE), dtype=dtype, count=numel)


class KeptBuffers:
    """The kept buffers, by (name, process set id), for one runtime: borrowed by a call, given back when it
    completes."""

    def __init__(self) -> None:
        self._free: OrderedDict[_Key, KeptBuffer] = OrderedDict()  # least recently used first
        self._bytes = 0  # of the free buffers
        self._owner: weakref.ref[Any] | None = None  # the runtime they were kept for
        self._lock = threading.Lock()
        self.reuses = 0  # calls that packed into a kept buffer (tests)

    def __len__(self) -> int:
        return len(self._free)

    def _serve(self, owner: Any) -> None:
        """Drop every buffer kept for another runtime than `owner` (the lock held)."""
        if self._owner is None or self._owner() is not owner:
            self._free.clear()
            self._bytes = 0
            self._owner = weakref.ref(owner)

    def borrow(
        self, key: _Key, tensors: Sequence[torch.Tensor], parts: tuple[Any, ...], owner: Any
    ) -> KeptBuffer | None:
        """The buffer kept for `key` under the runtime `owner`, taken off the free list, if it fits `tensors` (of
        shapes `parts`); else None (a buffer of another layout is dropped)."""
        with self._lock:
            self._serve(owner)
            entry = self._free.pop(key, None)
            if entry is None:
                return None
            self._bytes -= entry.nbytes
            if entry.layout != (parts, tensors[0].dtype):
                return None
            self.reuses += 1
        return entry

    @staticmethod
    def make(key: _Key, tensors: Sequence[torch.Tensor], parts: tuple[Any, ...]) -> KeptBuffer:
        """A new buffer (and views) for the group under `key`, to give back once the call completes."""
        dtype = tensors[0].dtype
        numel = sum(t.numel() for t in tensors)
        flat = _mapped(numel, dtype) if numel else torch.empty(0, dtype=dtype)
        return KeptBuffer(key, (parts, dtype), flat, list(torch._utils._unflatten_dense_tensors(flat, tensors)))

    def give_back(self, entry: KeptBuffer, limit: int, owner: Any) -> None:
        """Keep `entry` for its key's next call under the runtime `owner`, dropping the least recently used beyond
        `limit` bytes or _MAX_GROUPS groups in all."""
        if entry.nbytes > limit:
            return
        with self._lock:
            self._serve(owner)
            old = self._free.pop(entry.key, None)  # another thread's buffer for the same name, given back first
            if old is not None:
                self._bytes -= old.nbytes
            self._free[entry.key] = entry
            self._bytes += entry.nbytes
            while self._bytes > limit or len(self._free) > _MAX_GROUPS:
                _, dropped = self._free.popitem(last=False)
                self._bytes -= dropped.nbytes


kept_buffers = KeptBuffers()  # this process's
