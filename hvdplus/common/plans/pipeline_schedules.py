"""Pipeline-parallel schedules as data, a simulator that times them, and a layer-partition helper.

A schedule is one list of :class:`Action` per pipeline stage, in the order that stage runs them; the
runtime in ``hvdplus/torch/pipeline/pipeline.py`` executes these lists and :func:`simulate` times them. Model
chunks are numbered in model order and :func:`chunk_stages` says which stage owns each.

Bubble fractions (idle time over makespan, per stage) for S stages, M micro-batches, v chunks per
stage, with F, B and W the forward, input-gradient and weight-gradient times:

- GPipe (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism") and 1F1B, i.e. PipeDream-Flush (Narayanan et al., 2021, "Memory-Efficient
  Pipeline-Parallel DNN Training"): (S-1) / (M+S-1), whatever the ratio of F to B+W.
- Interleaved 1F1B (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM"): (S-1) / (v*M+S-1), with F, B and W timed per chunk.
- ZB-H1 (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism", section 3.1): an idle time of
  (S-1)*(F+B-W) per stage (at least 0) over a makespan of M*(F+B+W) plus that idle, for M >= S.
- ZB-V (same paper, section 6): the paper claims a near-zero bubble for F = B = W; the order built here
  idles S-1 per-chunk units per stage once M >= 2S-1, (S-1) / (6M+S-1) for unit times, the least
  possible as the last stage waits S-1 forwards for its first input. :func:`theoretical_bubble` gives
  what :func:`simulate` finds for it.

Peak memory counts the (micro-batch, chunk) pairs whose forward ran and whose W (or BW) has not. As in
the paper, ZB-H1 keeps 1F1B's peak over the stages: every stage holds min(S, M) micro-batches, as
1F1B's first stage does (its stage s holds only S-s; with as few on the later stages ZB-H1's bubble
could not drop below (S-1)*(F+B)). ZB-V holds at most 2*min(S, M) chunks, the same activation memory.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Op",
    "Action",
    "DeadlockError",
    "SimulationResult",
    "chunk_stages",
    "build_schedule",
    "simulate",
    "theoretical_bubble",
    "balanced_split",
    "check_sizes",
    "message_lanes",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


class Op(str, enum.Enum):
    """What an action does; the values are the compact text form."""

    FORWARD = "F"
    BACKWARD = "BW"
    BACKWARD_INPUT = "B"
    BACKWARD_WEIGHT = "W"
    SEND_ACTIVATION = "SEND_F"
    RECV_ACTIVATION = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"


_Step = tuple[Op, int, int]  # (op, micro_batch, chunk) of a compute order, before messages are added

_HELD = {Op.FORWARD: 1, Op.BACKWARD_INPUT: 0, Op.BACKWARD_WEIGHT: -1, Op.BACKWARD: -1}  # activations kept


@dataclass(frozen=True)
class Action:
    """One step of a stage: compute on (micro_batch, chunk), or a message to or from stage `peer`."""

    op: Op
    micro_batch: int
    chunk: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f", peer={self.peer}"
        return f"{self.op.value}(m={self.micro_batch}, c={self.chunk}{peer})"


class DeadlockError(RuntimeError):
    """No stage can run its next action: each waits for a message that is never sent."""


@dataclass(frozen=True)
class SimulationResult:
    """Times of one simulated run; the tuples are indexed by stage, `spans` by (op, micro_batch, chunk)."""

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble: tuple[float, ...]
    peak_activations: tuple[int, ...]
    finish: tuple[float, ...]
    spans: dict[tuple[Op, int, int], tuple[float, float]]


def _check(name: str, stages: int, virtual_stages: int, micro_batches: int | None = None) -> None:
    """Raise unless the arguments describe a schedule this module builds."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    counts = {"stages": stages, "virtual_stages": virtual_stages}
    if micro_batches is not None:
        counts["micro_batches"] = micro_batches
    for arg, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{arg} must be at least 1, got {value}")
    if name in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(
            f"{name!r} runs one chunk per stage, got virtual_stages={virtual_stages}; "
            "use 'interleaved' or 'zero-bubble' for more"
        )
    if name == "interleaved" and virtual_stages < 2:
        raise ValueError(f"'interleaved' needs virtual_stages >= 2, got {virtual_stages}; use '1f1b' for one chunk")
    if name == "interleaved" and micro_batches is not None and micro_batches % stages:
        raise ValueError(
            f"'interleaved' needs micro_batches to be a multiple of stages (Megatron-LM's rule), "
            f"got {micro_batches} micro-batches for {stages} stages; "
            f"use {micro_batches + stages - micro_batches % stages}"
        )
    if name == "zero-bubble" and virtual_stages not in (1, 2):
        raise ValueError(
            f"'zero-bubble' supports virtual_stages=1 (ZB-H1) and virtual_stages=2 (ZB-V), got {virtual_stages}"
        )


