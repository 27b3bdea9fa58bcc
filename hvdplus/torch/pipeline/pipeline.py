"""Pipeline parallelism for PyTorch, composed with data parallelism: `hvd.pipeline.Pipeline`.

The model (an `nn.Sequential` or a list of modules, built the same way on every rank) is cut into
`num_stages * virtual_stages` contiguous chunks; the job's ranks form `size // num_stages` pipelines of
`num_stages` ranks each. Ranks are laid out stage-major, as DeepSpeed's pipe/data topology: stage
`rank // replicas`, replica `rank % replicas`, so that a stage's data-parallel replicas are neighbours.
`train_step` runs one schedule of `hvdplus/common/plans/pipeline_schedules.py` (GPipe, 1F1B, interleaved 1F1B,
ZB-H1/ZB-V) over micro-batches: activations go forward and their gradients backward point to point on a channel of
the engine's own (`hvdplus/common/data/p2p.py`; transport.py moves one message), without negotiation, so stages
run out of phase. partition.py cuts the model into chunks and a batch into micro-batches.

Why not torch.distributed.pipelining's runtime or schedules: they run on torch.distributed process groups
only (no MPI engine), and its schedule classes produce their orders only from live `PipelineStage` objects
bound to those groups. Its B/W graph analysis is reused (`pipeline_backward.py`).

Gradients equal the whole batch's: each micro-batch's loss is weighted by its share of the rows (exact for
losses that average over rows). A parameter's gradient reaches `p.grad` through autograd's accumulator once per
`train_step`, so DistributedOptimizer/ZeroOptimizer hooks see one backward pass per step (and
`backward_passes_per_step=k` means k train_steps). A failure in a stage is sent to the peers in place of the
messages they wait for, and travels on: every rank of the pipeline raises `PipelineError` naming the stage and
micro-batch.

Device tensors (a stage on `cuda:local_rank`, placed by the user: `pipe.to(device)` moves this rank's layers only)
travel stage to stage on the job's device plane when every stage of the pipeline is on that plane's kind: at the
first step the pipeline's ranks agree on it (one allgather, and one tiny allreduce that builds the plane if no
collective had), then open a channel of the plane's engine per lane (sender, receiver, activations or gradients):
NCCL matches sends and receives in order, which each lane's schedule keeps. Headers (shapes, dtypes, errors) still
go on the host channel, so failures travel as before. Elsewhere tensors are staged through (pinned) host memory."""

from __future__ import annotations

import contextlib
import itertools
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, open_channel, register_process_set, registered_process_set, runtime
from hvdplus.common.data.p2p import TAGS_PER_MESSAGE, PeerError, recv_arrays, send_arrays, send_error
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.common.plans.pipeline_schedules import Action, Op, build_schedule, chunk_stages, message_lanes
from hvdplus.torch.buffers import as_numpy
from hvdplus.torch.mpi_ops import allreduce
from hvdplus.torch.pipeline.partition import as_tuple, chunk_sizes, split_batch
from hvdplus.torch.pipeline.pipeline_backward import WeightWork, backward_full, backward_input, backward_weight
from hvdplus.torch.pipeline.transport import CPU, kind_of, plane_device, receive_tensors, send_tensors, tensor_of
from hvdplus.torch.streams import host_copy

__all__ = ["Pipeline", "PipelineError"]


_ABANDONED: list[Any] = []  # transfers of failed steps, never waited for (see _Step.fail)
_ANY = "any"  # the device-plane offer of a stage without parameters or buffers: it takes the others' kind


class PipelineError(RuntimeError):
    """A pipeline stage failed; the message names the stage (and global rank) and the micro-batch."""


