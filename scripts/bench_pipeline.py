"""Pipeline schedules measured: each stage's bubble against theory and the simulator, peak activation memory,
and the step time of a pipelined model against the same model data-parallel.

    python scripts/bench_pipeline.py                    # everything, MPI engine (~8 min on 2 cores)
    python scripts/bench_pipeline.py --quick            # smoke run: M = 4, few steps, one job per S (~1.5 min)
    python scripts/bench_pipeline.py --stages 4 --micro-batches 8 --schedules 1f1b,zb-h1 --compare-rounds 0

Schedules: gpipe, 1f1b, interleaved (2 chunks per stage), zb-h1 (zero-bubble, 1 chunk per stage) and zb-v
(zero-bubble, 2 chunks), at S stages (S ranks, one pipeline, stage = rank) and M micro-batches of --micro-rows
rows. One MPI job per S and schedule runs its M values one after another, each on a fresh model and Pipeline;
--rounds runs every job that many times (in alternating order), and the statistics pool their steps.
At a given S every schedule trains the same model of 2S equal parts (a chunk is one part with 2 chunks per
stage, two with 1), so every chunk costs the same, with F = B = W per chunk by construction:

- real layers (S in --real-stages, default 2): each part is --real-layers x (Linear(--width) + Tanh); a
  Linear's forward, input gradient and weight gradient are one matmul each of the same size. The first block
  adds a zero-initialised parameter to its input, so that its input gradient is computed like the others'
  (stage 0 would otherwise skip one matmul of its backward);
- sleep layers (other S: 4 ranks on 2 cores): out = D_in(x + shift) * D_w(weight), where D_in sleeps
  --sleep-ms in forward and again in backward (the input path: B) and D_w sleeps --sleep-ms in backward (the
  weight path: W), so compute takes a fixed time without a core. Both paths meet at the product, where the
  runtime's B/W split (torch.distributed.pipelining's graph analysis) finds the weight path hanging off the
  input path; `shift` gives the model's first layer an input path that needs a gradient. The product saves its
  input, a (rows, --sleep-width) float tensor. Checked on one process before the jobs: F, B (autograd.grad of
  the input alone, and the runtime's B) and W each take one sleep.

Per configuration: every rank first times F, B, W (the runtime's split) and BW (its whole backward) of each of
its chunks alone (one micro-batch, 2 warm-ups, median of 5), then runs --warmup + --steps train_steps, each
after a barrier. A stage's bubble in a step is 1 - (the summed durations of its compute actions, from
`pipe.last_timings`) / (the step's wall time: from the earliest rank's start of train_step to the end of the
last rank's; perf_counter is CLOCK_MONOTONIC, one clock for the processes of a host). That wall time is the
simulator's makespan; each rank's own train_step time would leave out the last stage's idle tail (its bubble
by that measure is in the JSON as "bubble_own"). Reported: the median over the timed steps per stage, its
mean and max over the stages; the simulator's bubble (mean over stages) fed with the chunk times measured
alone (F, B, W for zero-bubble; F and BW for the others), with no transfer time ("sim") and with the median
latency of a message seen in the last step's timeline ("sim+p2p": the end of an action to the start of the
action on another stage that waited for its output); the theory (`theoretical_bubble`) for F = B = W.

Peak activation memory: one more step with `torch.autograd.graph.saved_tensors_hooks` around train_step on
every rank. Each tensor autograd saves is packed into a holder whose creation adds its bytes to a live count
and whose deletion (when the graph frees it) takes them off; the table shows stage 0's maximum (real layers
at S=2, sleep layers at S=4: both save (rows, width) floats per layer). Parameters and views of them are not
counted, and a tensor saved twice (a Tanh's output is the next Linear's input) counts once. Memory autograd does
not save (the runtime's message buffers, gradients) is not counted.

Step time (--compare-*): 8 x (Linear(2048, 2048) + Tanh), global batch 64, on 2 ranks: Pipeline 1f1b S=2 M=8
with SGD on pipe.parameters() against hvd.DistributedOptimizer(SGD) data-parallel (each rank the whole model,
half the batch). Separate jobs, alternating, --compare-rounds each; medians of rank 0's step times.

Targets (the issue): GPipe and 1F1B within 5 percentage points of (S-1)/(M+S-1) on every stage; zero-bubble
(ZB-H1 and ZB-V) at most half of 1F1B's measured bubble (mean over stages) at the same S and M, with stage 0's
peak activation memory at most 1.1x 1F1B's. Prints the table with PASS/FAIL, writes JSON (--json, with every
stage's numbers, the chunk times, each action's median time and the last step's timeline) and a plot (--plot:
bubble against M per schedule, one panel per S: measured markers, theory lines, simulator dotted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_bench import finish_job, start_mpi_job  # noqa: E402

from hvdplus.common.plans.pipeline_schedules import build_schedule, chunk_stages, simulate, theoretical_bubble  # noqa: E402

# name -> (schedule of hvdplus.common.plans.pipeline_schedules, virtual_stages)
SCHEDULES = {
    "gpipe": ("gpipe", 1),
    "1f1b": ("1f1b", 1),
    "interleaved": ("interleaved", 2),
    "zb-h1": ("zero-bubble", 1),
    "zb-v": ("zero-bubble", 2),
}
CHUNKS_PER_STAGE = 2  # the model has S * 2 equal chunks' worth of layers: 2 chunks per stage at most
COMPARE_MODES = ("pipeline", "data-parallel")
BUBBLE_TOLERANCE, ZB_BUBBLE_RATIO, ZB_MEMORY_RATIO = 0.05, 0.5, 1.1


# ============================================================================ layers (workers and the check)
def layer_classes() -> tuple[type, type]:
    """The sleep layer's class and the input shift's (built on first use: the driver needs torch only for the
    one-process check)."""
    import torch

    class Delay(torch.autograd.Function):
        """Identity that sleeps `forward_s` in forward and `backward_s` in backward."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
            if forward_s:
                time.sleep(forward_s)
            ctx.backward_s = backward_s
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple:
            if ctx.backward_s:
                time.sleep(ctx.backward_s)
            return grad, None, None

    class Shift(torch.nn.Module):
        """x + shift (a parameter, zeros): what follows gets an input that needs a gradient, even on stage 0."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.shift = torch.nn.Parameter(torch.zeros(width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.shift

    class SleepLayer(Shift):
        """out = D_in(x + shift) * D_w(weight): F, B (input path) and W (weight path) each sleep `seconds`;
        the product saves its input, a (rows, width) float tensor."""

        def __init__(self, width: int, seconds: float) -> None:
            super().__init__(width)
            self.weight = torch.nn.Parameter(torch.ones(width))
            self.seconds = seconds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Delay.apply(super().forward(x), self.seconds, self.seconds) * Delay.apply(
                self.weight, 0.0, self.seconds
            )

    return SleepLayer, Shift


def build_layers(kind: str, stages: int, args: argparse.Namespace) -> tuple[list, int]:
    """The benchmark model's layers (2 per stage) and width: Linear+Tanh blocks (the first after a Shift), or
    sleep layers."""
    import torch

    torch.manual_seed(0)
    sleep_layer, shift = layer_classes()
    count = CHUNKS_PER_STAGE * stages * (args.real_layers if kind == "real" else 1)
    if kind == "sleep":
        return [sleep_layer(args.sleep_width, args.sleep_ms / 1e3) for _ in range(count)], args.sleep_width
    blocks = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh()) for _ in range(count)]
    blocks[0].insert(0, shift(args.width))
    return blocks, args.width


class SavedBytes:
    """The bytes of autograd-saved tensors alive (parameters and their views left out; a tensor saved twice
    counts once), and their maximum. Use `pack` and `unpack` as saved_tensors_hooks."""

    def __init__(self, parameters: Any) -> None:
        self.excluded = {p.data_ptr() for p in parameters}
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: Any) -> _Held:
        return _Held(self, tensor)

    @staticmethod
    def unpack(held: _Held) -> Any:
        return held.tensor


class _Held:
    """A saved tensor in its holder: made, it adds the tensor's bytes to the live count; freed, it takes them off."""

    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: SavedBytes, tensor: Any) -> None:
        # A detached alias: holding a saved output itself (its grad_fn saved it) would make a cycle through the
        # graph that keeps both alive after the backward (the graph then looks leaked).
        self.meter, self.tensor, self.key = meter, tensor.detach(), None
        if tensor.data_ptr() in meter.excluded:
            return
        self.key = (tensor.data_ptr(), tensor.nbytes)
        count = meter.refs.get(self.key, 0)
        meter.refs[self.key] = count + 1
        if count == 0:
            meter.live += tensor.nbytes
            meter.peak = max(meter.peak, meter.live)

    def __del__(self) -> None:
        if self.key is None:
            return
        meter = self.meter
        meter.refs[self.key] -= 1
        if meter.refs[self.key] == 0:
            del meter.refs[self.key]
            meter.live -= self.key[1]


