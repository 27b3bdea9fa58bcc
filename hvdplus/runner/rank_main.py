"""`python -m hvdplus.runner.rank_main PROGRAM ...`: one rank's Python under mpirun (Open MPI or MPICH/Hydra).

It gives the rank its share of its host's cores as OMP_NUM_THREADS (unless set), before the program imports a
framework, from the local rank count mpirun puts in the environment: hvdplusrun runs mpirun with --bind-to none.
Hydra's -prepend-rank tags every chunk a rank writes, not every line, so unbuffered Python output
("hello", " ", "1", "\\n" as separate writes) comes out cut into pieces. Line-buffered streams write
whole lines; the program then runs under mpi4py's runner, which aborts the job on an unhandled exception."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Mapping

from hvdplus.runner.agent import thread_share

# Where each mpirun says how many ranks share this rank's host: Open MPI, then MPICH/Hydra and Intel MPI.
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def mpi_local_size(env: Mapping[str, str]) -> int:
    """The number of ranks mpirun started on this rank's host (1 when it does not say)."""
    return next((int(env[name]) for name in LOCAL_SIZE_VARIABLES if env.get(name)), 1)


def main() -> None:
    os.environ.update(thread_share(os.environ, mpi_local_size(os.environ)))
    for stream in (sys.stdout, sys.stderr):
        assert isinstance(stream, io.TextIOWrapper)  # the interpreter's own streams, as mpiexec started it
        stream.reconfigure(line_buffering=True, write_through=False)
    from mpi4py.run import main as run_program

    run_program()


if __name__ == "__main__":
    main()
