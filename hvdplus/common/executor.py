"""The data plane: run agreed responses on the engine, fusing allreduces, and complete handles."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hvdplus.common import halfops, nan
from hvdplus.common.adasum import adasum_tensors
from hvdplus.common.engines.base import Engine
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.handles import Handle
from hvdplus.common.hierarchical import hierarchical_allgather, hierarchical_allreduce
from hvdplus.common.layout import Layout, balanced_counts
from hvdplus.common.messages import Request, Response
from hvdplus.common.ops import OpKind, ReduceOp, storage_dtype
from hvdplus.common.timeline import Timeline
from hvdplus.common.tunables import Tunables

__all__ = ["Work", "Executor", "even_splits"]

_NO_SPAN = nullcontext()


@dataclass
class Work:
    """One collective this rank submitted: its announcement, buffers and handle."""

    request: Request
    handle: Handle
    input: np.ndarray | None = None
    output: np.ndarray | None = None


def even_splits(dim0: int, size: int) -> tuple[int, ...]:
    """Alltoall without splits: dim0 must divide evenly among the ranks."""
    if dim0 % size:
        raise ValueError(f"alltoall without splits needs the first dimension ({dim0}) to be divisible by the "
                         f"number of ranks ({size}); pass splits=... to send uneven parts")
    return (dim0 // size,) * size


def _row_elements(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape[1:]:
        count *= dim
    return count


class Executor:
    """Executes batches of responses for one rank; `set_of(set_id)` gives the process set (its engine group in
    `.group`, its hierarchical groups or None in `.hierarchy`); `tunables` are read at every batch."""

    def __init__(self, engine: Engine, set_of: Callable[[int], Any], tunables: Tunables) -> None:
        self._engine = engine
        self._set_of = set_of
        self._tunables = tunables
        self._fusion_buffers: dict[np.dtype, np.ndarray] = {}
        self.largest_batch: dict[OpKind, int] = {}  # the most collectives one engine call carried, by kind (tests)
        # Engine calls that ran hierarchically: "allreduce/<cross-host algorithm>" and "allgather" (tests, benches).
        self.hierarchical_runs: dict[str, int] = {}
        self._timeline: Timeline | None = None
        self._traced: list[str] = []  # the tensor names of the batch running now, when a timeline is on

    def trace(self, timeline: Timeline | None, names: list[str]) -> None:
        """Record the next batch's activities on `timeline` (None: no timeline) under the tensors' names."""
        self._timeline, self._traced = timeline, names

    def _activity(self, phase: str) -> AbstractContextManager[None]:
        """A timeline span around one activity of the running batch; without a timeline a shared no-op, so the
        hot path makes no generator per batch."""
        return _NO_SPAN if self._timeline is None else self._span(phase)

    @contextmanager
    def _span(self, phase: str) -> Iterator[None]:
        self._timeline.begin(self._traced, phase)
        try:
            yield
        finally:
            self._timeline.end(self._traced)

    @contextmanager
    def _substeps(self) -> Iterator[Callable[[str], None]]:
        """A `mark(step)` for the hierarchical functions: each step a span that ends where the next begins; the
        last one ends on exit."""
        timeline, names, opened = self._timeline, self._traced, []
        if timeline is None:
            yield lambda step: None
            return

        def mark(step: str) -> None:
            if opened:
                timeline.end(names)
            timeline.begin(names, step)
            opened.append(step)

        try:
            yield mark
        finally:
            if opened:
                timeline.end(names)

    def _group_of(self, set_id: int) -> Any:
        return self._set_of(set_id).group

    def _ran_hierarchical(self, what: str) -> None:
        self.hierarchical_runs[what] = self.hierarchical_runs.get(what, 0) + 1

    def _count(self, kind: OpKind, batch: list) -> None:
        if len(batch) > self.largest_batch.get(kind, 0):
            self.largest_batch[kind] = len(batch)

    def fail(self, response: Response, work: Work | None) -> None:
        if work is not None:
            work.handle.set_error(CollectiveMismatchError(response.error))

    def run_allreduce(self, batch: list[tuple[Response, Work]]) -> None:
        """Reduce a batch of agreed allreduces in one engine call (one buffer when fused)."""
        first = batch[0][0].first
        self._count(OpKind.ALLREDUCE, batch)
        if first.op == ReduceOp.ADASUM:
            return self._run_adasum(batch)
        members = batch[0][0].members
        works = [work for _, work in batch]
        source = None
        if len(works) == 1:
            buffer = works[0].output.reshape(-1)
            source = None if works[0].input is works[0].output else works[0].input.reshape(-1)
        else:
            layout = Layout.end_to_end([w.input.size for w in works])
            buffer = self._fusion_buffer(storage_dtype(first.dtype), layout.total)
            with self._activity("MEMCPY_IN_FUSION_BUFFER"):
                layout.pack([w.input.reshape(-1) for w in works], buffer)
        self._reduce(buffer, first, len(members), self._set_of(batch[0][0].key[0]), source)
        if len(works) > 1:
            with self._activity("MEMCPY_OUT_FUSION_BUFFER"):
                layout.unpack(buffer, [w.output.reshape(-1) for w in works])
        for work in works:
            work.handle.set_result(work.output)

    def _run_adasum(self, batch: list[tuple[Response, Work]]) -> None:
        """Adasum of the batch's tensors (hvdplus.common.adasum), each with its own dot product and norms."""
        response, works = batch[0][0], [work for _, work in batch]
        adasum_tensors(self._engine, self._group_of(response.key[0]), response.members.index(self._engine.rank),
                       len(response.members), [w.input for w in works], [w.output for w in works],
                       response.first.dtype, response.first.prescale, response.first.postscale)
        for work in works:
            work.handle.set_result(work.output)

    def _reduce(self, buffer: np.ndarray, request: Request, set_size: int, process_set: Any,
                source: np.ndarray | None) -> None:
        """Reduce `source` (or `buffer` itself) into `buffer`; an unscaled flat allreduce skips the copy."""
        group = process_set.group
        hierarchical = self._tunables.hierarchical_allreduce and process_set.hierarchy is not None
        if source is not None and (request.prescale != 1.0 or hierarchical):
            np.copyto(buffer, source)
            source = None
        halfops.scale_inplace(buffer, request.dtype, request.prescale)
        op = _engine_op(request)
        nans = nan.nan_positions(buffer if source is None else source, request.dtype) \
            if nan.propagates_nan(request.dtype, op) else None
        if hierarchical:
            with self._activity("HIERARCHICAL_ALLREDUCE"), self._substeps() as mark:
                ran = hierarchical_allreduce(self._engine, process_set.hierarchy, buffer, request.dtype, op,
                                             self._tunables.cross_algorithm, mark)
            self._ran_hierarchical(f"allreduce/{ran}")
        else:
            with self._activity(f"{self._engine.name.upper()}_ALLREDUCE"):
                self._engine.allreduce(buffer, request.dtype, op, group, send=source)
        if nans is not None:
            self._engine.allreduce(nans, "uint8", ReduceOp.MAX, group)
            nan.restore_nan(buffer, request.dtype, nans)
        halfops.scale_inplace(buffer, request.dtype, _postscale(request, set_size))

    def _allgather(self, send: np.ndarray | None, recv: np.ndarray, counts: list[int], process_set: Any) -> None:
        """The engine's allgather, or Horovod's hierarchical one where it is on and the hosts' ranks are
        consecutive in the set."""
        hierarchy = process_set.hierarchy
        if self._tunables.hierarchical_allgather and hierarchy is not None and hierarchy.contiguous:
            with self._activity("HIERARCHICAL_ALLGATHER"), self._substeps() as mark:
                hierarchical_allgather(self._engine, hierarchy, send, recv, counts, mark)
            self._ran_hierarchical("allgather")
        else:
            with self._activity(f"{self._engine.name.upper()}_ALLGATHER"):
                self._engine.allgather(send, recv, counts, process_set.group)

    def _fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        buffer = self._fusion_buffers.get(dtype)
        if buffer is None or buffer.size < count:
            buffer = np.empty(count, dtype=dtype)
            self._fusion_buffers[dtype] = buffer
        return buffer[:count]

    def run(self, response: Response, work: Work, set_rank: int) -> Any:
        """Run one non-allreduce response; return the handle's result."""
        group = self._group_of(response.key[0])
        request, requests = work.request, response.requests
        if response.kind == OpKind.BROADCAST:
            root = response.members.index(request.root)  # the request names a global rank; the group, its index
            if set_rank == root and work.input is not work.output:
                np.copyto(work.output, work.input)
            with self._activity(f"{self._engine.name.upper()}_BROADCAST"):
                self._engine.broadcast(work.output.reshape(-1), root, group)
            return work.output
        if response.kind == OpKind.ALLTOALL:
            return self._alltoall(requests, work, set_rank, group)
        if response.kind == OpKind.BARRIER:
            self._engine.barrier(group)
            return None
        raise RuntimeError(f"executor cannot run {response.kind.name}")

    def _alltoall(self, requests: Sequence[Request | None], work: Work, set_rank: int, group: Any) -> Any:
        row = _row_elements(work.request.shape)
        splits = [r.splits or even_splits(r.shape[0], len(requests)) for r in requests]
        recv_rows = [splits[src][set_rank] for src in range(len(requests))]
        out = np.empty((sum(recv_rows),) + work.request.shape[1:], dtype=work.input.dtype)
        self._engine.alltoall(work.input.reshape(-1), [s * row for s in splits[set_rank]], out.reshape(-1),
                              [r * row for r in recv_rows], group)
        return out, np.asarray(recv_rows, dtype=np.int32)

    def run_allgather(self, batch: list[tuple[Response, Work]]) -> None:
        """Gather a batch of agreed allgathers in one engine call: each rank's parts of every tensor travel as one
        block (common/layout.py). A lone allgather writes straight into its output (the caller's, if given), in
        place when this rank's input already sits at its offset there."""
        head = batch[0][0]
        self._count(OpKind.ALLGATHER, batch)
        set_rank, process_set = head.members.index(self._engine.rank), self._set_of(head.key[0])
        layout = Layout([[r.nelements for r in response.requests] for response, _ in batch])
        outputs = [_gather_output(response, work) for response, work in batch]
        if len(batch) == 1:
            work, out, counts = batch[0][1], outputs[0].reshape(-1), layout.counts[0]
            inplace = counts[set_rank] > 0 and work.input.ctypes.data == out[sum(counts[:set_rank]):].ctypes.data
            # A rank with nothing to send passes a buffer of its own: an empty view may alias `out` (MPICH refuses).
            send = work.input.reshape(-1) if counts[set_rank] else np.empty(0, dtype=out.dtype)
            self._allgather(None if inplace else send, out, counts, process_set)
        else:
            with self._activity("MEMCPY_IN_FUSION_BUFFER"):
                mine = np.concatenate([work.input.reshape(-1) for _, work in batch])
            buffer = self._fusion_buffer(mine.dtype, layout.total)
            self._allgather(mine, buffer, layout.rank_totals, process_set)
            with self._activity("MEMCPY_OUT_FUSION_BUFFER"):
                layout.unpack(buffer, [out.reshape(-1) for out in outputs])
        for (_, work), out in zip(batch, outputs):
            work.handle.set_result(out)

    def run_reducescatter(self, batch: list[tuple[Response, Work]]) -> None:
        """Reduce-scatter a batch of agreed requests in one engine call: the inputs are packed rank-major
        (common/layout.py), so each rank receives its slices of every tensor as one block."""
        head = batch[0][0]
        self._count(OpKind.REDUCESCATTER, batch)
        set_rank, group = head.members.index(self._engine.rank), self._group_of(head.key[0])
        request = head.first
        layout = Layout([_scatter_counts(response) for response, _ in batch])
        outputs = [_scatter_output(response, work, set_rank) for response, work in batch]
        op = _engine_op(request)
        if len(batch) == 1:
            self._reducescatter_alone(batch[0][1], outputs[0].reshape(-1), layout.counts[0], set_rank, op, group)
        else:
            buffer = self._fusion_buffer(storage_dtype(request.dtype), layout.total)
            with self._activity("MEMCPY_IN_FUSION_BUFFER"):
                layout.pack([work.input.reshape(-1) for _, work in batch], buffer)
            halfops.scale_inplace(buffer, request.dtype, request.prescale)
            mine = np.empty(layout.rank_totals[set_rank], dtype=buffer.dtype)
            with self._activity(f"{self._engine.name.upper()}_REDUCESCATTER"):
                self._engine.reducescatter(buffer, mine, layout.rank_totals, request.dtype, op, group)
            with self._activity("MEMCPY_OUT_FUSION_BUFFER"):
                Layout.end_to_end([out.size for out in outputs]).unpack(mine, [out.reshape(-1) for out in outputs])
        postscale = _postscale(request, len(head.members))
        for (_, work), out in zip(batch, outputs):
            halfops.scale_inplace(out.reshape(-1), request.dtype, postscale)
            work.handle.set_result(out)

    def _reducescatter_alone(self, work: Work, out: np.ndarray, counts: list[int], set_rank: int, op: ReduceOp,
                             group: Any) -> None:
        """One reduce-scatter, with no copy of its input unless it must be prescaled out of place: in place when
        the output is this rank's slice of the input itself."""
        request, send = work.request, work.input.reshape(-1)
        start = sum(counts[:set_rank])
        inplace = out.size > 0 and np.shares_memory(send, out)
        if inplace and out.ctypes.data != send[start:].ctypes.data:
            raise ValueError(f"reducescatter {request.name!r}: an output inside the input must be this rank's own "
                             f"slice of it (elements {start}..{start + out.size})")
        if request.prescale != 1.0 and not inplace:
            send = send.copy()
        halfops.scale_inplace(send, request.dtype, request.prescale)
        nans = nan.nan_positions(send, request.dtype) if nan.propagates_nan(request.dtype, op) else None
        recv = send if inplace else (out if out.size else np.empty(0, dtype=send.dtype))  # empty views may alias
        with self._activity(f"{self._engine.name.upper()}_REDUCESCATTER"):
            self._engine.reducescatter(None if inplace else send, recv, counts, request.dtype, op, group)
        if nans is not None:
            flags = np.empty(out.size, dtype=np.uint8)
            self._engine.reducescatter(nans, flags, counts, "uint8", ReduceOp.MAX, group)
            nan.restore_nan(out, request.dtype, flags)


