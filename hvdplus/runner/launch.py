"""`hvdplusrun`: parse horovodrun's flags, decide the job, run it in Gloo or MPI mode, exit with its status."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from hvdplus.common.rendezvous import RendezvousServer
from hvdplus.runner.args import parse_args
from hvdplus.runner.check_build import check_build
from hvdplus.runner.elastic_run import run_elastic
from hvdplus.runner.gloo_run import run_gloo
from hvdplus.runner.job import elastic_options, job_from_args, threads_note
from hvdplus.runner.job_spec import JobSpec
from hvdplus.runner.mpi_run import run_mpi
from hvdplus.runner.preflight import LaunchError

__all__ = ["main", "run_job"]


def run_job(
    spec: JobSpec, prepare: Callable[[RendezvousServer], None] | None = None
) -> tuple[int, RendezvousServer | None]:
    """Run a decided job in its mode; return its exit status (and Gloo mode's rendezvous server)."""
    if spec.mode == "mpi":
        return run_mpi(spec), None
    return run_gloo(spec, prepare)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the hvdplusrun command."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.check_build:
        print(check_build())
        return 0
    try:
        spec = job_from_args(args, os.environ)
        elastic = elastic_options(args, os.environ)
        note = threads_note(spec, elastic is not None)
        if note:
            print(note, file=sys.stderr, flush=True)
        code = run_elastic(spec, elastic) if elastic else run_job(spec)[0]
    except (ValueError, LaunchError) as exc:
        print(f"hvdplusrun: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:  # Ctrl-C before the ranks started; anything started is already stopped
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
