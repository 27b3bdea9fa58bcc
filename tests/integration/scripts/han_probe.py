"""Under mpirun with 4 ranks on 2 named hosts (a, a, b, b): prints one JSON line per rank with what
han_serves_allreduce says and whether hierarchical_groups builds the groups or falls back, and why."""

import json

from mpi4py import MPI

from hvdplus.common.data.hierarchical import hierarchical_groups
from hvdplus.common.data.mpi_tool import han_serves_allreduce
from hvdplus.common.engines.mpi import MPIEngine
from hvdplus.common.topology import Topology

engine = MPIEngine()
hosts = tuple("ab"[rank * 2 // engine.size] for rank in range(engine.size))
groups, reason = hierarchical_groups(engine, Topology(engine.rank, hosts), range(engine.size))
print(
    json.dumps(
        {
            "rank": engine.rank,
            "han": han_serves_allreduce(),
            "hierarchical": groups is not None,
            "reason": reason,
            "thread_level_kept": MPI.Query_thread() == MPI.THREAD_MULTIPLE,
        }
    )
)
engine.shutdown()