def chunk_stages(name: str, stages: int, virtual_stages: int = 1) -> list[int]:
    """The stage owning each model chunk: chunk c on c % stages, except ZB-V's V (s holds s and 2S-1-s)."""
    _check(name, stages, virtual_stages)
    chunks = range(stages * virtual_stages)
    if name == "zero-bubble" and virtual_stages == 2:
        return [c if c < stages else 2 * stages - 1 - c for c in chunks]
    return [c % stages for c in chunks]


def _one_f_one_b(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int) -> list[_Step]:
    """`warmup` forwards, then forward/backward pairs, then the remaining backwards (all as (op, m, c))."""
    steady = len(forwards) - warmup
    order: list[_Step] = [(Op.FORWARD, *f) for f in forwards[:warmup]]
    for f, b in zip(forwards[warmup:], backwards[:steady]):
        order += [(Op.FORWARD, *f), (Op.BACKWARD, *b)]
    return order + [(Op.BACKWARD, *b) for b in backwards[steady:]]


def _interleaved(stage: int, stages: int, micro_batches: int, chunks: int) -> list[_Step]:
    """Megatron-LM's interleaved 1F1B order of one stage holding `chunks` chunks."""
    group = stages * chunks
    total = micro_batches * chunks
    micro = [(k // group) * stages + k % stages for k in range(total)]
    slot = [(k // stages) % chunks for k in range(total)]
    forwards = [(micro[k], slot[k] * stages + stage) for k in range(total)]
    backwards = [(micro[k], (chunks - 1 - slot[k]) * stages + stage) for k in range(total)]
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    return _one_f_one_b(forwards, backwards, warmup)


def _zb_h1(stage: int, stages: int, micro_batches: int) -> list[_Step]:
    """ZB-H1: 1F1B's order with B for BW and the W of micro-batch m-stage right after B(m), the rest last."""
    pairs = [(m, stage) for m in range(micro_batches)]
    order: list[_Step] = []
    for op, m, c in _one_f_one_b(pairs, pairs, min(stages - stage - 1, micro_batches)):
        if op is Op.FORWARD:
            order.append((op, m, c))
            continue
        order.append((Op.BACKWARD_INPUT, m, c))
        if m >= stage:
            order.append((Op.BACKWARD_WEIGHT, m - stage, c))
    return order + [(Op.BACKWARD_WEIGHT, m, stage) for m in range(max(micro_batches - stage, 0), micro_batches)]


def _zb_v(stage: int, stages: int, micro_batches: int) -> list[_Step]:
    """ZB-V's order for one stage (Qi et al. 2024, section 6, as PyTorch's ScheduleZBVZeroBubble builds it)."""
    down, up = stage, 2 * stages - 1 - stage  # this stage's chunks on the way down and up the V
    enough = max(2 * stages - 1, micro_batches)  # built for at least 2S-1 micro-batches, then cut to M
    f, b, w = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    count = {(op, c): 0 for op in (f, b, w) for c in (down, up)}
    order: list[_Step] = []

    def add(*steps: tuple[Op, int]) -> None:
        for op, c in steps:
            order.append((op, count[op, c], c))
            count[op, c] += 1

    add(*[(f, down)] * (2 * (stages - stage) - 1))
    for _ in range(stage):
        add((f, up), (f, down))
    for _ in range(stages - stage):
        add((f, up), (b, up), (w, up))
    while count[f, up] < count[f, down] or count[f, down] < enough:
        add(*[(f, down)] * (count[f, down] < enough), (b, down), (w, down), (f, up), (b, up), (w, up))
    for _ in range(stage):
        add((b, down), (b, up))
    for _ in range(stages - stage):
        add((b, down), (w, down))
    add(*[(w, up)] * (count[b, up] - count[w, up]), *[(w, down)] * (count[b, down] - count[w, down]))
    return [step for step in order if step[1] < micro_batches]


def _with_messages(orders: list[list[_Step]], owner: list[int]) -> list[list[Action]]:
    """Wrap each stage's compute order with the sends and receives between chunks on different stages."""

    def message(op: Op, m: int, c: int, other: int, stage: int) -> list[Action]:
        return [Action(op, m, c, owner[other])] if 0 <= other < len(owner) and owner[other] != stage else []

    schedule = []
    for stage, order in enumerate(orders):
        actions = []
        for op, m, c in order:
            if op is Op.BACKWARD_WEIGHT:
                actions.append(Action(op, m, c))
                continue
            recv, send, step = (
                (Op.RECV_ACTIVATION, Op.SEND_ACTIVATION, -1) if op is Op.FORWARD else (Op.RECV_GRAD, Op.SEND_GRAD, 1)
            )
            actions += [*message(recv, m, c, c + step, stage), Action(op, m, c), *message(send, m, c, c - step, stage)]
        schedule.append(actions)
    return schedule


def build_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The actions of each pipeline stage (list index = stage), in the order that stage runs them."""
    _check(name, stages, virtual_stages, micro_batches)
    owner = chunk_stages(name, stages, virtual_stages)
    orders = []
    for s in range(stages):
        if name == "interleaved":
            orders.append(_interleaved(s, stages, micro_batches, virtual_stages))
        elif name == "zero-bubble":
            orders.append((_zb_h1 if virtual_stages == 1 else _zb_v)(s, stages, micro_batches))
        else:
            pairs = [(m, s) for m in range(micro_batches)]
            warmup = micro_batches if name == "gpipe" else min(stages - s - 1, micro_batches)
            orders.append(_one_f_one_b(pairs, pairs, warmup))
    return _with_messages(orders, owner)


def _awaited_send(action: Action, stage: int) -> tuple[Op, int, int, int | None, int]:
    """The key of the send a receive waits for: (op, micro_batch, chunk, sender, receiver)."""
    if action.op is Op.RECV_ACTIVATION:
        return Op.SEND_ACTIVATION, action.micro_batch, action.chunk - 1, action.peer, stage
    return Op.SEND_GRAD, action.micro_batch, action.chunk + 1, action.peer, stage


def message_lanes(schedule: Sequence[Sequence[Action]]) -> dict[tuple[int, int, bool], list[tuple[int, int]]] | None:
    """The schedule's messages by lane, (sender stage, receiver stage, whether activations), each lane's in the
    order its sender sends them, as (micro_batch, chunk of the sent tensor); None unless every lane's receiver
    takes them in that same order, which a channel that ignores tags (NCCL's) needs."""
    sent: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    taken: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    for stage, actions in enumerate(schedule):
        for action in actions:
            if action.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD) and action.peer is not None:
                lane = (stage, action.peer, action.op is Op.SEND_ACTIVATION)
                sent.setdefault(lane, []).append((action.micro_batch, action.chunk))
            elif action.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD) and action.peer is not None:
                op, m, chunk, sender, _ = _awaited_send(action, stage)
                taken.setdefault((sender, stage, op is Op.SEND_ACTIVATION), []).append((m, chunk))  # type: ignore[arg-type]
    return sent if sent == taken else None


def simulate(
    schedule: Sequence[Sequence[Action]],
    stage_of_chunk: Sequence[int],
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    transfer: float = 0.0,
) -> SimulationResult:
    """Run each stage's actions in order: compute takes its time, a receive waits for its send (+ transfer)."""
    times = {
        "forward": forward,
        "backward_input": backward_input,
        "backward_weight": backward_weight,
        "transfer": transfer,
    }
    for arg, value in times.items():
        if value < 0:
            raise ValueError(f"{arg} must be >= 0, got {value}")
    duration = {
        Op.FORWARD: forward,
        Op.BACKWARD_INPUT: backward_input,
        Op.BACKWARD_WEIGHT: backward_weight,
        Op.BACKWARD: backward_input + backward_weight,
    }
    for stage, actions in enumerate(schedule):
        for a in actions:
            if a.op in _HELD and stage_of_chunk[a.chunk] != stage:
                raise ValueError(f"stage {stage} runs {a} but chunk {a.chunk} is on stage {stage_of_chunk[a.chunk]}")
    n = len(schedule)
    at, clock, busy, alive, peak = [0] * n, [0.0] * n, [0.0] * n, [0] * n, [0] * n
    sent: dict[tuple, float] = {}
    spans: dict[tuple[Op, int, int], tuple[float, float]] = {}
    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(schedule):
            while at[s] < len(actions):
                a = actions[at[s]]
                if a.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
                    key = _awaited_send(a, s)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key] + transfer)
                elif a.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD):
                    sent[(a.op, a.micro_batch, a.chunk, s, a.peer)] = clock[s]
                else:
                    spans[(a.op, a.micro_batch, a.chunk)] = (clock[s], clock[s] + duration[a.op])
                    clock[s] += duration[a.op]
                    busy[s] += duration[a.op]
                    alive[s] += _HELD[a.op]
                    peak[s] = max(peak[s], alive[s])
                at[s] += 1
                progress = True
    stuck = [f"stage {s} waits at {schedule[s][at[s]]}" for s in range(n) if at[s] < len(schedule[s])]
    if stuck:
        raise DeadlockError("the schedule deadlocks: " + "; ".join(stuck))
    makespan = max(clock, default=0.0)
    idle = tuple(makespan - b for b in busy)
    return SimulationResult(
        makespan,
        tuple(busy),
        idle,
        tuple(i / makespan if makespan else 0.0 for i in idle),
        tuple(peak),
        tuple(clock),
        spans,
    )


