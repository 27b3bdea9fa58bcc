"""The flat buffer a grouped allreduce travels in (allreduce_ops.py), kept between calls for in-place groups.

A packed group used to be flattened into a new buffer and unflattened into new views at every call: for 256
tensors of 4 KiB that is ~130 us to flatten and ~300 us to make the views, then ~110 us to copy the results back
into the inputs. A named in-place group keeps its buffer and the buffer's views in the tensors' shapes, so a call
is two foreach copies (in, then out), ~100 us each. The buffer is lent to one call at a time: a call that finds it
lent (the same name again before the first was synchronized, which then raises a duplicate-name error) packs into
a buffer of its own, so the call in flight keeps its values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PackedBuffers", "flat_views", "packed_buffers"]

_KEPT = 64  # named groups whose buffers are kept (one extra copy of each group's tensors)


def flat_views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` in the shapes of `tensors`, in order."""
    return list(torch._utils._unflatten_dense_tensors(flat, tensors))


class _Kept:
    __slots__ = ("layout", "flat", "views", "lent")

    def __init__(self, layout: tuple[Any, ...], flat: torch.Tensor, views: list[torch.Tensor]) -> None:
        self.layout, self.flat, self.views, self.lent = layout, flat, views, False


class PackedBuffers:
    """The kept buffers of named in-place groups, the least recently used dropped beyond _KEPT."""

    def __init__(self) -> None:
        self._by_name: OrderedDict[str, _Kept] = OrderedDict()

    def borrow(
        self, name: str, tensors: Sequence[torch.Tensor], parts: tuple[tuple[int, ...], ...]
    ) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
        """(buffer, views, kept) for the group `tensors` of shapes `parts` under `name`: the kept ones when free,
        else new ones (kept for next time if none were); `kept`: give them back with `give_back(name)`."""
        layout = (parts, tensors[0].dtype, tensors[0].device)
        entry = self._by_name.get(name)
        if entry is not None and entry.layout == layout:
            if entry.lent:
                flat = torch.empty(entry.flat.numel(), dtype=entry.flat.dtype, device=entry.flat.device)
                return flat, flat_views(flat, tensors), False
            self._by_name.move_to_end(name)
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
            entry = self._by_name[name] = _Kept(layout, flat, flat_views(flat, tensors))
            self._by_name.move_to_end(name)
            if len(self._by_name) > _KEPT:
                self._by_name.popitem(last=False)
        entry.lent = True
        return entry.flat, entry.views, True

    def give_back(self, name: str) -> None:
        entry = self._by_name.get(name)
        if entry is not None:
            entry.lent = False

    def kept(self, name: str) -> torch.Tensor | None:
        """The buffer kept for the group `name`, if any (tests)."""
        entry = self._by_name.get(name)
        return None if entry is None else entry.flat


packed_buffers = PackedBuffers()  # this process's, shared by every grouped call