def check_sleep_layer(seconds: float = 0.02, width: int = 16) -> dict[str, float]:
    """On this process: F, B alone (input gradient only, plain autograd and the runtime's split) and W of a
    sleep layer take `seconds` each; raises RuntimeError if not."""
    import torch

    from hvdplus.torch.pipeline.pipeline_backward import backward_input, backward_weight

    layer = layer_classes()[0](width, seconds)
    params = list(layer.parameters())
    x = torch.randn(4, width, requires_grad=True)
    times = {}
    started = time.perf_counter()
    out = layer(x)
    times["F"] = time.perf_counter() - started
    started = time.perf_counter()
    torch.autograd.grad(out, x, torch.ones_like(out), retain_graph=True)
    times["B (autograd.grad w.r.t. the input)"] = time.perf_counter() - started
    started = time.perf_counter()
    _, work = backward_input((out,), (torch.ones_like(out),), (x,), params, final=False)
    times["B (runtime split)"] = time.perf_counter() - started
    started = time.perf_counter()
    backward_weight(work, final=False)
    times["W (runtime split)"] = time.perf_counter() - started
    if layer.weight.grad is None or layer.shift.grad is None:
        raise RuntimeError("the sleep layer's W left a parameter without a gradient")
    bad = {k: v for k, v in times.items() if not seconds * 0.9 < v < seconds * 1.6}
    if bad:
        raise RuntimeError(
            f"sleep layer: expected {seconds * 1e3:.0f} ms per pass, got "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in bad.items())
        )
    return times


