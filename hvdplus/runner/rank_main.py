"""`python -m hvdplus.runner.rank_main PROGRAM ...`: one rank's Python under an MPICH (Hydra) mpirun.

Hydra's -prepend-rank tags every chunk a rank writes, not every line, so unbuffered Python output
("hello", " ", "1", "\\n" as separate writes) comes out cut into pieces. Line-buffered streams write
whole lines; the program then runs under mpi4py's runner, which aborts the job on an unhandled exception."""

from __future__ import annotations

import io
import sys


def main() -> None:
    for stream in (sys.stdout, sys.stderr):
        assert isinstance(stream, io.TextIOWrapper)  # the interpreter's own streams, as mpiexec started it
        stream.reconfigure(line_buffering=True, write_through=False)
    from mpi4py.run import main as run_program

    run_program()


if __name__ == "__main__":
    main()
