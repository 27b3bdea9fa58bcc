"""HOROVOD_AUTOTUNE: allreduces stay correct while rank 0 tunes, and every rank ends on the same settings."""

import dataclasses
import sys

import torch

import hvdplus.torch as hvd
from hvdplus.common.basics import runtime

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 150
SIZES = (1, 10, 1000, 5000, 300_000)  # up to 1.2 MB: the fusion thresholds tried make a difference

hvd.init()
for step in range(STEPS):
    handles = [
        hvd.allreduce_async(torch.full((n,), float(hvd.rank() + step)), op=hvd.Sum, name=f"grad{i}")
        for i, n in enumerate(SIZES)
    ]
    expected = float(sum(rank + step for rank in range(hvd.size())))
    for n, handle in zip(SIZES, handles):
        result = hvd.synchronize(handle)
        assert result.shape == (n,) and bool(torch.all(result == expected)), (step, n, result[:3], expected)
tuned = sorted(dataclasses.asdict(runtime().coordinator.tunables).items())
print(f"rank {hvd.rank()}: {STEPS} steps correct; tuned {tuned}")
hvd.shutdown()
