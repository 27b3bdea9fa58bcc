#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit tests and real 2- and 3-rank jobs over MPI and Gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_system.sh
# MPICH (the mpich wheel) beside the venv's Open MPI, for the MPICH jobs; mpi4py loads it via MPI4PY_LIBMPI.
[ -x .venv/mpich/bin/mpiexec ] || .venv/bin/python -m pip install -q --no-deps --prefix .venv/mpich "mpich==5.0.2"
exec .venv/bin/python -m pytest -q "$@"
