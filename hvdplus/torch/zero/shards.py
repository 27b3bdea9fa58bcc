"""What a ZeroOptimizer owns besides its optimizer: the flat parameter and gradient sequences (Flat), the buckets
reduce-scattered from the backward hooks (Bucket) and Shards, which runs them: the reduce-scatters as backward goes
on, the step's frozen plan (shard_plan.py), offloading to the host, the allgather of the updated shards and the
global gradient norm. optimizer.py wraps the user's optimizer around a Shards."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, runtime
from hvdplus.common.ops import ReduceOp
from hvdplus.common.planned_steps import open_planned_group, settings_allow
from hvdplus.common.plans.sharding import DtypePartition, bucket_ranges, counts_within, partition
from hvdplus.common.plans.step_plan import Decision
from hvdplus.torch._optimizer import (
    TOO_MANY_PASSES,
    AllreduceInFlightError,
)
from hvdplus.torch.buffers import as_numpy, collective_input, copy_back, dtype_name, plane_kind
from hvdplus.torch.compression import Compressor
from hvdplus.torch.planned.planned import freeze_plan, wire_dtype
from hvdplus.torch.streams import SideStream, host_empty, wait_for
from hvdplus.torch.zero.shard_plan import ShardPlan

__all__ = ["Bucket", "Flat", "Shards"]


class Flat:
    """One flat sequence of parameters as the optimizer sees it: `part` over the optimizer's parameter list,
    `master` holding this rank's range (from flat offset `base`), and this rank's gradient shard. `full`: the
    whole flat buffer the updated shards are allgathered into after a step (stage 1/2, and ZeRO-3's persistent
    parameters); None for a ZeRO-3 unit, gathered when its forward next needs it. `unit`: that ZeRO-3 unit."""

    __slots__ = ("part", "master", "base", "full", "unit", "grad", "reduce_dtype", "device", "stepped", "stepped_base")

    def __init__(
        self,
        part: DtypePartition[torch.dtype],
        master: torch.Tensor,
        base: int,
        full: torch.Tensor | None,
        grad_elements: int,
        device: torch.device,
        unit: Any = None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        """`device`: where the gradients come from and the buckets live (the model's)."""
        self.part, self.master, self.base, self.full, self.unit = part, master, base, full, unit
        self.device, self.reduce_dtype = device, reduce_dtype
        # What the wrapped optimizer steps, from flat offset `stepped_base`: the master itself, or (offload) a
        # host copy of this rank's range of it.
        self.stepped, self.stepped_base = master, base
        self.grad = torch.zeros(grad_elements, dtype=master.dtype, device=master.device)

    def offload(self, index: int) -> None:
        """Step this rank's range on the host: a pinned copy of it, and the gradient shard beside it (a master
        already in host memory, a ZeRO-3 unit offloaded with its parameters, is stepped where it is)."""
        if getattr(self.unit, "offload", None) == "parameters":
            return
        start, end = self.part.shard(index)
        mine = self.master[start - self.base : end - self.base]
        self.stepped, self.stepped_base = host_empty(end - start, mine.dtype, mine.device), start
        self.stepped.copy_(mine)
        self.grad = host_empty(self.grad.numel(), self.grad.dtype, mine.device).zero_()

    def refresh(self, index: int) -> None:
        """Offload, before the host step: take this rank's range of the master again, so that every write to the
        parameters since the last step (broadcast_parameters, load_state_dict, torch.nn.init, p.data.copy_, a
        ZeRO-3 load, an elastic restore) reaches the step. A version counter cannot tell: `p.data.copy_` and the
        host collectives' writes through numpy views do not bump it. After a step the copy is exact (same dtype)."""
        if self.offloaded:
            start, end = self.part.shard(index)
            self.stepped.copy_(self.master[start - self.base : end - self.base])

    @property
    def offloaded(self) -> bool:
        return self.stepped is not self.master

    def step_done(self, index: int) -> None:
        """After the optimizer stepped the host copy: copy it back into the master's range (asynchronously from
        pinned memory; the stream that gathers it next is the one that copied)."""
        if self.offloaded:
            start, end = self.part.shard(index)
            self.master[start - self.base : end - self.base].copy_(self.stepped, non_blocking=True)


class Bucket:
    """A run of whole parameters of one flat sequence, reduce-scattered together once per backward pass from a
    transient buffer (the only full-size gradient memory, alive from its first gradient to its reduce-scatter)."""

    __slots__ = ("flat", "start", "end", "params", "written", "fills", "buffer", "ready")

    def __init__(self, flat: int, start: int, end: int, params: tuple[int, ...]) -> None:
        self.flat, self.start, self.end, self.params = flat, start, end, params
        self.written: set[int] = set()  # parameters whose gradient is in the current fill
        self.fills = 0  # reduce-scatters started since the last step
        self.buffer: torch.Tensor | None = None
        self.ready = False  # planned: full, waiting for the buckets before it in plan order to start


@dataclasses.dataclass(slots=True)
class ReduceScatter:
    """A bucket fill's reduce-scatter in flight: `received` is what the core writes this rank's slice (`offset`,
    `count`) into, `sent` itself or its staged host copy; `plan` the frozen plan that started it, or None."""

    bucket: Bucket
    handle: Any
    sent: torch.Tensor
    received: Any
    ctx: Any
    offset: int
    count: int
    buffer: torch.Tensor
    plan: ShardPlan | None


class Shards:
    """The flat sequences, buckets and shard parameters of one ZeroOptimizer (everything but the optimizer).

    Stage 1/2 (`sharded` None): one flat sequence per dtype of all trainable parameters, which become views of
    a persistent flat buffer. ZeRO-3 (`sharded`, zero3.py): one per trainable partition of each unit; the unit
    owns the shard and gathers the whole unit when its forward needs it."""

    def __init__(
        self,
        params: list[torch.Tensor],
        names: list[str],
        group_of: list[int],
        compression: Compressor,
        passes: int,
        process_set: ProcessSet,
        device: torch.device,
        offload: str | None = None,
        sharded: Any = None,
    ) -> None:
        """`device`: the parameters' (checked to be one). `offload`: None, or "optimizer" (see the module)."""
        self.params, self.names, self.group_of = params, names, group_of
        self.compression, self.passes, self.process_set = compression, passes, process_set
        self.size, self.index = process_set.size(), process_set.rank()
        self.sharded, self.device = sharded, device
        self.flats = self._zero3_flats() if sharded is not None else self._flat_buffers()
        if offload == "optimizer":
            for flat in self.flats:
                flat.offload(self.index)
        # Offload: the gradient slices' copies to the host run on this stream, beside the backward; `copies`
        # holds (event, pinned slice, its gradient shard's range) until synchronize() adds them.
        self.copy_stream = SideStream(device)
        self.copies: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self.returned: Any = None  # offload: the event after the masters' last copy back to the device
        self.plan = [flat.part for flat in self.flats]
        self.where: dict[int, tuple[int, int]] = {}  # parameter index -> (flat, offset)
        for k, part in enumerate(self.plan):
            for i, offset in zip(part.params, part.offsets):
                self.where[i] = (k, offset)
        self.shapes = [p.shape if sharded is None else sharded.shape_of(p) for p in params]
        self.numels = [shape.numel() for shape in self.shapes]
        bucket_bytes = runtime().bucket_bytes
        self.buckets = []
        for k, flat in enumerate(self.flats):
            ranges = (
                [(0, flat.part.total, flat.part.params)]
                if flat.unit is not None and not flat.unit.persistent
                else bucket_ranges(flat.part, flat.master.element_size(), bucket_bytes)
            )
            self.buckets += [Bucket(k, start, end, members) for start, end, members in ranges]
        self.bucket_of = {i: bucket for bucket in self.buckets for i in bucket.params}
        self.unit_buckets: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            if self.flats[bucket.flat].unit is not None:
                self.unit_buckets.setdefault(id(self.flats[bucket.flat].unit), []).append(bucket)
        self.passes_done = [0] * len(params)
        # Reduce-scatters in flight before the oldest is finished and its buffer freed: two buckets, or one ZeRO-3
        # unit (a unit's backward takes far longer than its reduce-scatter, so one overlaps it already).
        self.in_flight_limit = 1 if sharded is not None else 2
        self.in_flight: list[ReduceScatter] = []
        self.spares: list[tuple[torch.Tensor, Any]] = []  # (buffer, the event its last reader ends at)
        # The planned path (stages 1 and 2, one backward pass a step): once every rank agrees after a negotiated
        # step, the buckets' reduce-scatters start in plan order on a communicator of the plan's own.
        self.frozen: ShardPlan | None = None
        self.freeze = Decision.RETRY if sharded is None and passes == 1 else Decision.NEVER
        self.next_bucket = 0  # planned: the first bucket not started this step
        self.differs: list[str] = []  # planned: how this rank's step differs from the plan (a changed model)
        # Stage 1/2: where each parameter's data is, a view of its flat buffer (a rebound parameter raises).
        self.addresses = [p.data_ptr() for p in params] if sharded is None else []
        # The shard parameters: one per parameter piece in this rank's range, shaped like the parameter when the
        # piece is all of it (a 0-d one stays 1-D: 0-d state means one value per shard, like Adam's step). The
        # wrapped optimizer then sees the tensors it would see unsharded (per-tensor rules such as LAMB's trust
        # ratio hold, and its temporaries are no bigger than one parameter), except for the parameters that
        # straddle a rank boundary, which it sees as 1-D pieces.
        self.shards: list[tuple[int, int, int, int]] = []  # (flat, group, start, end)
        self.shard_shapes: list[torch.Size] = []
        for k, part in enumerate(self.plan):
            for piece in part.pieces(*part.shard(self.index)):
                whole = piece.length == self.numels[piece.param] and len(self.shapes[piece.param]) > 0
                self.shards.append((k, group_of[piece.param], piece.offset, piece.offset + piece.length))
                self.shard_shapes.append(self.shapes[piece.param] if whole else torch.Size([piece.length]))
        self.shard_params = [torch.nn.Parameter(view) for view in self.shard_views("master")]
        self.synchronized = False

    def _flat_buffers(self) -> list[Flat]:
        """Stage 1/2: the parameters become views of one flat buffer per dtype; the shard is its own range."""
        params = self.params
        flats = []
        for part in partition([p.numel() for p in params], [p.dtype for p in params], self.size):
            buffer = torch.empty(part.total, dtype=part.kind, device=self.device)
            with torch.no_grad():
                for i, offset in zip(part.params, part.offsets):
                    view = buffer[offset : offset + params[i].numel()]
                    view.copy_(params[i].detach().reshape(-1))
                    params[i].data = view.view_as(params[i])
            flats.append(Flat(part, buffer, 0, buffer, part.counts[self.index], self.device))
        return flats

    def _zero3_flats(self) -> list[Flat]:
        """ZeRO-3: each unit's trainable partitions, over the optimizer's indices of the unit's parameters."""
        position = {id(p): i for i, p in enumerate(self.params)}
        covered = {id(p) for unit in self.sharded.units for p in unit.params}
        strangers = [self.names[i] for i, p in enumerate(self.params) if id(p) not in covered]
        if strangers:
            raise ValueError(
                f"ZeroOptimizer over a model sharded by hvd.shard_parameters takes that model's "
                f"parameters only; {strangers[:3]} are not among them (use a second optimizer)"
            )
        flats = []
        for unit in self.sharded.units:
            for k, part in enumerate(unit.plan):
                dtype, trainable = part.kind
                if not trainable:
                    continue
                missing = [unit.names[j] for j in part.params if id(unit.params[j]) not in position]
                if missing:
                    raise ValueError(
                        f"ZeroOptimizer over a model sharded by hvd.shard_parameters steps all of its "
                        f"trainable parameters; the optimizer lacks {missing[:3]}"
                    )
                ours = dataclasses.replace(
                    part, kind=dtype, params=tuple(position[id(unit.params[j])] for j in part.params)
                )
                flats.append(
                    Flat(
                        ours,
                        unit.shards[k],
                        part.bounds[self.index],
                        unit.full[k] if unit.persistent else None,
                        part.counts[self.index],
                        self.device,
                        unit,
                        self.sharded.reduce_dtype,
                    )
                )
        return flats

    def shard_views(self, which: str) -> list[torch.Tensor]:
        """This rank's shard pieces of the flat sequences' `which` ("master" or "grad"), in shard order."""
        views = []
        for (k, _, start, end), shape in zip(self.shards, self.shard_shapes):
            flat = self.flats[k]
            whole, base = (
                (flat.stepped, flat.stepped_base) if which == "master" else (flat.grad, flat.part.bounds[self.index])
            )
            views.append(whole[start - base : end - base].view(shape))
        return views

    # ------------------------------------------------------------------ backward
    def gradient_ready(self, i: int) -> None:
        """Hook body: add p.grad into its bucket's buffer and free it; start the bucket once it is full."""
        self._drop_closed_plan()
        p, bucket = self.params[i], self.bucket_of[i]
        if self.passes_done[i] >= self.passes:
            raise AllreduceInFlightError(TOO_MANY_PASSES)
        grad = p.grad
        assert grad is not None  # a post-accumulate-grad hook runs once p.grad is set
        wrong = None
        if grad.is_sparse:
            wrong = (
                f"ZeroOptimizer shards dense gradients only; parameter {self.names[i]!r} has a sparse "
                f"one (use DistributedOptimizer for sparse embeddings)"
            )
            if self.frozen is None:
                raise TypeError(wrong)
        elif self.frozen is not None and (grad.numel() != self.numels[i] or grad.dtype != self.params[i].dtype):
            wrong = f"parameter {self.names[i]!r} has a {grad.dtype} gradient of {grad.numel()} elements"
        if i in bucket.written:  # a second pass reached it before the rest of the bucket: send what is there
            self.start(bucket)
        if bucket.buffer is None:
            bucket.buffer = self.bucket_buffer(bucket)
        k, offset = self.where[i]
        offset -= bucket.start
        if wrong is None:
            with torch.no_grad():
                bucket.buffer[offset : offset + grad.numel()].copy_(grad.reshape(-1))
        else:  # planned: the step goes on with zeros, and its guard makes every rank raise, naming this one
            self.differs.append(wrong)
            bucket.buffer[offset : offset + self.numels[i]].zero_()
        p.grad = None
        bucket.written.add(i)
        self.passes_done[i] += 1
        if self.frozen is not None:  # MPI moves a non-blocking collective only inside its calls
            for entry in self.in_flight:
                self.frozen.poke(entry.handle)
        if len(bucket.written) == len(bucket.params):
            self.start(bucket)

    def start(self, bucket: Bucket) -> None:
        """Send one fill of a bucket now, or on the planned path once the buckets before it in plan order have
        started (every rank then starts the same reduce-scatters in the same order)."""
        if self.frozen is None:
            self._send(bucket)
            return
        bucket.ready = True
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].ready:
            self._send(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _send(self, bucket: Bucket) -> None:
        """Reduce-scatter one fill of a bucket (zeros for parameters that got no gradient in it) from its
        buffer: this rank's slice of the buffer receives the average over the set."""
        flat = self.flats[bucket.flat]
        if bucket.buffer is None:
            bucket.buffer = self.bucket_buffer(bucket)
        for i in bucket.params:
            if i not in bucket.written:
                offset = self.where[i][1] - bucket.start
                bucket.buffer[offset : offset + self.numels[i]].zero_()
        while len(self.in_flight) >= self.in_flight_limit:
            self.finish(self.in_flight.pop(0))
        counts = counts_within(flat.part.bounds, bucket.start, bucket.end)
        offset, count = sum(counts[: self.index]), counts[self.index]
        sent, ctx = self.compression.compress(bucket.buffer)
        array, device = collective_input(sent)  # on the tensors' device plane where the job has one
        unit = flat.unit
        if unit is not None and not unit.persistent:
            name, tag = self.sharded.next_name(), f"gradients of unit {unit.name!r}"
        else:
            name, tag = f"ZeroOptimizer.{self.names[bucket.params[0]]}.{bucket.fills}", ""
        plan = self.frozen
        handle: Any
        if plan is not None:
            handle = plan.reducescatter(sent, counts, name)  # the sum: finish() averages this rank's slice
        else:
            handle = core.submit_reducescatter(
                array,
                dtype_name(sent),
                name,
                ReduceOp.AVERAGE,
                process_set=self.process_set,
                counts=counts,
                output=array[offset : offset + count],
                tag=tag,
                device=device,
            )
        self.in_flight.append(ReduceScatter(bucket, handle, sent, array, ctx, offset, count, bucket.buffer, plan))
        bucket.buffer, bucket.fills = None, bucket.fills + 1
        bucket.written = set()
        if (
            unit is not None
            and not unit.persistent
            and all(b.fills == bucket.fills for b in self.unit_buckets[id(unit)])
        ):
            self.sharded.gradients_sent(unit)

    def bucket_buffer(self, bucket: Bucket) -> torch.Tensor:
        """A buffer for one fill of `bucket`: a spare one of its size, else a new one."""
        flat = self.flats[bucket.flat]
        dtype = flat.reduce_dtype or flat.master.dtype
        for n, (spare, read) in enumerate(self.spares):
            if spare.numel() == bucket.end - bucket.start and spare.dtype == dtype:
                del self.spares[n]
                wait_for(read, flat.device)  # its copy to the host (offload) has read it
                return spare
        return torch.empty(bucket.end - bucket.start, dtype=dtype, device=flat.device)

    def finish(self, entry: ReduceScatter) -> None:
        """Wait for one reduce-scatter, add this rank's averaged slice into its gradient shard, and keep the
        buffer as a spare (ZeRO-3's equal units then reuse two buffers instead of faulting in fresh pages for
        each; the spares go at step())."""
        sent, offset, count = entry.sent, entry.offset, entry.count
        if entry.plan is None:
            entry.handle.wait()
            copy_back(entry.received[offset : offset + count], sent[offset : offset + count])  # a staged copy's
        else:
            entry.plan.wait(entry.handle)
            with torch.no_grad():  # on the wire's dtype, as Horovod averages a compressed gradient
                sent[offset : offset + count].mul_(1.0 / self.size)
        read = None
        if count:
            flat = self.flats[entry.bucket.flat]
            mine = self.compression.decompress(sent[offset : offset + count], entry.ctx)
            first = max(entry.bucket.start, flat.part.bounds[self.index]) - flat.part.bounds[self.index]
            target = flat.grad[first : first + count]
            with torch.no_grad():
                if target.device == mine.device and not flat.offloaded:
                    target.add_(mine)
                else:  # offload: to the host beside the backward; synchronize() adds it
                    with self.copy_stream.after_current():
                        staged = host_empty(count, mine.dtype, mine.device)
                        staged.copy_(mine, non_blocking=True)
                    self.copy_stream.reads(mine)
                    read = self.copy_stream.record()
                    self.copies.append((read, staged, target))
        if len(self.spares) < self.in_flight_limit + 1:
            self.spares.append((entry.buffer, read))

    def finish_in_flight(self) -> None:
        while self.in_flight:
            self.finish(self.in_flight.pop(0))
        copies, self.copies = self.copies, []
        with torch.no_grad():
            for event, staged, target in copies:
                if event is not None:
                    event.synchronize()
                target.add_(staged.to(target.dtype))

    # ------------------------------------------------------------------ step
    def synchronize(self) -> None:
        """Send the buckets' partial fills, bring every bucket to `passes` reduce-scatters (the same number on
        every rank, whichever gradients each produced), wait for them all, and point the shard parameters'
        gradients at this rank's averaged slices. Collective."""
        self._drop_closed_plan()
        try:
            if self.frozen is not None:
                self._synchronize_planned(self.frozen)
            else:
                rebound = self.rebound()
                if rebound:  # what backward started completes first; the other ranks fail on this rank's exit
                    self.finish_in_flight()
                    raise RuntimeError(f"{rebound[0]}; write into it in place instead: p.data.copy_(t)")
                for bucket in self.buckets:
                    if bucket.written:
                        self.start(bucket)
                    while bucket.fills < self.passes:
                        self.start(bucket)
                self.finish_in_flight()
        except BaseException:
            if self.frozen is not None and self.frozen.closed:  # the step failed on every rank, or the engine
                self.frozen = None
            raise
        finally:
            for bucket in self.buckets:
                bucket.fills, bucket.written, bucket.buffer, bucket.ready = 0, set(), None, False
            self.in_flight, self.spares = [], []
            self.passes_done = [0] * len(self.params)
            self.next_bucket, self.differs = 0, []
        for shard, grad in zip(self.shard_params, self.shard_views("grad")):
            shard.grad = grad
        self.synchronized = True
        if self.frozen is None and self.freeze == Decision.RETRY and self.size > 1:
            self._try_freeze()

    def _drop_closed_plan(self) -> None:
        """A plan that ended outside a step (join() served its last step, a new job): negotiate again."""
        if self.frozen is not None and self.frozen.stale and not self.in_flight:
            self.frozen.close()
            self.frozen = None

    def _synchronize_planned(self, plan: ShardPlan) -> None:
        """Start the buckets backward left (their missing gradients are zeros), then the guard; wait; and raise
        on every rank alike if a rank's step differed or a rank is in join()."""
        for bucket in self.buckets:
            if not bucket.fills:
                self.start(bucket)
        differs = self.differs + self.rebound()
        plan.start_guard(bool(differs))
        self.finish_in_flight()
        plan.check_guard(differs)

    def rebound(self) -> list[str]:
        """Stage 1/2: the parameters no longer views of their flat buffers (`p.data = t` after wrapping), named."""
        return [
            f"parameter {self.names[i]!r} no longer is the view of ZeroOptimizer's flat buffer it was"
            for i, (p, address) in enumerate(zip(self.params, self.addresses))
            if p.data_ptr() != address or p.dtype != self.flats[self.where[i][0]].master.dtype
        ]

    def _try_freeze(self) -> None:
        """After a negotiated step (collective): freeze the plan if every rank can, with the same buckets."""
        carried, wire = wire_dtype(self.compression)
        on_device = bool(self.params) and plane_kind(self.params[0]) is not None
        eligible = carried and settings_allow(on_device=on_device)
        items = [
            "ZeroOptimizer",
            wire,
            [(bucket.flat, bucket.start, bucket.end) for bucket in self.buckets],
            [tuple(flat.part.bounds) for flat in self.flats],
            [(name, tuple(p.shape), p.dtype) for name, p in zip(self.names, self.params)],
        ]
        name = f"hvdplus.zero_plan_agreement.{self.names[0] if self.names else ''}"
        frozen = freeze_plan(self.params, eligible, items, name, self.process_set)
        if isinstance(frozen, Decision):
            self.freeze = frozen
            return
        engine, group, ranks, digest, host = frozen
        # A device plane's guard is summed on the host engine (shard_plan.py says why).
        guard_group = None if host else open_planned_group(runtime().engine, ranks, self.process_set)
        specs = []
        for bucket in self.buckets:
            flat = self.flats[bucket.flat]
            reduced = flat.reduce_dtype or flat.master.dtype
            specs.append(
                (bucket.end - bucket.start, wire or reduced, counts_within(flat.part.bounds, bucket.start, bucket.end))
            )
        self.frozen = ShardPlan(engine, group, ranks, digest, host, specs, self.device, guard_group)

    def host_step_ready(self) -> None:
        """Offload: the last step's copies of the host masters to the device have read them (the optimizer is
        about to write them again), and the host masters hold the parameters as they are now (Flat.refresh)."""
        if self.returned is not None:
            self.returned.synchronize()
            self.returned = None
        for flat in self.flats:
            flat.refresh(self.index)

    def stepped(self) -> None:
        """After the optimizer's step: offloaded masters go back to the device, on the stream that gathers them."""
        if any(flat.offloaded for flat in self.flats):
            for flat in self.flats:
                flat.step_done(self.index)
            self.returned = torch.cuda.Event() if self.device.type == "cuda" else None
            if self.returned is not None:
                self.returned.record()

    def shard_grads(self) -> list[torch.Tensor]:
        """The shard parameters' gradients, which synchronize() points at this rank's reduced slices."""
        grads = []
        for shard in self.shard_params:
            assert shard.grad is not None, "the gradients are synchronized first"
            grads.append(shard.grad)
        return grads

    def clear_gradients(self) -> None:
        """Zero the gradient shards (after a step consumed them, or when zero_grad discards them)."""
        for flat in self.flats:
            flat.grad.zero_()

    def gather(self) -> None:
        """Allgather every rank's updated shard into the whole flat buffers that persist (stage 1/2 and ZeRO-3's
        persistent parameters), in place. Collective."""
        if self.frozen is not None:  # the step's guard showed every rank training: all of them gather
            requests = []
            for flat in self.flats:
                if flat.full is not None:
                    start, end = flat.part.shard(self.index)
                    if flat.master.data_ptr() != flat.full.data_ptr():
                        flat.full[start:end] = flat.master.to(flat.full.dtype)
                    name = f"ZeroOptimizer.gather.{self.names[flat.part.params[0]]}"
                    requests.append(self.frozen.allgather(flat.full, flat.part.counts, name))
            for request in requests:
                self.frozen.wait(request)
            return
        handles = []
        for flat in self.flats:
            if flat.full is None:
                continue
            part = flat.part
            start, end = part.shard(self.index)
            full, device = collective_input(flat.full)
            if flat.master.data_ptr() == flat.full.data_ptr():
                sent = full[start:end]
            else:
                sent = collective_input(flat.master.to(flat.full.dtype))[0]
            handle = core.submit_allgather(
                sent,
                dtype_name(flat.full),
                f"ZeroOptimizer.gather.{self.names[part.params[0]]}",
                process_set=self.process_set,
                counts=part.counts,
                output=full,
                device=device,
            )
            handles.append((handle, sent, full, flat.full))  # `sent` lives until the gather is done
        for handle, _, full, target in handles:
            handle.wait()
            copy_back(full, target)  # a staged copy's result (a GPU without a device plane)

    def grad_norm(self, norm_type: float) -> float:
        """The norm of the whole averaged gradient, from every rank's shard. Collective."""
        grads = [grad for grad in self.shard_grads() if grad.numel()]
        # One read of the local norm (not one per tensor), in float64 on the gradients' device.
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
        if math.isinf(norm_type):
            local = float(torch.stack(norms).max()) if norms else 0.0
            op = ReduceOp.MAX
        else:
            local = float(torch.stack(norms).pow(norm_type).sum()) if norms else 0.0
            op = ReduceOp.SUM
        total = as_numpy(torch.tensor([local], dtype=torch.float64))  # in place: one array as input and output
        core.submit_allreduce(
            total,
            total,
            "float64",
            f"ZeroOptimizer.norm.{self.names[0]}",
            op,
            process_set=self.process_set,
        ).wait()
        return float(total[0]) if math.isinf(norm_type) else float(total[0]) ** (1.0 / norm_type)
