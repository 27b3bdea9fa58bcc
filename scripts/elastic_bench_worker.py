"""The worker of scripts/bench_elastic.py: one process of an elastic job, or the single process of the commit test.

    elastic_bench_worker.py train     an elastic job (under hvdplusrun): an MLP trained with AdamW, commit every step
    elastic_bench_worker.py sync      an elastic job that grows from 1 to 2 workers, then times state.sync()
    elastic_bench_worker.py commit    one process (HOROVOD_RANK=0, HOROVOD_SIZE=1): times TorchState.save/commit

Everything is printed as JSON lines {"ev": ..., "t": time.time(), ...}; the driver reads them from hvdplusrun's
tagged output. Only user-level API is used to observe the elastic loop: a TorchState subclass overrides the
documented hooks (check_host_updates, restore, reset, sync) to timestamp them, so the phases the driver reports
are what a training script can see. Internals read for reporting only (never changed): the snapshot buffers'
sizes (TorchState._handlers[*]._snapshot) and the generation (hvdplus.common.basics.elastic_worker()).

Environment (train): BENCH_PARAMS, BENCH_WIDTH (the MLP), BENCH_TARGET (return after BENCH_AFTER steps at this
size), BENCH_SLEEP (seconds between steps), BENCH_KILL ("worker_id:step": that worker SIGKILLs itself right after
committing that step, in its first life only), BENCH_MAX_STEPS (a safety stop).
Environment (sync): BENCH_PARAMS, BENCH_WIDTH, BENCH_ROUNDS, BENCH_SLEEP. (commit): BENCH_PARAMS, BENCH_WIDTH,
BENCH_ROUNDS.
"""

import time

T_START = time.time()  # the first thing the interpreter runs of this script, before any import

import copy  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import hvdplus.torch as hvd  # noqa: E402
from hvdplus.common.basics import elastic_worker  # noqa: E402
from hvdplus.common.exceptions import HostsUpdatedInterrupt  # noqa: E402

T_IMPORTED = time.time()
WORKER = os.environ.get("HVDPLUS_ELASTIC_WORKER", "single")
FIRST_LIFE = os.environ.get("HVDPLUS_ELASTIC_GENERATION", "0") == "0"
BATCH = 8


def say(ev: str, **fields: Any) -> None:
    print(json.dumps({"ev": ev, "t": time.time(), "worker": WORKER, **fields}), flush=True)


def generation() -> int:
    worker = elastic_worker()
    return -1 if worker is None or worker.plan is None else worker.plan.generation


def where() -> dict[str, int]:
    return {"gen": generation(), "rank": hvd.rank(), "size": hvd.size()}


def mlp(params: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = max(1, round(params / (width * (width + 1))))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nested dict/list/tuple, each storage once."""
    found: dict[int, torch.Tensor] = {}

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(value.untyped_storage().data_ptr() or id(value), value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(tree)
    return list(found.values())


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a commit must copy: the model's state_dict tensors and the optimizer's state tensors."""
    return tensors_of(model.state_dict()) + tensors_of(optimizer.state_dict()["state"])


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class TimedState(hvd.elastic.TorchState):
    """A TorchState whose elastic hooks print when they run (user-level observation of the elastic loop)."""

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            say("interrupt", **where())
            raise

    def restore(self) -> None:
        say("restore")  # a HorovodInternalError was caught: the failure has reached this worker
        super().restore()

    def reset(self) -> None:
        super().reset()  # runs after hvd.shutdown() + hvd.init() joined the next generation
        say("reset", **where())

    def sync(self) -> None:
        say("sync_begin", **where())
        started = time.perf_counter()
        super().sync()
        say("sync_end", s=time.perf_counter() - started, **where())


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def setup(params: int, width: int) -> tuple[torch.nn.Module, Any, TimedState, torch.Tensor, torch.Tensor]:
    """After hvd.init(): the model, a DistributedOptimizer over AdamW, the state and a fixed batch."""
    model = mlp(params, width)
    started = time.perf_counter()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4)  # torch.optim's first use imports torch._dynamo
    say("optimizer", s=time.perf_counter() - started, **where())
    optimizer = hvd.DistributedOptimizer(adamw, named_parameters=model.named_parameters())
    state = TimedState(model, optimizer, step=0)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, width, generator=generator), torch.randn(BATCH, width, generator=generator)
    return model, optimizer, state, x, y


def elastic_start() -> None:
    say("start", t_start=T_START, t_imported=T_IMPORTED, first_life=FIRST_LIFE)
    hvd.init()
    say("init", **where())


# ============================================================================ train: recovery and scale-up
def run_train() -> None:
    params, width = int(float(os.environ["BENCH_PARAMS"])), int(os.environ["BENCH_WIDTH"])
    target, after = int(os.environ["BENCH_TARGET"]), int(os.environ.get("BENCH_AFTER", "5"))
    pause, max_steps = float(os.environ.get("BENCH_SLEEP", "0.02")), int(os.environ.get("BENCH_MAX_STEPS", "3000"))
    kill_worker, _, kill_step = os.environ.get("BENCH_KILL", "::").partition(":")
    elastic_start()
    model, optimizer, state, x, y = setup(params, width)
    say("setup", **where())

    @hvd.elastic.run
    def train(state: TimedState) -> None:
        at_size = 0  # steps in this generation: equal on every rank, so every rank returns at the same step
        while state.step < max_steps:
            if hvd.size() == target and at_size >= after:
                return
            train_step(model, optimizer, x, y)
            state.step += 1
            state.commit()
            at_size += 1
            say("step", step=state.step, **where())
            if FIRST_LIFE and WORKER == kill_worker and str(state.step) == kill_step:
                say("kill", step=state.step, **where())
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(pause)

    train(state)
    say("done", step=state.step, **where())


