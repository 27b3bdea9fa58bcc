"""Fused-buffer layouts, one for every collective kind: where each tensor's part for each rank sits.

A batch of T collectives on R ranks is a table `counts[t][r]`: the elements of tensor t that belong to rank r
(the rank's slice of a reduce-scatter, the rank's contribution to an allgather). The engine sees one buffer in
rank-major order (rank 0's parts of every tensor, then rank 1's, ...), so one call with per-rank totals moves
the whole batch. Buffers are numpy arrays or any tensors that slice like them (a device plane's). An allreduce is
the one-column case: the tensors end to end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Layout", "balanced_counts"]


def balanced_counts(total: int, parts: int) -> list[int]:
    """Horovod's uneven split: `total` cut into `parts` contiguous pieces of total // parts, the first
    total % parts one larger (reduce-scatter rows, hierarchical slices)."""
    return [total // parts + (1 if p < total % parts else 0) for p in range(parts)]


class Layout:
    """Offsets of a rank-major fused buffer for `counts[t][r]`."""

    __slots__ = ("counts", "ranks", "rank_totals", "_starts", "_blocks")

    def __init__(self, counts: Sequence[Sequence[int]]) -> None:
        self.counts = [list(row) for row in counts]
        self.ranks = len(self.counts[0]) if self.counts else 0
        self.rank_totals = [sum(row[r] for row in self.counts) for r in range(self.ranks)]
        # _starts[t][r]: where rank r's part begins inside tensor t; _blocks[r]: where rank r's block begins.
        self._starts: list[list[int]] = [
            np.concatenate([[0], np.cumsum(row[:-1])]).astype(int).tolist() for row in self.counts
        ]
        self._blocks: list[int] = np.concatenate([[0], np.cumsum(self.rank_totals)]).astype(int).tolist()

    @classmethod
    def end_to_end(cls, sizes: Sequence[int]) -> Layout:
        """The layout of tensors simply laid end to end (allreduce fusion)."""
        return cls([[size] for size in sizes])

    @property
    def total(self) -> int:
        return self._blocks[-1]

    def block(self, buffer: Any, rank: int) -> Any:
        """Rank `rank`'s contiguous block of a rank-major buffer."""
        return buffer[self._blocks[rank] : self._blocks[rank + 1]]

    def pack(self, tensors: Sequence[Any], buffer: Any) -> None:
        """Copy flat `tensors` (each in its own order: rank 0's part first) into `buffer` in rank-major order."""
        if self.ranks == 1 and isinstance(buffer, np.ndarray):  # one numpy call; other buffers copy slice by slice
            np.concatenate(tensors, out=buffer)
            return
        position = 0
        for r in range(self.ranks):
            for tensor, row, starts in zip(tensors, self.counts, self._starts):
                if row[r]:
                    buffer[position : position + row[r]] = tensor[starts[r] : starts[r] + row[r]]
                    position += row[r]

    def unpack(self, buffer: Any, tensors: Sequence[Any]) -> None:
        """The inverse of `pack`: copy a rank-major `buffer` out into the flat `tensors`."""
        position = 0
        for r in range(self.ranks):
            for tensor, row, starts in zip(tensors, self.counts, self._starts):
                if row[r]:
                    tensor[starts[r] : starts[r] + row[r]] = buffer[position : position + row[r]]
                    position += row[r]
