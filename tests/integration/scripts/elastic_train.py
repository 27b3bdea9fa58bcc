"""An elastic training job for the tests: every rank trains the same tiny model on the same data, so the averaged
gradient does not depend on the size and the final weights equal a one-process run of STEPS steps.

Environment: STEPS (default 30), SLEEP between steps (s), FAIL="<worker id>:<step>:<raise|kill|exit>[,...]" (the
worker fails right after the commit of that step, in its first life only: a restarted worker id does not fail
again), STOP_FILE (train until this file exists, agreed by an allreduce, instead of STEPS), SAMPLER=1 (an
ElasticSampler over 103 samples in batches of 4, printing each committed batch's indices), PROCESS_SET=1 (use a
process set registered before the first reset after it), ZERO=1 (print the error TorchState gives a ZeroOptimizer
and exit), KILL_IN_RESET=<worker id> (that worker is killed by its reset callback: after it joined the next
generation, before the state sync), WAIT_AT_STEP (after that step's commit, every rank waits for
a host change with state.wait_for_host_updates), LATE_START_DELAY (a worker started for a later generation
sleeps that long before hvd.init, as a slow import would), START_GATE (such a worker waits for this file to exist
before hvd.init: a slow import that lasts until the test ends it), HANG_AT_EXIT=<worker id> (that worker hangs at exit
unless it finished training, as one stuck in a collective would), WAIT_AT_END (once training is over, every rank
waits for a host change with state.wait_for_host_updates before it exits).
Prints one JSON line per committed step: {"step", "rank", "size", "worker", "generation", "t"}, and {"final": ...}.
"""

import atexit
import json
import os
import signal
import sys
import time

import torch

import hvdplus.torch as hvd
from hvdplus.common.basics import elastic_worker

STEPS = int(os.environ.get("STEPS", "30"))
SLEEP = float(os.environ.get("SLEEP", "0"))
STOP_FILE = os.environ.get("STOP_FILE")
WAIT_AT_STEP = int(os.environ.get("WAIT_AT_STEP", "0"))
WORKER = os.environ["HVDPLUS_ELASTIC_WORKER"]
FIRST_LIFE = os.environ["HVDPLUS_ELASTIC_GENERATION"] == "0" or os.environ.get("FAIL_LATE") == "1"
FAILURES = {
    int(step): how
    for wid, step, how in (f.split(":") for f in os.environ.get("FAIL", "").split(",") if f)
    if wid == WORKER
}

if os.environ["HVDPLUS_ELASTIC_GENERATION"] != "0":
    time.sleep(float(os.environ.get("LATE_START_DELAY", "0")))
    while not os.path.exists(os.environ.get("START_GATE", os.curdir)):
        time.sleep(0.05)
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters()
)
if os.environ.get("ZERO"):
    try:
        hvd.elastic.TorchState(
            model,
            hvd.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()),
        )
    except TypeError as exc:
        print(json.dumps({"zero_error": str(exc)}), flush=True)
    sys.exit(0)
sampler = hvd.elastic.ElasticSampler(list(range(103)), shuffle=True, seed=7) if os.environ.get("SAMPLER") else None
extra = {"sampler": sampler} if sampler is not None else {}
state = hvd.elastic.TorchState(model, optimizer, step=0, epoch=0, **extra)
finished = False
if os.environ.get("HANG_AT_EXIT") == WORKER:
    atexit.register(lambda: finished or time.sleep(600))
if os.environ.get("KILL_IN_RESET") == WORKER:  # dies in the new generation, before its state sync
    state.register_reset_callbacks([lambda: os.kill(os.getpid(), signal.SIGKILL)])
process_set = hvd.add_process_set([0, 1]) if os.environ.get("PROCESS_SET") and hvd.size() > 1 else None


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def fail_if_asked(step: int) -> None:
    how = FAILURES.get(step) if FIRST_LIFE else None
    if how == "raise":
        raise RuntimeError(f"worker {WORKER} fails on purpose at step {step}")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        sys.exit(3)


def stop_now(step: int) -> bool:
    if STOP_FILE is None:
        return step >= STEPS
    asked = torch.tensor([float(os.path.exists(STOP_FILE))])
    return bool(hvd.allreduce(asked, op=hvd.Max, name=f"stop.{step}").item())


def train_step() -> None:
    inputs = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) / 32
    optimizer.zero_grad()
    ((model(inputs) - 1.0) ** 2).mean().backward()
    optimizer.step()


def train_epochs(state) -> None:
    """SAMPLER mode: two epochs over the ElasticSampler, each committed batch's indices printed."""
    while state.epoch < 2:
        indices = list(sampler)  # what is left of the epoch for this rank, dealt over the current size
        for start in range(0, len(indices), 4):
            train_step()
            sampler.record_batch(start // 4, 4)
            state.step += 1
            state.commit()
            say(
                step=state.step,
                rank=hvd.rank(),
                size=hvd.size(),
                worker=WORKER,
                epoch=state.epoch,
                generation=elastic_worker().plan.generation,
                indices=indices[start : start + 4],
            )
            fail_if_asked(state.step)
            time.sleep(SLEEP)
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()


@hvd.elastic.run
def train(state):
    if process_set is not None and elastic_worker().plan.generation > 0:
        try:
            hvd.allreduce(torch.ones(1), process_set=process_set, name="after.reset")
        except ValueError as exc:
            say(process_set_error=str(exc), rank=hvd.rank())
    if sampler is not None:
        return train_epochs(state)
    while not stop_now(state.step):
        train_step()
        state.step += 1
        state.commit()
        say(
            step=state.step,
            rank=hvd.rank(),
            size=hvd.size(),
            worker=WORKER,
            generation=elastic_worker().plan.generation,
            t=time.time(),
        )
        if state.step == WAIT_AT_STEP:
            say(waiting=True, rank=hvd.rank())
            say(waited=state.wait_for_host_updates(60), rank=hvd.rank())
        fail_if_asked(state.step)
        time.sleep(SLEEP)


train(state)
finished = True
if os.environ.get("WAIT_AT_END"):
    say(ended=True, rank=hvd.rank())
    say(waited_at_end=state.wait_for_host_updates(60), rank=hvd.rank())
say(
    final=[round(v, 7) for v in model.weight.flatten().tolist() + model.bias.tolist()],
    rank=hvd.rank(),
    size=hvd.size(),
    worker=WORKER,
    steps=state.step,
)