class Pipeline(torch.nn.Module):
    """This rank's stage of a pipelined model, and the schedule that trains it.

    Collective: every rank of the job builds the same Pipeline (same model, arguments), in the same order
    relative to its other collectives; it registers the pipelines' and the stages' process sets."""

    def __init__(
        self,
        model: torch.nn.Sequential | Sequence[torch.nn.Module],
        num_stages: int,
        micro_batches: int,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        balance: str | Sequence[int] = "parameters",
        sample_input: Any = None,
    ) -> None:
        super().__init__()
        layers = list(model)
        names = list(model._modules) if isinstance(model, torch.nn.Module) else [str(i) for i in range(len(layers))]
        world = runtime().size
        if num_stages < 1 or world % num_stages:
            raise ValueError(f"num_stages={num_stages} must divide the job's size {world}")
        chunks = num_stages * virtual_stages
        self.actions_by_stage = build_schedule(schedule, num_stages, micro_batches, virtual_stages)
        if len(layers) < chunks:
            raise ValueError(
                f"cannot cut {len(layers)} layers into {chunks} chunks (num_stages={num_stages} x "
                f"virtual_stages={virtual_stages})"
            )
        sizes = chunk_sizes(layers, chunks, balance, sample_input)
        self.num_stages, self.micro_batches, self.virtual_stages = num_stages, micro_batches, virtual_stages
        self.schedule_name = schedule
        self.replicas = world // num_stages
        rank = runtime().rank
        self.stage, self.replica = rank // self.replicas, rank % self.replicas
        self.pipeline_ranks = [s * self.replicas + self.replica for s in range(num_stages)]
        self.stage_of_chunk = chunk_stages(schedule, num_stages, virtual_stages)
        starts = [sum(sizes[:c]) for c in range(chunks + 1)]
        self.chunks = {
            c: torch.nn.Sequential(*layers[starts[c] : starts[c + 1]])
            for c in range(chunks)
            if self.stage_of_chunk[c] == self.stage
        }
        for c in self.chunks:  # registered under their names in the whole model: "4.weight"
            for index in range(starts[c], starts[c + 1]):
                self.add_module(names[index], layers[index])
        self.chunk_bounds = [(starts[c], starts[c + 1]) for c in range(chunks)]
        self.pipeline_set, self.data_parallel_set = self._process_sets()
        self._channel = open_channel()
        self._lanes: dict[tuple[int, int, bool], Any] | None = None  # device-plane channels, from the first step
        self._plane: str | None = None  # the device kind they move
        self._loss_tag = TAGS_PER_MESSAGE * (1 + 2 * micro_batches * chunks)
        if self._loss_tag + TAGS_PER_MESSAGE > self._channel.max_tag:
            raise ValueError(
                f"{micro_batches} micro-batches x {chunks} chunks need more message tags than the "
                f"engine has ({self._channel.max_tag})"
            )
        self.last_timings: list[tuple[Action, float, float]] = []

    def _process_sets(self) -> tuple[ProcessSet, ProcessSet]:
        """Every pipeline's and every stage's process set (all ranks, same order); return this rank's. A set of the
        same ranks registered before (by the user, or by an earlier pipeline of the same layout) is used as it is:
        a pipeline built again, as in rebalancing, adds no sets (and no threads or groups with them)."""

        def register(ranks: list[int]) -> ProcessSet:
            return registered_process_set(ranks) or register_process_set(ProcessSet(ranks))

        pipelines = [register([s * self.replicas + r for s in range(self.num_stages)]) for r in range(self.replicas)]
        stages = [register([s * self.replicas + r for r in range(self.replicas)]) for s in range(self.num_stages)]
        return pipelines[self.replica], stages[self.stage]

    @property
    def stage_module(self) -> torch.nn.Sequential | list[torch.nn.Sequential]:
        """This rank's chunk (an nn.Sequential), or the list of its chunks with virtual stages."""
        chunks = [self.chunks[c] for c in sorted(self.chunks)]
        return chunks[0] if self.virtual_stages == 1 else chunks

    @property
    def is_first_stage(self) -> bool:
        return self.stage == self.stage_of_chunk[0]

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stage_of_chunk[-1]

    @property
    def device(self) -> torch.device | None:
        """Where this rank's stage computes: the device of its first parameter or buffer (None if it has neither:
        tensors stay where they arrive). Received activations and gradients are created there."""
        for tensor in itertools.chain(self.parameters(), self.buffers()):
            return tensor.device
        return None

    @property
    def plane(self) -> str | None:
        """The device kind whose plane carries this pipeline's activations and gradients (None: host memory);
        known after the first step."""
        return self._plane

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a Pipeline runs with train_step(x, y, loss_fn) and eval_step(x), not by calling it")

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One forward and backward of the batch through the pipeline, micro-batch by micro-batch in the
        schedule's order; gradients are accumulated into the stage's parameters (call optimizer.step() after).
        Returns the batch's loss (the micro-batch losses weighted by their rows) on every stage.

        Collective over the pipeline. The first stage uses `inputs`, the last `target`; the others may pass None."""
        self._connect()
        run = _Step(self, self.actions_by_stage[self.stage], grad=True)
        if self.is_first_stage:
            run.inputs = split_batch(inputs, self.micro_batches, "inputs")
        if self.is_last_stage:
            targets = split_batch(target, self.micro_batches, "target")
            rows = [int(as_tuple(t)[0].shape[0]) for t in targets]
            run.loss = lambda m, output: loss_fn(output, targets[m]) * (rows[m] / sum(rows))
        run.execute()
        return run.share_loss()

    @torch.no_grad()
    def eval_step(self, inputs: Any) -> Any:
        """The model's output for `inputs` on the last stage (None elsewhere); no graph is built.

        Collective over the pipeline. Only the first stage's `inputs` are used."""
        self._connect()
        forwards = sorted((m, c) for m in range(self.micro_batches) for c in self.chunks)
        actions: list[Action] = []
        for m, c in forwards:
            if c > 0 and self.stage_of_chunk[c - 1] != self.stage:
                actions.append(Action(Op.RECV_ACTIVATION, m, c, self.stage_of_chunk[c - 1]))
            actions.append(Action(Op.FORWARD, m, c))
            if c + 1 < len(self.stage_of_chunk) and self.stage_of_chunk[c + 1] != self.stage:
                actions.append(Action(Op.SEND_ACTIVATION, m, c, self.stage_of_chunk[c + 1]))
        run = _Step(self, actions, grad=False)
        if self.is_first_stage:
            run.inputs = split_batch(inputs, self.micro_batches, "inputs")
        run.execute()
        if not self.is_last_stage:
            return None
        last = len(self.stage_of_chunk) - 1
        outputs = [run.outputs[(m, last)] for m in range(self.micro_batches)]
        if len(outputs[0]) == 1:
            return torch.cat([o[0] for o in outputs])
        return tuple(torch.cat(parts) for parts in zip(*outputs))

    def _connect(self) -> None:
        """At the first step, agree over the pipeline whether its tensors travel on a device plane: when every
        stage with parameters or buffers is on the same plane kind. Then build the plane if no collective has yet
        (a tiny allreduce) and open a channel of its engine per lane this rank sends or receives on, every rank
        in the same order of lanes (each channel is a meeting of its two ranks). Collective over the pipeline."""
        if self._lanes is not None:
            return
        self._lanes = {}
        if not runtime().coordinator.device_kinds:  # no device plane in the job: every rank knows the same
            return
        device = self.device
        offer = _ANY if device is None else kind_of(device)
        offers = core.allgather_object((offer, secrets.token_hex(8)), process_set=self.pipeline_set)
        kinds = {kind for kind, _ in offers if kind != _ANY}
        lanes = message_lanes(self.actions_by_stage)
        if len(kinds) != 1 or None in kinds or lanes is None:
            return  # stages on different kinds, all on the host, or a schedule whose lanes NCCL could not order
        (kind,) = kinds
        probe = torch.zeros(1, device=device if offer == kind else plane_device(kind))
        allreduce(probe, process_set=self.pipeline_set)  # builds the plane on every rank, if none has yet
        engine = runtime().coordinator.plane_engine(kind)
        if engine is None or not hasattr(engine, "open_p2p"):
            return
        token = offers[0][1]
        for sender, receiver, forward in sorted(lanes):
            if self.stage in (sender, receiver):
                ranks = [self.pipeline_ranks[sender], self.pipeline_ranks[receiver]]
                key = f"pipeline/{token}/{sender}-{receiver}/{'F' if forward else 'B'}"
                with torch.cuda.device(device) if device is not None and device.type == "cuda" else _nothing():
                    channel = engine.open_p2p(ranks, key, _alive)  # NCCL connects on the stage's GPU
                runtime().coordinator.close_at_shutdown(channel)
                self._lanes[(sender, receiver, forward)] = channel
        self._plane = kind

    def lane(self, sender: int | None, receiver: int | None, forward: bool) -> Any | None:
        """The device-plane channel of a lane between two stages (None: their tensors go through host memory)."""
        return None if self._lanes is None else self._lanes.get((sender, receiver, forward))  # type: ignore[arg-type]

    def tag(self, op: Op, micro_batch: int, chunk: int) -> int:
        """The message tag of an activation (of `chunk`'s output) or a gradient (of `chunk`'s input)."""
        sent_chunk = chunk - 1 if op == Op.RECV_ACTIVATION else chunk + 1 if op == Op.RECV_GRAD else chunk
        forward = op in (Op.SEND_ACTIVATION, Op.RECV_ACTIVATION)
        chunks = len(self.stage_of_chunk)
        return TAGS_PER_MESSAGE * (1 + 2 * (micro_batch * chunks + sent_chunk) + (0 if forward else 1))


