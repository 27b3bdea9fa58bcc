#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo on 2 ranks, once over MPI (mpirun) and once over Gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
echo "== MPI engine: mpirun -np 2"
.venv/bin/mpirun -np 2 --oversubscribe --bind-to none .venv/bin/python examples/pytorch_collectives.py
echo "== Gloo engine: 2 processes with the rank environment a launcher sets"
rendezvous=$(mktemp -u)
for rank in 0 1; do
  HOROVOD_RANK=$rank HOROVOD_SIZE=2 HVDPLUS_RENDEZVOUS_FILE=$rendezvous \
    .venv/bin/python examples/pytorch_collectives.py &
done
wait