def _engine_op(request: Request) -> ReduceOp:
    """The op the engine runs: Average is a Sum followed by `_postscale`."""
    return ReduceOp.SUM if request.op == ReduceOp.AVERAGE else request.op


def _postscale(request: Request, set_size: int) -> float:
    """The factor applied after the engine's reduction (Average divides by the set's size)."""
    return request.postscale / set_size if request.op == ReduceOp.AVERAGE else request.postscale


def _scatter_counts(response: Response) -> list[int]:
    """Elements of each rank's slice: the request's explicit counts, or Horovod's split of the first dimension."""
    request = response.first
    if request.splits is not None:
        return list(request.splits)
    row = _row_elements(request.shape)
    return [rows * row for rows in balanced_counts(request.shape[0], len(response.members))]


def _scatter_output(response: Response, work: Work, set_rank: int) -> np.ndarray:
    """Where this rank's slice goes: the caller's output, or a new array of the slice's shape."""
    if work.output is not None:
        return work.output
    request = work.request
    if request.splits is not None:
        return np.empty(request.splits[set_rank], dtype=work.input.dtype)
    rows = balanced_counts(request.shape[0], len(response.members))[set_rank]
    return np.empty((rows,) + request.shape[1:], dtype=work.input.dtype)


def _gather_output(response: Response, work: Work) -> np.ndarray:
    """The caller's output, or a new array holding every rank's rows."""
    if work.output is not None:
        return work.output
    rows = sum(r.shape[0] for r in response.requests)
    return np.empty((rows,) + work.request.shape[1:], dtype=work.input.dtype)
