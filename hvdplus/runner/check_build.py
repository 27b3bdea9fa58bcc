"""`hvdplusrun --check-build`: which frameworks, engines and MPI this install finds (like horovodrun's)."""

from __future__ import annotations

import importlib.util
from importlib import metadata

from hvdplus.runner.mpi_run import find_mpirun, mpi_flavor

__all__ = ["check_build"]


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _mark(on: bool) -> str:
    return "[X]" if on else "[ ]"


def check_build() -> str:
    """The report: frameworks and adapters, engines (controllers), tensor operations and the MPI found."""
    try:
        version = metadata.version("hvdplus")
    except metadata.PackageNotFoundError:
        version = "(not installed)"
    mpirun = find_mpirun()
    try:
        flavor = mpi_flavor(mpirun) if mpirun else None
    except ValueError:
        flavor = "unknown"
    torch, tf, mpi4py = _found("torch"), _found("tensorflow"), _found("mpi4py")
    rows = [
        f"hvdplus v{version}:",
        "",
        "Available Frameworks:",
        f"    {_mark(tf and _found('hvdplus.tensorflow'))} TensorFlow",
        f"    {_mark(torch and _found('hvdplus.torch'))} PyTorch",
        f"    {_mark(_found('keras') and _found('hvdplus.keras'))} Keras",
        "",
        "Available Controllers:",
        f"    {_mark(mpi4py and mpirun is not None)} MPI",
        f"    {_mark(torch)} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {_mark(False)} NCCL",
        f"    {_mark(False)} DDL",
        f"    {_mark(False)} CCL",
        f"    {_mark(mpi4py)} MPI",
        f"    {_mark(torch)} Gloo",
        "",
        f"mpirun: {mpirun or 'not found'}{f' ({flavor})' if flavor else ''}",
        f"mpi4py: {'found' if mpi4py else 'not found (pip install hvdplus[mpi])'}",
    ]
    return "\n".join(rows)
