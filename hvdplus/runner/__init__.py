"""hvdplusrun, the horovodrun-compatible launcher, and `run(fn, np=...)` (stdlib only).

Modules: args/config (flags), hosts (-H, hostfiles, Slurm), job (what to start), gloo_run (own launcher
with an authenticated rendezvous), mpi_run (mpirun), supervise (output, fail-fast, signals), agent (one
rank on its host), ssh, rendezvous, check_build, api (run), launch (main).
"""

from typing import Any

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    # Lazy, so that workers importing the rendezvous client do not load the whole launcher.
    if name == "run":
        from hvdplus.runner.api import run

        return run
    raise AttributeError(f"module 'hvdplus.runner' has no attribute {name!r}")