# ============================================================================ workers (inside an MPI job)
def time_chunks(pipe: Any, rows: int, width: int, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """Median F, B, W (the runtime's split) and BW (its whole backward) of this rank's chunks on one micro-batch,
    and the bytes one chunk's forward saves."""
    import torch

    from hvdplus.torch.pipeline.pipeline_backward import backward_full, backward_input, backward_weight

    samples: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": []}
    chunk_bytes = 0
    for chunk in pipe.chunks.values():
        params = [p for p in chunk.parameters() if p.requires_grad]
        x = torch.randn(rows, width, requires_grad=True)
        meter = SavedBytes(params)
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            chunk(x)
        chunk_bytes = max(chunk_bytes, meter.peak)
        for i in range(warmup + repeats):
            x = torch.randn(rows, width, requires_grad=True)
            t0 = time.perf_counter()
            out = chunk(x)
            t1 = time.perf_counter()
            _, work = backward_input((out,), (torch.ones_like(out),), (x,), params, final=False)
            t2 = time.perf_counter()
            backward_weight(work, final=False)
            t3 = time.perf_counter()
            out = chunk(x)
            t4 = time.perf_counter()
            backward_full((out,), (torch.ones_like(out),), (x,), params, final=False)
            t5 = time.perf_counter()
            if i >= warmup:
                for op, seconds in (("F", t1 - t0), ("B", t2 - t1), ("W", t3 - t2), ("BW", t5 - t4)):
                    samples[op].append(seconds)
        for p in params:
            p.grad = None
    return {**{op: statistics.median(values) for op, values in samples.items()}, "chunk_bytes": chunk_bytes}


def bubble_worker(args: argparse.Namespace) -> None:
    """Every (schedule, M) of --schedules x --micro-batches at S = the job's size, one after another, each on a
    fresh model and Pipeline: chunk times, timed train_steps, one step with memory hooks."""
    import torch

    import hvdplus.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    results = [
        measure_schedule(key, int(m), args) for key in args.schedules.split(",") for m in args.micro_batches.split(",")
    ]
    everyone = hvd.allgather_object(results)
    if hvd.rank() == 0:
        Path(args.result_file).write_text(json.dumps(everyone))
    hvd.shutdown()


def measure_schedule(key: str, micro_batches: int, args: argparse.Namespace) -> dict[str, Any]:
    """This rank's measurements of one schedule and M (collective over the job)."""
    import torch

    import hvdplus.torch as hvd

    stages = hvd.size()
    name, virtual = SCHEDULES[key]
    kind = layer_kind(stages, args)
    layers, width = build_layers(kind, stages, args)
    chunks = stages * virtual
    pipe = hvd.pipeline.Pipeline(
        layers, stages, micro_batches, schedule=name, virtual_stages=virtual, balance=[len(layers) // chunks] * chunks
    )
    chunk_times = time_chunks(pipe, args.micro_rows, width)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.micro_rows * micro_batches, width, generator=generator)
    y = torch.randn(args.micro_rows * micro_batches, width, generator=generator)
    loss_fn = torch.nn.functional.mse_loss
    steps, op_times = [], {}
    for step in range(args.warmup + args.steps):
        hvd.barrier()
        started = time.perf_counter()
        pipe.train_step(x, y, loss_fn)
        ended = time.perf_counter()
        for p in pipe.parameters():
            p.grad = None
        if step >= args.warmup:
            steps.append([started, ended, sum(end - start for _, start, end in pipe.last_timings)])
            for action, start, end in pipe.last_timings:
                op_times.setdefault(action.op.value, []).append(end - start)
    timeline = [[a.op.value, a.micro_batch, a.chunk, start, end] for a, start, end in pipe.last_timings]
    hvd.barrier()
    meter = SavedBytes(pipe.parameters())
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        pipe.train_step(x, y, loss_fn)
    return {
        "schedule": key,
        "micro_batches": micro_batches,
        "stage": pipe.stage,
        "kind": kind,
        "steps": steps,
        "chunk_times": chunk_times,
        "op_median_s": {op: statistics.median(v) for op, v in op_times.items()},
        "peak_saved_bytes": meter.peak,
        "timeline": timeline,
    }


def compare_worker(args: argparse.Namespace) -> None:
    """Step times of the large model: Pipeline 1f1b over the job's ranks, or DistributedOptimizer data-parallel."""
    import torch

    import hvdplus.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    width = args.compare_width
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(args.compare_layers)]
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.compare_batch, width, generator=generator)
    y = torch.randn(args.compare_batch, width, generator=generator)
    loss_fn = torch.nn.functional.mse_loss
    if args.mode == "pipeline":
        pipe = hvd.pipeline.Pipeline(model, hvd.size(), args.compare_micro_batches, schedule="1f1b")
        optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)

        def step() -> None:
            pipe.train_step(x, y, loss_fn)
            optimizer.step()
            optimizer.zero_grad()
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
        )
        share = args.compare_batch // hvd.size()
        xs, ys = x[hvd.rank() * share : (hvd.rank() + 1) * share], y[hvd.rank() * share : (hvd.rank() + 1) * share]

        def step() -> None:
            optimizer.zero_grad()
            loss_fn(model(xs), ys).backward()
            optimizer.step()

    times = []
    for i in range(args.warmup + args.compare_steps):
        started = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    everyone = hvd.allgather_object(times)
    if hvd.rank() == 0:
        Path(args.result_file).write_text(json.dumps(everyone))
    hvd.shutdown()