# A chunk's backward: (outputs, their gradients, inputs, trainable parameters), as backward_full takes them.
_BackwardArgs = tuple[
    Sequence[torch.Tensor], Sequence[torch.Tensor | None], Sequence[torch.Tensor], Sequence[torch.Tensor]
]


class _Step:
    """One execution of a stage's action list."""

    def __init__(self, pipe: Pipeline, actions: list[Action], grad: bool) -> None:
        self.pipe, self.actions, self.grad = pipe, actions, grad
        self.inputs: list[Any] = []
        self.loss: Callable[[int, Any], torch.Tensor] | None = None
        self.received: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (m, c) -> chunk c's input
        self.output_grads: dict[tuple[int, int], tuple] = {}  # (m, c) -> gradients of chunk c's outputs
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.input_grads: dict[tuple[int, int], list] = {}
        self.weight_work: dict[tuple[int, int], WeightWork | _BackwardArgs] = {}  # B's leftovers (or all of it) for W
        self.device = pipe.device
        self.total_loss: torch.Tensor | None = None  # summed on the last stage's device, in float32
        # Transfers in flight, by the action that started them: their buffers (sharing the sent tensors' memory)
        # stay alive until they complete. An activation's send is done once its gradient comes back.
        self.sends: dict[tuple[Op, int, int], list[Any]] = {}
        last: dict[tuple[bool, int], int] = {}
        for index, action in enumerate(actions):
            if action.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT, Op.BACKWARD_INPUT):
                last[(action.op == Op.BACKWARD_INPUT, action.chunk)] = index
        # The backward of each chunk that fires the hooks: the last W (or BW) for most parameters, the last B
        # for those that B handles itself (see backward_input).
        self.final = set(last.values())

    def peer(self, action: Action) -> int:
        assert action.peer is not None  # a send or a receive names its peer stage
        return self.pipe.pipeline_ranks[action.peer]

    def execute(self) -> None:
        self.pipe.last_timings = timings = []
        index = 0
        try:
            for index, action in enumerate(self.actions):
                started = time.perf_counter()
                self.run(index, action)
                if action.op in (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                    timings.append((action, started, time.perf_counter()))
            for transfers in self.sends.values():
                for transfer in transfers:
                    transfer.wait(self.alive)
        except PeerError as exc:
            self.fail(index, str(exc), exc)
        except (HorovodInternalError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - any stage failure must reach the other stages
            action = self.actions[index]
            text = (
                f"pipeline stage {self.pipe.stage} (rank {runtime().rank}) failed on micro-batch "
                f"{action.micro_batch} (chunk {action.chunk}, {action.op.name.lower()}): "
                f"{type(exc).__name__}: {exc}"
            )
            self.fail(index, text, exc)

    def fail(self, index: int, text: str, cause: BaseException) -> None:
        """Send `text` in place of every message this stage still owes, so that no peer waits forever, then
        raise it here."""
        owed = [a for a in self.actions[index:] if a.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD)]
        transfers = [
            t
            for a in owed
            for t in send_error(self.pipe._channel, self.peer(a), self.pipe.tag(a.op, a.micro_batch, a.chunk), text)
        ]
        if self.grad and self.pipe.is_last_stage:
            transfers += [
                t
                for rank in self.pipe.pipeline_ranks
                if rank != runtime().rank
                for t in send_error(self.pipe._channel, rank, self.pipe._loss_tag, text)
            ]
        # Not waited for: a peer that failed too never takes them. They and the step's sends still in flight
        # keep their buffers until the process ends (a freed buffer would reach a peer as garbage), and the
        # device-plane channels their groups (a dropped group closes its connections under peers still sending).
        _ABANDONED.extend([t for sent in self.sends.values() for t in sent] + transfers)
        _ABANDONED.extend((self.pipe._lanes or {}).values())
        raise PipelineError(text) from cause

    def alive(self) -> None:
        _alive()

    def run(self, index: int, action: Action) -> None:
        key = (action.micro_batch, action.chunk)
        op = action.op
        if op == Op.RECV_ACTIVATION:
            tensors = self.receive(action)
            self.received[key] = tuple(t.requires_grad_(self.grad and t.is_floating_point()) for t in tensors)
        elif op == Op.RECV_GRAD:
            self.output_grads[key] = self.receive(action)
            for transfer in self.sends.pop((Op.SEND_ACTIVATION, *key), ()):  # received before this gradient left
                transfer.wait(self.alive)
        elif op == Op.SEND_ACTIVATION:
            self.send(action, self.outputs[key])
        elif op == Op.SEND_GRAD:
            self.send(action, tuple(g for g in self.input_grads.pop(key) if g is not None))
        elif op == Op.FORWARD:
            self.forward(*key)
        elif op == Op.BACKWARD:
            self.store_input_grads(key, backward_full(*self.backward_args(key), final=index in self.final))
            self.drop(key)
        elif op == Op.BACKWARD_INPUT:
            if hasattr(self.pipe.chunks[key[1]], "_hvdplus_zero3"):
                raise ValueError(
                    "the zero-bubble schedules' B/W split cannot run on a stage sharded by "
                    "hvd.shard_parameters (W replays the graph after the units are released); use "
                    "schedule='1f1b', 'gpipe' or 'interleaved'"
                )
            outputs, grads, inputs, params = self.backward_args(key)
            if any(x.requires_grad for x in inputs):
                input_grads, self.weight_work[key] = backward_input(
                    outputs, grads, inputs, params, final=index in self.final
                )
                self.store_input_grads(key, input_grads)
            else:  # the first chunk: no input gradient to hurry, W does the whole backward
                self.weight_work[key] = (outputs, grads, inputs, params)
        elif op == Op.BACKWARD_WEIGHT:
            work = self.weight_work.pop(key)
            if isinstance(work, WeightWork):
                backward_weight(work, final=index in self.final)
            else:
                backward_full(*work, final=index in self.final)
            self.drop(key)

    def forward(self, m: int, c: int) -> None:
        pipe = self.pipe
        if c == 0:
            inputs = as_tuple(self.inputs[m])
        elif (m, c) in self.received:
            inputs = self.received[(m, c)]
        else:  # the previous chunk is on this stage (the V's tip): hand its output over as a new leaf
            inputs = tuple(
                o.detach().requires_grad_(self.grad and o.is_floating_point()) for o in self.outputs[(m, c - 1)]
            )
            self.received[(m, c)] = inputs
        output = pipe.chunks[c](inputs if len(inputs) > 1 else inputs[0])
        if c == len(pipe.stage_of_chunk) - 1 and self.loss is not None:
            loss = self.loss(m, output)
            part = loss.detach().float()
            self.total_loss = part if self.total_loss is None else self.total_loss + part
            self.outputs[(m, c)] = (loss,)
        else:
            self.outputs[(m, c)] = as_tuple(output)

    def backward_args(self, key: tuple[int, int]) -> _BackwardArgs:
        m, c = key
        outputs = self.outputs[key]
        if c == len(self.pipe.stage_of_chunk) - 1:
            grads: tuple = (None,)  # the loss
        elif key in self.output_grads:
            grads = self.output_grads.pop(key)
        else:  # the next chunk is on this stage
            grads = tuple(self.input_grads.pop((m, c + 1)))
        grads = _align(outputs, grads)
        inputs = as_tuple(self.inputs[m]) if c == 0 else self.received[key]
        params = [p for p in self.pipe.chunks[c].parameters() if p.requires_grad]
        return outputs, grads, inputs, params

    def store_input_grads(self, key: tuple[int, int], grads: list) -> None:
        """Keep chunk c's input gradients for the previous chunk: one per input that required one (zeros where
        the chunk did not use it), as the previous chunk expects one per floating output."""
        m, c = key
        if c > 0:
            inputs = self.received[key]
            self.input_grads[key] = [
                torch.zeros_like(x) if g is None and x.requires_grad else g for x, g in zip(inputs, grads)
            ]

    def drop(self, key: tuple[int, int]) -> None:
        self.outputs.pop(key, None)
        self.received.pop(key, None)

    def send(self, action: Action, tensors: Sequence[torch.Tensor]) -> None:
        """Start sending (transport.py), on the lane's device-plane channel if the lane has one."""
        pipe, key = self.pipe, (action.op, action.micro_batch, action.chunk)
        lane = pipe.lane(pipe.stage, action.peer, action.op is Op.SEND_ACTIVATION)
        self.sends[key] = send_tensors(pipe._channel, lane, pipe.plane, self.peer(action), pipe.tag(*key), tensors)

    def receive(self, action: Action) -> tuple[torch.Tensor, ...]:
        """The tensors of a message (transport.py), created on this stage's device."""
        pipe = self.pipe
        tag = pipe.tag(action.op, action.micro_batch, action.chunk)
        lane = pipe.lane(action.peer, pipe.stage, action.op is Op.RECV_ACTIVATION)
        return receive_tensors(pipe._channel, lane, pipe.plane, self.peer(action), tag, self.device, self.alive)

    def share_loss(self) -> torch.Tensor:
        """The batch loss, sent by the last stage to the pipeline's other ranks (point to point)."""
        pipe = self.pipe
        last = pipe.pipeline_ranks[pipe.stage_of_chunk[-1]]
        if runtime().rank == last:
            assert self.total_loss is not None  # the last stage ran every micro-batch's loss
            others = [rank for rank in pipe.pipeline_ranks if rank != last]
            if others:
                loss = [(as_numpy(host_copy(self.total_loss.reshape(1))), "float32")]  # one device wait a step
                sends = [t for rank in others for t in send_arrays(pipe._channel, rank, pipe._loss_tag, loss)]
                for transfer in sends:
                    transfer.wait(self.alive)
            return self.total_loss.reshape(())
        try:
            ((array, dtype),) = recv_arrays(pipe._channel, last, pipe._loss_tag, self.alive)
        except PeerError as exc:
            raise PipelineError(str(exc)) from exc
        return tensor_of(array, dtype).reshape(()).to(CPU if self.device is None else self.device)


def _align(outputs: tuple[torch.Tensor, ...], grads: tuple) -> tuple:
    """A gradient (or None) per output: the next chunk sends one per floating output, in order."""
    if len(grads) == len(outputs):
        return grads
    supplied: Iterator = iter(grads)
    return tuple(next(supplied) if o.is_floating_point() else None for o in outputs)


def _nothing() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _alive() -> None:
    if not runtime().coordinator.running:
        raise HorovodInternalError("hvdplus stopped (another rank shut down) during a pipeline step")
