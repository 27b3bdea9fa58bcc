"""Three jobs in one process: init, train with the planned path, shutdown, three times. Each job's groups meet in
the store hvdplusrun holds for the whole run under the job's own incarnation (a job never reads the last job's
keys). Prints one JSON line per rank and job."""

import json

import torch

import hvdplus.torch as hvd
from hvdplus.common.basics import runtime

for job in range(3):
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.full((3, 4), float(hvd.rank() + 1))).sum().backward()
        optimizer.step()
    weight = model.weight.detach().clone()
    report = {
        "rank": hvd.rank(),
        "job": job,
        "incarnation": runtime().engine.planned_meeting.incarnation,
        "planned": optimizer._reducer is not None,
        "agree": bool(torch.allclose(hvd.allreduce(weight, op=hvd.Average, name="check"), weight)),
        "weight": weight.flatten().tolist(),
    }
    print(json.dumps(report), flush=True)
    del optimizer
    hvd.shutdown()