def theoretical_bubble(
    name: str,
    stages: int,
    micro_batches: int,
    virtual_stages: int = 1,
    forward: float = 1.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
) -> float:
    """The bubble fraction of a schedule by the formulas in the module docstring (ZB-V: simulated)."""
    _check(name, stages, virtual_stages, micro_batches)
    if name in ("gpipe", "1f1b"):
        return (stages - 1) / (micro_batches + stages - 1)
    if name == "interleaved":
        return (stages - 1) / (virtual_stages * micro_batches + stages - 1)
    if virtual_stages == 1:
        idle = max(0.0, (stages - 1) * (forward + backward_input - backward_weight))
        total = micro_batches * (forward + backward_input + backward_weight) + idle
        return idle / total if total else 0.0
    result = simulate(
        build_schedule(name, stages, micro_batches, virtual_stages),
        chunk_stages(name, stages, virtual_stages),
        forward,
        backward_input,
        backward_weight,
    )
    return max(result.bubble)


def balanced_split(costs: Sequence[float], parts: int) -> list[int]:
    """Sizes of `parts` contiguous non-empty groups of layers minimizing the largest group cost (exact DP)."""
    n = len(costs)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} stages; use between 1 and {n} stages")
    for i, cost in enumerate(costs):
        if cost < 0:
            raise ValueError(f"layer costs must be >= 0, got {cost} for layer {i}")
    prefix = [0.0, *itertools.accumulate(costs)]
    # best[k][i]: the smallest largest-group cost of the first i layers in k groups; start[k][i]: its last group's start
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    start = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - parts + k + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], start[k][i] = cost, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - start[k][i])
        i = start[k][i]
    return sizes[::-1]


def check_sizes(sizes: Sequence[int], layers: int, parts: int) -> None:
    """Raise ValueError unless `sizes` are `parts` positive ints adding up to `layers`."""
    sizes = list(sizes)
    if len(sizes) != parts:
        raise ValueError(f"got {len(sizes)} sizes {sizes} for {parts} stages; give one size per stage")
    bad = [x for x in sizes if not isinstance(x, int) or isinstance(x, bool) or x < 1]
    if bad:
        raise ValueError(f"sizes must be positive ints, got {bad[0]!r} in {sizes}")
    if sum(sizes) != layers:
        raise ValueError(f"sizes {sizes} add up to {sum(sizes)} but the model has {layers} layers")