# ============================================================================ sync: state.sync() after a reset
def run_sync() -> None:
    params, width = int(float(os.environ["BENCH_PARAMS"])), int(os.environ["BENCH_WIDTH"])
    rounds, pause = int(os.environ.get("BENCH_ROUNDS", "5")), float(os.environ.get("BENCH_SLEEP", "0.02"))
    elastic_start()
    model, optimizer, state, x, y = setup(params, width)
    say("setup", **where())

    @hvd.elastic.run
    def train(state: TimedState) -> None:
        while hvd.size() < 2:  # one worker until the driver adds the second host
            train_step(model, optimizer, x, y)
            state.step += 1
            state.commit()
            say("step", step=state.step, **where())
            time.sleep(pause)
        train_step(model, optimizer, x, y)
        state.step += 1
        state.commit()
        say("step", step=state.step, **where())
        measure_sync(model, optimizer, state, rounds)

    train(state)
    say("done", step=state.step, **where())


def timed(op: Callable[[], Any]) -> float:
    hvd.barrier()
    started = time.perf_counter()
    op()
    return time.perf_counter() - started


def measure_sync(model: torch.nn.Module, optimizer: Any, state: TimedState, rounds: int) -> None:
    """Interleaved rounds of state.sync() and of one hvd.broadcast_ of a flat tensor of the same bytes, plus
    state.commit() and state.save() in this 2-rank elastic job; the slowest rank's times, printed by rank 0."""
    moved = nbytes(state_tensors(model, optimizer))
    flat = torch.zeros(moved // 4, dtype=torch.float32)
    ops = {
        "sync": state.sync,
        "broadcast": lambda: hvd.broadcast_(flat, root_rank=0, name="bench.flat"),
        "commit": state.commit,
        "save": state.save,
    }
    names = list(ops)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            times[name].append(timed(ops[name]))
    flat_times = torch.tensor([times[name] for name in names], dtype=torch.float64)
    slowest = hvd.allreduce(flat_times, op=hvd.Max, name="bench.slowest")
    if hvd.rank() == 0:
        say(
            "syncbench",
            bytes=moved,
            params=sum(p.numel() for p in model.parameters()),
            times={name: slowest[i].tolist() for i, name in enumerate(names)},
            **where(),
        )


# ============================================================================ commit: one process
def run_commit() -> None:
    params, width, rounds = (
        int(float(os.environ["BENCH_PARAMS"])),
        int(os.environ["BENCH_WIDTH"]),
        int(os.environ.get("BENCH_ROUNDS", "7")),
    )
    model = mlp(params, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, width, generator=generator), torch.randn(BATCH, width, generator=generator)
    train_step(model, optimizer, x, y)  # the optimizer's state (exp_avg, exp_avg_sq, step) now exists
    live = state_tensors(model, optimizer)
    buffers = [torch.empty_like(t) for t in live]

    def copy_baseline() -> None:
        for buffer, tensor in zip(buffers, live):
            buffer.copy_(tensor)

    copy_baseline()  # untimed: the first touch of fresh buffers pays page faults
    quiet_before = [timed_local(copy_baseline) for _ in range(rounds)]  # before hvd.init(): nothing else runs
    del buffers  # the state's memory is measured without the baseline's buffers
    hvd.init()
    rss_before = rss_bytes()
    state = hvd.elastic.TorchState(model, optimizer, step=0)  # the constructor commits once: buffers allocated
    rss_after = rss_bytes()
    for _ in range(3):
        state.save()
    rss_after_saves = rss_bytes()
    snapshot = [t for handler in state._handlers.values() for t in tensors_of(handler._snapshot.tree)]
    buffers = [torch.empty_like(t) for t in live]

    def horovod_deepcopy() -> None:
        kept = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
        del kept

    ops = {"copy_baseline": copy_baseline, "save": state.save, "commit": state.commit, "deepcopy": horovod_deepcopy}
    names = list(ops)
    for name in names:
        ops[name]()  # untimed warm-up of each, the baseline's fresh buffers included
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        order = names[shift:] + names[:shift]
        for name in order if index % 2 == 0 else order[::-1]:
            times[name].append(timed_local(ops[name]))
    hvd.shutdown()
    quiet_after = [timed_local(copy_baseline) for _ in range(rounds)]
    say(
        "commitbench",
        params=sum(p.numel() for p in model.parameters()),
        state_bytes=nbytes(live),
        tensors=len(live),
        snapshot_bytes=nbytes(snapshot),
        snapshot_tensors=len(snapshot),
        rss_before_state=rss_before,
        rss_after_state=rss_after,
        rss_after_saves=rss_after_saves,
        times=times,
        quiet_copy_before=quiet_before,
        quiet_copy_after=quiet_after,
        threads=torch.get_num_threads(),
        median={name: statistics.median(values) for name, values in times.items()},
    )


def timed_local(op: Callable[[], Any]) -> float:
    started = time.perf_counter()
    op()
    return time.perf_counter() - started


if __name__ == "__main__":
    {"train": run_train, "sync": run_sync, "commit": run_commit}[sys.argv[1]]()
    sys.stdout.flush()