# ============================================================================ driver
def layer_kind(stages: int, args: argparse.Namespace) -> str:
    return "real" if str(stages) in args.real_stages.split(",") else "sleep"


def run_job(ranks: int, label: str, extra: list[str], args: argparse.Namespace) -> Any:
    """One MPI job of `ranks` ranks running this script's worker with `extra` options; every rank's results (as
    rank 0 wrote them)."""
    options = [
        "--width",
        str(args.width),
        "--real-layers",
        str(args.real_layers),
        "--real-stages",
        args.real_stages,
        "--sleep-ms",
        str(args.sleep_ms),
        "--sleep-width",
        str(args.sleep_width),
        "--micro-rows",
        str(args.micro_rows),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--compare-width",
        str(args.compare_width),
        "--compare-layers",
        str(args.compare_layers),
        "--compare-batch",
        str(args.compare_batch),
        "--compare-steps",
        str(args.compare_steps),
        "--compare-micro-batches",
        str(args.compare_micro_batches),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        result_file = str(Path(tmp) / "result.json")
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--result-file",
            result_file,
            *options,
            *extra,
        ]
        return finish_job(label, start_mpi_job(ranks, command, {"OMP_NUM_THREADS": "1"}), args.timeout, result_file)


def summarize(rounds: list[list[dict]], key: str, stages: int, micro_batches: int) -> dict[str, Any]:
    """A configuration's row from its jobs (one per round, each a list of the ranks' results): per-stage bubbles
    (step wall time = the pipeline's makespan) over the timed steps of every round, simulator, theory."""
    name, virtual = SCHEDULES[key]
    rounds = [sorted(results, key=lambda r: r["stage"]) for results in rounds]
    per_round: list[list[list[float]]] = []  # round -> stage -> step -> bubble
    own: list[list[float]] = [[] for _ in range(stages)]
    makespans = []
    for results in rounds:
        per_round.append([[] for _ in range(stages)])
        for i in range(len(results[0]["steps"])):
            makespan = max(r["steps"][i][1] for r in results) - min(r["steps"][i][0] for r in results)
            makespans.append(makespan)
            for r in results:
                start, end, busy = r["steps"][i]
                per_round[-1][r["stage"]].append(1 - busy / makespan)
                own[r["stage"]].append(1 - busy / (end - start))
    bubble = [statistics.median(v for one in per_round for v in one[stage]) for stage in range(stages)]
    every_rank = [r for results in rounds for r in results]
    f, b, w, bw = (statistics.mean(r["chunk_times"][op] for r in every_rank) for op in ("F", "B", "W", "BW"))
    # Schedules without the B/W split run the whole backward, which costs less than B + W.
    times = (
        {"forward": f, "backward_input": b, "backward_weight": w}
        if name == "zero-bubble"
        else {"forward": f, "backward_input": bw, "backward_weight": 0.0}
    )
    schedule, owner = build_schedule(name, stages, micro_batches, virtual), chunk_stages(name, stages, virtual)
    sim = simulate(schedule, owner, **times)
    last = rounds[-1]
    hop = statistics.median(hop_latency(results, owner) for results in rounds)
    with_p2p = simulate(schedule, owner, **times, transfer=hop)
    origin = min(r["steps"][-1][0] for r in last)  # the last timed step's start: its timeline's zero
    return {
        "schedule": key,
        "stages": stages,
        "micro_batches": micro_batches,
        "virtual_stages": virtual,
        "layers": last[0]["kind"],
        "rounds": len(rounds),
        "bubble": bubble,
        "bubble_mean": statistics.mean(bubble),
        "bubble_max": max(bubble),
        "bubble_own": [statistics.median(values) for values in own],
        "bubble_per_round": [[statistics.median(steps) for steps in one] for one in per_round],
        "step_s_median": statistics.median(makespans),
        "chunk_F_B_W_BW_s": [f, b, w, bw],
        "chunk_saved_bytes": max(r["chunk_times"]["chunk_bytes"] for r in every_rank),
        "simulated": list(sim.bubble),
        "simulated_mean": statistics.mean(sim.bubble),
        "simulated_step_s": sim.makespan,
        "hop_latency_s": hop,
        "simulated_with_p2p": list(with_p2p.bubble),
        "simulated_with_p2p_mean": statistics.mean(with_p2p.bubble),
        "simulated_peak_chunks": list(sim.peak_activations),
        "theory": theoretical_bubble(name, stages, micro_batches, virtual),
        "theory_measured_times": theoretical_bubble(name, stages, micro_batches, virtual, f, b, w),
        "peak_saved_bytes": [max(results[s]["peak_saved_bytes"] for results in rounds) for s in range(stages)],
        "op_median_s": [r["op_median_s"] for r in last],
        "timeline_last_step": {
            r["stage"]: [[op, m, c, round(a - origin, 6), round(e - origin, 6)] for op, m, c, a, e in r["timeline"]]
            for r in last
        },
    }


