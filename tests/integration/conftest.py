"""Integration fixtures: the real hvdplusrun, a real one-node Slurm, and ssh hosts in network namespaces.

Slurm and the namespaced hosts are built once per session and torn down at its end; they skip with the
reason when this machine cannot have them (not root, packages missing: scripts/setup_system.sh), and fail instead
under CI=true, where the setup script installs everything and a skip would hide a broken fixture."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from tests.integration.netns_hosts import NetnsHosts, missing_for_netns
from tests.integration.slurm_cluster import SlurmCluster, missing_for_slurm

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent
HVDPLUSRUN = str(BIN / "hvdplusrun")
JOB_TIMEOUT = 90


@dataclass
class Done:
    """A finished command: exit status, output (stdout + stderr) and wall time."""

    returncode: int
    output: str
    seconds: float


def job_env(**extra: str) -> dict[str, str]:
    """The test process's environment with the venv first on PATH, minus launch variables from outside."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HVDPLUS_", "OMPI_", "PMIX_", "SLURM_"))
    }
    env.update(
        {
            "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",
            **extra,
        }
    )
    return env


def run(argv: list[str], timeout: float = JOB_TIMEOUT, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Done:
    """Run argv to the end (killing it after `timeout` s) and return what happened."""
    start = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=cwd, env=env or job_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        pytest.fail(f"{argv} did not finish within {timeout} s:\n{out}")
    return Done(done.returncode, done.stdout + done.stderr, time.monotonic() - start)


def discovery_script(folder: Path, listing: str) -> tuple[Path, Path]:
    """An elastic job's --host-discovery-script that prints a file, and that file holding `listing`; (file,
    script). Rewrite the file to add or remove hosts."""
    hosts, script = folder / "hosts", folder / "discover.sh"
    hosts.write_text(listing)
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return hosts, script


def reports(output: str) -> list[dict]:
    """The JSON objects the ranks printed (after any rank prefix: Gloo mode's and Open MPI's `[1]<stdout>:`
    or `[1,1]<stdout>:`, MPICH's `[1] `), sorted by rank."""
    found = [json.loads(m) for m in re.findall(r"^(?:\[[\d,]+\](?:<stdout>:)? ?)?(\{.*\})\s*$", output, re.M)]
    return sorted(found, key=lambda r: r["rank"])


def alive(pid: int) -> bool:
    """True if process `pid` still exists (and is not a zombie)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def unavailable(reason: str) -> NoReturn:
    """Skip: this machine cannot build the fixture; under CI=true fail, since there a skip would hide that."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, but the fixture cannot be built here: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm():
    """A running one-node Slurm cluster (munge, slurmctld, slurmd); yields it, stops it after the session."""
    reason = missing_for_slurm()
    if reason:
        unavailable(reason)
    with tempfile.TemporaryDirectory(prefix="hvdplus-slurm-") as tmp:
        cluster = SlurmCluster(Path(tmp))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="session")
def ssh_hosts():
    """hostA and hostB (network namespaces with sshd) and a launcher namespace; removed after the session."""
    reason = missing_for_netns()
    if reason:
        unavailable(reason)
    with tempfile.TemporaryDirectory(prefix="hvdplus-netns-") as tmp:
        hosts = NetnsHosts(Path(tmp))
        try:
            hosts.start()
        except (subprocess.CalledProcessError, RuntimeError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            unavailable(f"cannot build namespaced ssh hosts here: {exc} {detail.decode(errors='replace')}")
        try:
            yield hosts
        finally:
            hosts.stop()
