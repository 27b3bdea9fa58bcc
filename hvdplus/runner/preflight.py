"""Checks hvdplusrun makes before it starts anything, in both modes, so that a bad host, interface or program
fails at once with one clear line and exit status 1 (under MPI it would otherwise surface as mpirun's own
boilerplate and status: 255 for a host, 213 for an interface, 183 for a program)."""

from __future__ import annotations

import os
import re
import shutil
from typing import TYPE_CHECKING

from hvdplus.runner import agent
from hvdplus.runner.hosts import is_local
from hvdplus.runner.ssh import check_reachable

if TYPE_CHECKING:
    from hvdplus.runner.job_spec import JobSpec

__all__ = ["LaunchError", "preflight"]


class LaunchError(RuntimeError):
    """The job could not start (unreachable host, no route, bad interface, missing program); nothing is left
    running."""


def preflight(spec: JobSpec) -> None:
    """Raise LaunchError naming the first problem: a remote host ssh cannot reach (tried with the ssh connect
    timeout), or, on this machine when it runs ranks, a --network-interfaces name without an IPv4 address, a
    program not on the job's PATH, or a Python script that does not exist."""
    hostnames = [h.name for h in spec.hosts]
    problems = check_reachable([h for h in hostnames if not is_local(h)], spec.ssh)
    if problems:
        raise LaunchError(
            "; ".join(problems) + ". Check the host names, --ssh-port and --ssh-identity-file "
            "(hvdplusrun needs password-less ssh to every remote host)"
        )
    if not any(is_local(h) for h in hostnames):
        return
    for nic in spec.nics:
        if agent.interface_address(nic) is None:
            raise LaunchError(
                f"--network-interfaces: this machine has no interface {nic!r} with an IPv4 "
                f"address (it has: {', '.join(sorted(_interfaces()))})"
            )
    _check_program(spec.command, spec.env.get("PATH", os.environ.get("PATH", "")))


def _check_program(command: list[str], path: str) -> None:
    program = command[0]
    if shutil.which(program, path=path) is None:
        raise LaunchError(
            f"cannot run {program!r}: no such executable file"
            f"{'' if os.sep in program else ' on the PATH'} of this machine"
        )
    if (
        re.fullmatch(r"python[\d.]*", os.path.basename(program))
        and len(command) > 1
        and not command[1].startswith("-")
        and not os.path.exists(command[1])
    ):
        raise LaunchError(f"cannot run {command[1]!r}: no such Python script ({os.path.abspath(command[1])})")


def _interfaces() -> list[str]:
    try:
        return os.listdir("/sys/class/net")
    except OSError:
        return []