def hop_latency(results: list[dict], owner: list[int]) -> float:
    """The median time from the end of a compute action to the start of the one on another stage that waits for
    its message (an activation or an input gradient), over the last timed step's waits; 0 if none waited."""
    ends, starts = {}, {}
    for r in results:
        previous_end = None
        for op, m, c, start, end in r["timeline"]:
            ends[(op, m, c)] = end
            starts[(op, m, c)] = (start, previous_end)
            previous_end = end
    hops = []
    for (op, m, c), (start, previous_end) in starts.items():
        if op == "F" and c > 0 and owner[c - 1] != owner[c]:
            producers = [("F", m, c - 1)]
        elif op in ("B", "BW") and c + 1 < len(owner) and owner[c + 1] != owner[c]:
            producers = [("B", m, c + 1), ("BW", m, c + 1)]
        else:  # W, or the producer is on this stage
            continue
        for producer in producers:
            if producer in ends and (previous_end is None or previous_end < ends[producer] < start):
                hops.append(start - ends[producer])  # this stage was idle when the message left
    return statistics.median(hops) if hops else 0.0


def judge(rows: list[dict]) -> None:
    """Add each row's target verdict ("target": None where the issue sets none)."""
    baseline = {(r["stages"], r["micro_batches"]): r for r in rows if r["schedule"] == "1f1b"}
    for row in rows:
        row["target"] = None
        if row["schedule"] in ("gpipe", "1f1b"):
            error = max(abs(b - row["theory"]) for b in row["bubble"])
            row["target"] = {
                "passed": error <= BUBBLE_TOLERANCE,
                "max_abs_error": error,
                "text": f"|err| {100 * error:.1f} pp (<= {100 * BUBBLE_TOLERANCE:.0f} pp)",
            }
        elif row["schedule"] in ("zb-h1", "zb-v"):
            ref = baseline.get((row["stages"], row["micro_batches"]))
            if ref is None:
                row["target"] = {"passed": None, "text": "no 1f1b run to compare with"}
                continue
            ratio = row["bubble_mean"] / ref["bubble_mean"] if ref["bubble_mean"] > 0 else float("inf")
            memory = row["peak_saved_bytes"][0] / ref["peak_saved_bytes"][0]
            row["target"] = {
                "passed": ratio <= ZB_BUBBLE_RATIO and memory <= ZB_MEMORY_RATIO,
                "bubble_ratio": ratio,
                "memory_ratio": memory,
                "text": f"{ratio:.2f}x 1f1b (<= {ZB_BUBBLE_RATIO}), mem {memory:.2f}x (<= {ZB_MEMORY_RATIO})",
            }


