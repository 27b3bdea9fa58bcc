"""A small hvdplus.torch job: each rank prints one JSON line with its place and an allreduce result."""

import json
import os
import socket
import sys

import torch

import hvdplus.torch as hvd

hvd.init()
library = ""
if hvd.mpi_enabled():
    from mpi4py import MPI

    library = MPI.Get_library_version().split(",")[0].strip()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="report").item()
print(
    json.dumps(
        {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "local_rank": hvd.local_rank(),
            "cross_rank": hvd.cross_rank(),
            "host": socket.gethostname(),
            "sum": total,
            "engine": "mpi" if hvd.mpi_enabled() else "gloo",
            "mpi_library": library,
            "pid": os.getpid(),
        }
    ),
    flush=True,
)
hvd.shutdown()
sys.exit(0)
