"""The data plane: run agreed responses on the engine, fusing allreduces, and complete handles."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdplus.common.control.messages import Request, Response
from hvdplus.common.control.negotiation import device_kind
from hvdplus.common.data.adasum import adasum_tensors
from hvdplus.common.data.buffer_ops import NUMPY_OPS, BufferOps, DataPlane
from hvdplus.common.data.hierarchical import hierarchical_allgather, hierarchical_allreduce
from hvdplus.common.data.layout import Layout, balanced_counts
from hvdplus.common.data.nan import propagates_nan
from hvdplus.common.engines.base import Engine
from hvdplus.common.engines.waited import Waited
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.handles import Handle, Work
from hvdplus.common.ops import OpKind, ReduceOp
from hvdplus.common.timeline import Timeline
from hvdplus.common.tunables import Tunables

__all__ = ["Submission", "Executor", "even_splits"]

_NO_SPAN = nullcontext()


@dataclass
class Submission:
    """One collective this rank submitted: its announcement, buffers and handle."""

    request: Request
    handle: Handle
    input: Any = None  # a numpy array, or a device plane's tensor (buffer_ops.py)
    output: Any = None
    ready: Any = None  # the device event the input waits for (None on the host)


def even_splits(dim0: int, size: int) -> tuple[int, ...]:
    """Alltoall without splits: dim0 must divide evenly among the ranks."""
    if dim0 % size:
        raise ValueError(
            f"alltoall without splits needs the first dimension ({dim0}) to be divisible by the "
            f"number of ranks ({size}); pass splits=... to send uneven parts"
        )
    return (dim0 // size,) * size


def _row_elements(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape[1:]:
        count *= dim
    return count


class Executor:
    """Executes batches of responses for one rank; `set_of(set_id)` gives the process set (its engine group in
    `.group`, its device planes' groups in `.device_groups`, its hierarchical groups or None in `.hierarchy`);
    `planes` maps a request's device kind to the plane that reduces it (host buffers: the engine itself);
    `tunables` are read at every batch."""

    def __init__(
        self,
        engine: Engine,
        set_of: Callable[[int], Any],
        tunables: Tunables,
        planes: dict[str, DataPlane] | None = None,
    ) -> None:
        self._engine = engine
        self._set_of = set_of
        self._tunables = tunables
        self._planes = planes if planes is not None else {}  # the coordinator's dict: it adds planes as it builds them
        self._host = DataPlane(engine.name, engine, NUMPY_OPS, host=True)
        self._fusion_buffers: dict[tuple[str, Any], Any] = {}
        # Engine calls and the tensors they carried, per device plane (tests check the device path ran, and fused).
        self.plane_runs: dict[str, int] = {}
        self.plane_tensors: dict[str, int] = {}
        self.largest_batch: dict[OpKind, int] = {}  # the most collectives one engine call carried, by kind (tests)
        # Engine calls that ran hierarchically: "allreduce/<cross-host algorithm>" and "allgather" (tests, benches).
        self.hierarchical_runs: dict[str, int] = {}
        self._timeline: Timeline | None = None
        self._traced: list[str] = []  # the tensor names of the batch running now, when a timeline is on
        # What the engine calls' waits call about once a second (control/set_rounds.py sets it for each round's
        # calls: a peer that freezes inside one is named as in a control round).
        self.alive: Callable[[], None] | None = None

    def _wait(self, work: Work) -> None:
        """Wait for an engine call this executor started, as the round it runs in allows (`alive`)."""
        work.wait(self.alive)

    def trace(self, timeline: Timeline | None, names: list[str]) -> None:
        """Record the next batch's activities on `timeline` (None: no timeline) under the tensors' names."""
        self._timeline, self._traced = timeline, names

    def _activity(self, phase: str, plane: DataPlane | None = None) -> AbstractContextManager[None]:
        """A timeline span around one activity of the running batch (`plane`'s engine call: the phase after the
        plane's name); without a timeline a shared no-op, so the hot path makes no generator or name per batch."""
        if self._timeline is None:
            return _NO_SPAN
        return self._span(self._timeline, phase if plane is None else f"{plane.name.upper()}_{phase}")

    @contextmanager
    def _span(self, timeline: Timeline, phase: str) -> Iterator[None]:
        timeline.begin(self._traced, phase)
        try:
            yield
        finally:
            timeline.end(self._traced)

    @contextmanager
    def _substeps(self) -> Iterator[Callable[[str], None]]:
        """A `mark(step)` for the hierarchical functions: each step a span that ends where the next begins; the
        last one ends on exit."""
        timeline, names = self._timeline, self._traced
        opened: list[str] = []
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

    def fail(self, response: Response, work: Submission | None) -> None:
        if work is not None:
            work.handle.set_error(CollectiveMismatchError(response.error))

    def _plane(self, request: Request) -> DataPlane:
        """The plane that reduces a request's buffers: a device plane for its device kind, else the host's."""
        if not self._planes:
            return self._host
        return self._planes.get(device_kind(request.device), self._host)

    @staticmethod
    def _group(plane: DataPlane, process_set: Any) -> Any:
        return process_set.group if plane.host else process_set.device_groups[plane.name]

    def _engine_call(self, plane: DataPlane, works: Sequence[Submission]) -> None:
        """Before a device plane's work reads the inputs: count the call, and make the stream wait for the
        submitters' events."""
        if plane.host:
            return
        self.plane_runs[plane.name] = self.plane_runs.get(plane.name, 0) + 1
        self.plane_tensors[plane.name] = self.plane_tensors.get(plane.name, 0) + len(works)
        for work in works:
            if work.ready is not None:
                work.ready.wait()
                work.ready.used_here(work.input)

    def _complete(self, plane: DataPlane, works: Sequence[Submission], results: Sequence[Any], last: Any) -> None:
        """Hand out the results; on a device, with the event that marks the end of the work writing them."""
        event = None if plane.host else plane.ops.ready(last)
        for work, result in zip(works, results):
            if work.ready is not None:
                work.ready.hand_back(result)
            work.handle.set_result(result, event)

    def run_allreduce(self, batch: list[tuple[Response, Submission]]) -> None:
        """Reduce a batch of agreed allreduces in one engine call (one buffer when fused)."""
        first = batch[0][0].first
        self._count(OpKind.ALLREDUCE, batch)
        if first.op == ReduceOp.ADASUM:
            return self._run_adasum(batch)
        members = batch[0][0].members
        works = [work for _, work in batch]
        plane = self._plane(first)
        ops = plane.ops
        self._engine_call(plane, works)  # before anything reads the inputs
        if len(works) == 1:
            buffer = self._reduce_one(plane, batch[0][0], works[0].input, works[0].output)
        else:
            inputs = [ops.flat(w.input) for w in works]
            buffer = self._fusion_buffer(plane, sum(ops.numel(i) for i in inputs), inputs[0])
            with self._activity("MEMCPY_IN_FUSION_BUFFER"):
                ops.pack(inputs, buffer)
            self._reduce(plane, buffer, first, len(members), self._set_of(batch[0][0].key[0]), None)
            outputs = [flat if w.output is w.input else ops.flat(w.output) for flat, w in zip(inputs, works)]
            with self._activity("MEMCPY_OUT_FUSION_BUFFER"):
                ops.unpack(buffer, outputs)
        self._complete(plane, works, [work.output for work in works], buffer)

    def reduce_alone(self, response: Response, input: np.ndarray, output: np.ndarray) -> None:
        """One agreed allreduce (not Adasum) of host buffers, reduced into `output`: what `run_allreduce` does for a
        batch of one, without a submission to complete (set_rounds.py's lone lane)."""
        self._count(OpKind.ALLREDUCE, [response])
        self._reduce_one(self._host, response, input, output)

    def _reduce_one(self, plane: DataPlane, response: Response, input: Any, output: Any) -> Any:
        """Reduce one collective's `input` into `output`, with no fusion buffer; `output`'s flat view."""
        ops = plane.ops
        buffer = ops.flat(output)
        source = None if input is output else ops.flat(input)
        self._reduce(plane, buffer, response.first, len(response.members), self._set_of(response.key[0]), source)
        return buffer

    def _run_adasum(self, batch: list[tuple[Response, Submission]]) -> None:
        """Adasum of the batch's tensors (hvdplus.common.data.adasum), each with its own dot product and norms."""
        response, works = batch[0][0], [work for _, work in batch]
        adasum_tensors(
            Waited(self._engine, self.alive),
            self._group_of(response.key[0]),
            response.members.index(self._engine.rank),
            len(response.members),
            [w.input for w in works],
            [w.output for w in works],
            response.first.dtype,
            response.first.prescale,
            response.first.postscale,
        )
        for work in works:
            work.handle.set_result(work.output)

    def _reduce(
        self, plane: DataPlane, buffer: Any, request: Request, set_size: int, process_set: Any, source: Any
    ) -> None:
        """Reduce `source` (or `buffer` itself) into `buffer`; an unscaled flat allreduce skips the copy."""
        ops, group = plane.ops, self._group(plane, process_set)
        hierarchical = plane.host and self._tunables.hierarchical_allreduce and process_set.hierarchy is not None
        if source is not None and (request.prescale != 1.0 or hierarchical):
            ops.copy(buffer, source)
            source = None
        if request.prescale != 1.0:
            ops.scale(buffer, request.dtype, request.prescale)
        op = _engine_op(request)
        nans = (
            ops.nan_positions(buffer if source is None else source, request.dtype)
            if propagates_nan(request.dtype, op)
            else None
        )
        if hierarchical:
            with self._activity("HIERARCHICAL_ALLREDUCE"), self._substeps() as mark:
                ran = hierarchical_allreduce(
                    Waited(self._engine, self.alive),
                    process_set.hierarchy,
                    buffer,
                    request.dtype,
                    op,
                    self._tunables.cross_algorithm,
                    mark,
                    self._tunables.hierarchical_chunk_bytes,
                )
            self._ran_hierarchical(f"allreduce/{ran}")
        else:
            with self._activity("ALLREDUCE", plane):
                self._wait(plane.engine.start_allreduce(buffer, request.dtype, op, group, send=source))
        if nans is not None:
            self._wait(plane.engine.start_allreduce(nans, "uint8", ReduceOp.MAX, group))
            ops.restore_nan(buffer, request.dtype, nans)
        postscale = _postscale(request, set_size)
        if postscale != 1.0:
            ops.scale(buffer, request.dtype, postscale)

    def _allgather(self, plane: DataPlane, send: Any, recv: Any, counts: list[int], process_set: Any) -> None:
        """The engine's allgather, or Horovod's hierarchical one where it is on and the hosts' ranks are
        consecutive in the set (host buffers only)."""
        hierarchy = process_set.hierarchy
        if plane.host and self._tunables.hierarchical_allgather and hierarchy is not None and hierarchy.contiguous:
            with self._activity("HIERARCHICAL_ALLGATHER"), self._substeps() as mark:
                hierarchical_allgather(Waited(self._engine, self.alive), hierarchy, send, recv, counts, mark)
            self._ran_hierarchical("allgather")
        else:
            with self._activity("ALLGATHER", plane):
                self._wait(plane.engine.start_allgather(send, recv, counts, self._group(plane, process_set)))

    def _fusion_buffer(self, plane: DataPlane, count: int, like: Any) -> Any:
        """The plane's reusable fusion buffer for `like`'s storage type, at least `count` elements long."""
        key = (plane.name, like.dtype)
        buffer = self._fusion_buffers.get(key)
        if buffer is None or plane.ops.numel(buffer) < count:
            buffer = plane.ops.empty((count,), like)
            self._fusion_buffers[key] = buffer
        return buffer[:count]

    def run_broadcast(self, response: Response, work: Submission) -> None:
        """Copy the root's tensor to every member, on the plane of the tensor's device."""
        request = work.request
        plane = self._plane(request)
        root = response.members.index(request.root)  # the request names a global rank; the group, its index
        self._engine_call(plane, [work])  # before the root reads its input
        if response.members[root] == self._engine.rank and work.input is not work.output:
            plane.ops.copy(work.output, work.input)
        with self._activity("BROADCAST", plane):
            group = self._group(plane, self._set_of(response.key[0]))
            self._wait(plane.engine.start_broadcast(plane.ops.flat(work.output), root, group))
        self._complete(plane, [work], [work.output], work.output)

    def run(self, response: Response, work: Submission, set_rank: int) -> Any:
        """Run one alltoall or barrier (host buffers); return the handle's result."""
        group = self._group_of(response.key[0])
        if response.kind == OpKind.ALLTOALL:
            return self._alltoall(response.announced, work, set_rank, group)
        if response.kind == OpKind.BARRIER:
            self._wait(self._engine.start_barrier(group))
            return None
        raise RuntimeError(f"executor cannot run {response.kind.name}")

    def _alltoall(self, requests: Sequence[Request], work: Submission, set_rank: int, group: Any) -> Any:
        row = _row_elements(work.request.shape)
        splits = [r.splits or even_splits(r.shape[0], len(requests)) for r in requests]
        recv_rows = [splits[src][set_rank] for src in range(len(requests))]
        out = np.empty((sum(recv_rows),) + work.request.shape[1:], dtype=work.input.dtype)
        started = self._engine.start_alltoall(
            work.input.reshape(-1),
            [s * row for s in splits[set_rank]],
            out.reshape(-1),
            [r * row for r in recv_rows],
            group,
        )
        self._wait(started)
        return out, np.asarray(recv_rows, dtype=np.int32)

    def run_allgather(self, batch: list[tuple[Response, Submission]]) -> None:
        """Gather a batch of agreed allgathers in one engine call: each rank's parts of every tensor travel as one
        block (layout.py). A lone allgather writes straight into its output (the caller's, if given), in
        place when this rank's input already sits at its offset there."""
        head = batch[0][0]
        self._count(OpKind.ALLGATHER, batch)
        plane = self._plane(head.first)
        ops, works = plane.ops, [work for _, work in batch]
        set_rank, process_set = head.members.index(self._engine.rank), self._set_of(head.key[0])
        layout = Layout([[r.nelements for r in response.announced] for response, _ in batch])
        outputs = [_gather_output(ops, response, work) for response, work in batch]
        self._engine_call(plane, works)
        if len(batch) == 1:
            work, out, counts = works[0], ops.flat(outputs[0]), layout.counts[0]
            inplace = counts[set_rank] > 0 and ops.same_start(work.input, out[sum(counts[:set_rank]) :])
            # A rank with nothing to send passes a buffer of its own: an empty view may alias `out` (MPICH refuses).
            send = ops.flat(work.input) if counts[set_rank] else ops.empty((0,), out)
            self._allgather(plane, None if inplace else send, out, counts, process_set)
            buffer = out
        else:
            inputs = [ops.flat(work.input) for work in works]
            with self._activity("MEMCPY_IN_FUSION_BUFFER"):
                mine = ops.empty((layout.rank_totals[set_rank],), inputs[0])
                ops.pack(inputs, mine)
            buffer = self._fusion_buffer(plane, layout.total, mine)
            self._allgather(plane, mine, buffer, layout.rank_totals, process_set)
            with self._activity("MEMCPY_OUT_FUSION_BUFFER"):
                layout.unpack(buffer, [ops.flat(out) for out in outputs])
        self._complete(plane, works, outputs, buffer)

    def run_reducescatter(self, batch: list[tuple[Response, Submission]]) -> None:
        """Reduce-scatter a batch of agreed requests in one engine call: the inputs are packed rank-major
        (layout.py), so each rank receives its slices of every tensor as one block."""
        head = batch[0][0]
        self._count(OpKind.REDUCESCATTER, batch)
        request = head.first
        plane = self._plane(request)
        ops, works = plane.ops, [work for _, work in batch]
        set_rank, group = head.members.index(self._engine.rank), self._group(plane, self._set_of(head.key[0]))
        layout = Layout([_scatter_counts(response) for response, _ in batch])
        outputs = [_scatter_output(ops, response, work, set_rank) for response, work in batch]
        op = _engine_op(request)
        self._engine_call(plane, works)
        if len(batch) == 1:
            self._reducescatter_alone(plane, works[0], ops.flat(outputs[0]), layout.counts[0], set_rank, op, group)
        else:
            inputs = [ops.flat(work.input) for work in works]
            buffer = self._fusion_buffer(plane, layout.total, inputs[0])
            with self._activity("MEMCPY_IN_FUSION_BUFFER"):
                layout.pack(inputs, buffer)
            ops.scale(buffer, request.dtype, request.prescale)
            mine = ops.empty((layout.rank_totals[set_rank],), buffer)
            with self._activity("REDUCESCATTER", plane):
                self._wait(plane.engine.start_reducescatter(buffer, mine, layout.rank_totals, request.dtype, op, group))
            with self._activity("MEMCPY_OUT_FUSION_BUFFER"):
                ops.unpack(mine, [ops.flat(out) for out in outputs])
        postscale = _postscale(request, len(head.members))
        for out in outputs:
            ops.scale(ops.flat(out), request.dtype, postscale)
        self._complete(plane, works, outputs, outputs[-1])

    def _reducescatter_alone(
        self, plane: DataPlane, work: Submission, out: Any, counts: list[int], set_rank: int, op: ReduceOp, group: Any
    ) -> None:
        """One reduce-scatter, with no copy of its input unless it must be prescaled out of place: in place when
        the output is this rank's slice of the input itself."""
        ops, engine = plane.ops, plane.engine
        request, send = work.request, ops.flat(work.input)
        start, size = sum(counts[:set_rank]), ops.numel(out)
        inplace = size > 0 and ops.overlaps(send, out)
        if inplace and not ops.same_start(out, send[start:]):
            raise ValueError(
                f"reducescatter {request.name!r}: an output inside the input must be this rank's own "
                f"slice of it (elements {start}..{start + size})"
            )
        if request.prescale != 1.0 and not inplace:
            copy = ops.empty((ops.numel(send),), send)
            ops.copy(copy, send)
            send = copy
        ops.scale(send, request.dtype, request.prescale)
        nans = ops.nan_positions(send, request.dtype) if propagates_nan(request.dtype, op) else None
        recv = send if inplace else (out if size else ops.empty((0,), send))  # empty views may alias
        with self._activity("REDUCESCATTER", plane):
            self._wait(engine.start_reducescatter(None if inplace else send, recv, counts, request.dtype, op, group))
        if nans is not None:
            flags = ops.empty((size,), nans)
            self._wait(engine.start_reducescatter(nans, flags, counts, "uint8", ReduceOp.MAX, group))
            ops.restore_nan(out, request.dtype, flags)


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


def _scatter_output(ops: BufferOps, response: Response, work: Submission, set_rank: int) -> Any:
    """Where this rank's slice goes: the caller's output, or a new buffer of the slice's shape."""
    if work.output is not None:
        return work.output
    request = work.request
    if request.splits is not None:
        return ops.empty((request.splits[set_rank],), work.input)
    rows = balanced_counts(request.shape[0], len(response.members))[set_rank]
    return ops.empty((rows,) + request.shape[1:], work.input)


def _gather_output(ops: BufferOps, response: Response, work: Submission) -> Any:
    """The caller's output, or a new buffer holding every rank's rows."""
    if work.output is not None:
        return work.output
    rows = sum(r.shape[0] for r in response.announced)
    return ops.empty((rows,) + work.request.shape[1:], work.input)
