"""Prints one JSON line: this rank (from whichever launcher started it), its OMP_NUM_THREADS, and, with --torch,
the intra-op threads torch starts with."""

import json
import os
import sys

rank = next(os.environ[v] for v in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if v in os.environ)
seen = {"rank": int(rank), "omp": os.environ.get("OMP_NUM_THREADS")}
if "--torch" in sys.argv:
    import torch

    seen["torch_threads"] = torch.get_num_threads()
print(json.dumps(seen), flush=True)
