"""A job where rank 1 misbehaves after init: `raise` raises, `kill` SIGKILLs itself, `sleep` never ends; with
`spam`, nobody fails: every rank prints 200 lines (40 KB) a step for 100 allreduces, then 'finished <rank>';
`raise-in-collectives`: every rank runs allreduces, and rank 1 raises at its 21st; `freeze`: rank 1 stops itself
(SIGSTOP) there instead; `freeze-in-data-call`: it stops once the 21st is agreed, as its engine call starts (the
peers wait inside theirs); `freeze-in-planned-step`: every rank trains with DistributedOptimizer, whose steps run
on the planned path from the second on, and rank 1 stops itself before its 21st step (rank 0 prints
'planned <number of frozen plans>' first); `freeze-in-planned-step-with-join`: the same, with rank 2 in hvd.join()
from its 11th step on (it serves the plan with zeros when rank 1 freezes).

Every rank prints 'pid <rank> <pid>'; rank 1 prints 'failing at <time.time()>' right before it fails."""

import os
import signal
import sys
import time

import torch

import hvdplus.torch as hvd

hvd.init()
print(f"pid {hvd.rank()} {os.getpid()}", flush=True)
if sys.argv[1] == "spam":  # enough output to fill any pipe nobody reads
    for _ in range(100):  # the same number of allreduces on every rank
        print(f"rank {hvd.rank()} step {'x' * 200}\n" * 200, end="", flush=True)
        hvd.allreduce(torch.ones(1), name="step")
    print(f"finished {hvd.rank()}", flush=True)
    sys.exit(0)
if sys.argv[1] in ("raise-in-collectives", "freeze", "freeze-in-data-call"):  # every rank in allreduces
    for step in range(100000):
        if hvd.rank() == 1 and step == 20 and sys.argv[1] == "freeze-in-data-call":
            from hvdplus.common import basics

            engine = basics.runtime().engine
            run_allreduce = engine.start_allreduce

            def freeze_then_allreduce(*args, run_allreduce=run_allreduce, **kwargs):
                print(f"failing at {time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
                return run_allreduce(*args, **kwargs)

            engine.start_allreduce = freeze_then_allreduce
        if hvd.rank() == 1 and step == 20 and sys.argv[1] != "freeze-in-data-call":
            print(f"failing at {time.time()}", flush=True)
            if sys.argv[1] == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(600)  # if continued, still silent
            raise RuntimeError("rank 1 fails on purpose")
        hvd.allreduce(torch.ones(1), name="step")
if sys.argv[1].startswith("freeze-in-planned-step"):  # every rank waits in a planned step when rank 1 freezes
    from hvdplus.common.planned_steps import frozen_plans

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for step in range(100000):
        if step == 10 and hvd.rank() == 2 and sys.argv[1].endswith("with-join"):
            print("joining", flush=True)
            hvd.join()
        if step == 20:
            if hvd.rank() == 0:
                print(f"planned {len(frozen_plans())}", flush=True)
            if hvd.rank() == 1:
                print(f"failing at {time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(600)  # if continued, still silent
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
if hvd.rank() == 1 and sys.argv[1] != "sleep":
    time.sleep(0.5)
    print(f"failing at {time.time()}", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