def run_bubbles(args: argparse.Namespace) -> list[dict]:
    """Every configuration's row. A job covers one stage count and schedule (--group schedule) or one stage count
    (--group stages); --rounds runs every job that many times, in alternating order."""
    keys = args.schedules.split(",")
    jobs = []  # (stages, [(schedule, M), ...])
    for stages in (int(s) for s in args.stages.split(",")):
        for group in [keys] if args.group == "stages" else [[k] for k in keys]:
            configs = [(key, int(m)) for key in group for m in args.micro_batches.split(",")]
            for key, m in configs:
                if key == "interleaved" and m % stages:
                    print(f"skip {key} S={stages} M={m}: M must be a multiple of S", flush=True)
            configs = [(key, m) for key, m in configs if not (key == "interleaved" and m % stages)]
            if configs:
                jobs.append((stages, configs))
    if any(layer_kind(stages, args) == "sleep" for stages, _ in jobs):
        times = check_sleep_layer()
        print(
            "sleep layer check (20 ms per pass): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()),
            flush=True,
        )
    samples: dict[tuple[int, str, int], list[list[dict]]] = {}
    loads: dict[tuple[int, str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for stages, configs in jobs if round_index % 2 == 0 else jobs[::-1]:
            started, load = time.perf_counter(), os.getloadavg()[0]
            schedules = sorted({k for k, _ in configs}, key=keys.index)
            by_rank = run_job(
                stages,
                f"{','.join(schedules)} S={stages}",
                [
                    "--mode",
                    "bubble",
                    "--schedules",
                    ",".join(schedules),
                    "--micro-batches",
                    ",".join(str(m) for m in sorted({m for _, m in configs})),
                ],
                args,
            )
            for index, (key, m) in enumerate(sorted(configs, key=lambda c: (keys.index(c[0]), c[1]))):
                results = [rank_results[index] for rank_results in by_rank]
                if (results[0]["schedule"], results[0]["micro_batches"]) != (key, m):
                    raise RuntimeError(
                        f"job results out of order: expected {key} M={m}, got "
                        f"{results[0]['schedule']} M={results[0]['micro_batches']}"
                    )
                samples.setdefault((stages, key, m), []).append(results)
                loads.setdefault((stages, key, m), []).append(load)
            print(
                f"  round {round_index + 1}: {','.join(schedules)} S={stages} M={args.micro_batches}: job "
                f"{time.perf_counter() - started:.0f} s (load average {load:.2f} before it)",
                flush=True,
            )
    rows = []
    for (stages, key, m), rounds in samples.items():
        rows.append({**summarize(rounds, key, stages, m), "load_average_1min_before_jobs": loads[(stages, key, m)]})
    judge(rows)
    return rows


def run_compare(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.compare_rounds < 1:
        return None
    samples: dict[str, list[float]] = {mode: [] for mode in COMPARE_MODES}
    for round_index in range(args.compare_rounds):
        for mode in COMPARE_MODES if round_index % 2 == 0 else COMPARE_MODES[::-1]:
            samples[mode] += run_job(2, mode, ["--mode", mode], args)[0]
    medians = {mode: statistics.median(times) for mode, times in samples.items()}
    return {
        "ranks": 2,
        "layers": args.compare_layers,
        "width": args.compare_width,
        "batch": args.compare_batch,
        "micro_batches": args.compare_micro_batches,
        "rounds": args.compare_rounds,
        "step_s": samples,
        "step_s_median": medians,
        "ratio": medians["pipeline"] / medians["data-parallel"],
    }


def print_table(rows: list[dict], compare: dict[str, Any] | None) -> None:
    print(
        "\nBubble per stage (idle / step wall time), median over timed steps, mean and max over stages; sim: "
        "simulator (mean) with the measured chunk F/B/W,\n+p2p: and the measured median hop latency as transfer "
        "time; theory: F = B = W; act0: stage 0's peak autograd-saved bytes"
    )
    print(
        f"{'schedule':11} {'S':>2} {'M':>3} {'layers':6} {'mean':>6} {'max':>6} {'sim':>6} {'sim+p2p':>7} "
        f"{'theory':>6} {'act0 KiB':>9}  target"
    )
    for r in rows:
        target = r["target"]
        verdict = (
            "-"
            if target is None
            else (f"{'n/a' if target['passed'] is None else 'PASS' if target['passed'] else 'FAIL'} {target['text']}")
        )
        print(
            f"{r['schedule']:11} {r['stages']:>2} {r['micro_batches']:>3} {r['layers']:6} "
            f"{r['bubble_mean']:6.3f} {r['bubble_max']:6.3f} {r['simulated_mean']:6.3f} "
            f"{r['simulated_with_p2p_mean']:7.3f} {r['theory']:6.3f} "
            f"{r['peak_saved_bytes'][0] / 1024:9.0f}  {verdict}"
        )
    if compare:
        m = compare["step_s_median"]
        print(
            f"\nstep time, {compare['layers']} x (Linear({compare['width']}, {compare['width']}) + Tanh), batch "
            f"{compare['batch']}, {compare['ranks']} ranks: pipeline 1f1b S=2 M={compare['micro_batches']} "
            f"{m['pipeline'] * 1e3:.1f} ms, data-parallel {m['data-parallel'] * 1e3:.1f} ms: "
            f"ratio pipeline / data-parallel {compare['ratio']:.2f}"
        )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage_counts = sorted({r["stages"] for r in rows})
    fig, axes = plt.subplots(1, len(stage_counts), figsize=(6 * len(stage_counts), 4.5), squeeze=False)
    colors = dict(zip(SCHEDULES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, stages in zip(axes[0], stage_counts):
        for key in SCHEDULES:
            mine = sorted(
                (r for r in rows if r["stages"] == stages and r["schedule"] == key), key=lambda r: r["micro_batches"]
            )
            if not mine:
                continue
            ms = [r["micro_batches"] for r in mine]
            ax.plot(ms, [r["theory"] for r in mine], "-", color=colors[key], label=f"{key} theory")
            ax.plot(ms, [r["simulated_mean"] for r in mine], ":", color=colors[key], alpha=0.7)
            means = [r["bubble_mean"] for r in mine]
            offset = 1 + 0.025 * (list(SCHEDULES).index(key) - 2)  # markers side by side (log x axis)
            upper = [r["bubble_max"] - m for r, m in zip(mine, means)]
            ax.errorbar(
                [m * offset for m in ms],
                means,
                yerr=[[0] * len(mine), upper],
                fmt="o",
                color=colors[key],
                capsize=3,
                label=f"{key} measured",
            )
        ax.set_xscale("log", base=2)
        ticks = sorted({r["micro_batches"] for r in rows})
        ax.set_xticks(ticks, [str(m) for m in ticks])
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("bubble fraction")
        ax.set_title(
            f"S = {stages} ({mine[0]['layers'] if mine else ''} layers); markers: measured mean "
            "(bar to max), lines: theory, dotted: simulator",
            fontsize=8,
        )
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ", ".join(SCHEDULES)
    )
    parser.add_argument("--stages", default="2,4", help="comma-separated stage counts (one rank per stage)")
    parser.add_argument("--micro-batches", default=None, help="comma-separated M (default 4,8,16; --quick: 4)")
    parser.add_argument("--real-stages", default="2", help="stage counts that use real Linear layers (others sleep)")
    parser.add_argument("--width", type=int, default=512, help="real layers: Linear width")
    parser.add_argument(
        "--real-layers",
        type=int,
        default=2,
        help="real layers: Linear+Tanh blocks per chunk of the 2-chunk split (4 per chunk with 1 chunk per stage)",
    )
    parser.add_argument("--sleep-ms", type=float, default=5.0, help="sleep layers: ms per layer and pass (2 per chunk)")
    parser.add_argument("--sleep-width", type=int, default=256, help="sleep layers: activation width")
    parser.add_argument("--micro-rows", type=int, default=512, help="rows per micro-batch (batch = M x this)")
    parser.add_argument("--steps", type=int, default=None, help="timed train_steps per job (default 5; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --quick 1)")
    parser.add_argument(
        "--compare-rounds",
        type=int,
        default=None,
        help="jobs per mode for the step-time comparison, alternating (default 2; --quick 1; 0 skips it)",
    )
    parser.add_argument("--compare-steps", type=int, default=None, help="timed steps per comparison job (default 8)")
    parser.add_argument("--compare-layers", type=int, default=8)
    parser.add_argument("--compare-width", type=int, default=2048)
    parser.add_argument("--compare-batch", type=int, default=64)
    parser.add_argument("--compare-micro-batches", type=int, default=8)
    parser.add_argument(
        "--group",
        choices=("schedule", "stages"),
        default=None,
        help="what one MPI job covers: a schedule's M values at one S (default), or every schedule "
        "and M at one S (--quick's default: fewer process starts)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="jobs per configuration, in alternating order; "
        "bubbles are medians over the timed steps of all (default 2; --quick 1)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: M = 4, 1 + 2 steps, 1 round, 1 comparison round, one job per S"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job before it is stopped")
    parser.add_argument("--json", default="bench_pipeline.json")
    parser.add_argument("--plot", default="bench_pipeline.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("bubble", *COMPARE_MODES), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {
        "micro_batches": ("4,8,16", "4"),
        "steps": (5, 2),
        "warmup": (2, 1),
        "compare_rounds": (2, 1),
        "compare_steps": (8, 3),
        "group": ("schedule", "stages"),
        "rounds": (2, 1),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = set(args.schedules.split(",")) - set(SCHEDULES)
    if unknown:
        parser.error(f"unknown --schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        (bubble_worker if args.mode == "bubble" else compare_worker)(args)
        return 0
    started = time.perf_counter()
    rows = run_bubbles(args)
    compare = run_compare(args)
    print_table(rows, compare)
    wall = time.perf_counter() - started
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "wall_s": wall,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "result_file")},
        "rows": rows,
        "compare": compare,
    }
    Path(args.json).write_text(json.dumps(report, indent=1))
    if rows:
        plot(rows, args.plot)
    print(f"\nwrote {args.json}" + (f" and {args.plot}" if rows else "") + f"; total {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
