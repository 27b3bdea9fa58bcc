"""A real one-node Slurm cluster for the tests: munge, slurmctld and slurmd with a slurm.conf written here."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["SlurmCluster", "missing_for_slurm"]

MUNGE_KEY = Path("/etc/munge/munge.key")


def missing_for_slurm() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    if os.geteuid() != 0:
        return "the Slurm tests start munged, slurmctld and slurmd, which needs root"
    tools = [t for t in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo") if not shutil.which(t)]
    return f"not installed: {', '.join(tools)} (scripts/setup_system.sh installs slurm-wlm munge)" if tools else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _munge_works() -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    return (
        encoded.returncode == 0
        and subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True, timeout=10).returncode == 0
    )


class SlurmCluster:
    """Start with `start()`, stop with `stop()`; `env` holds SLURM_CONF for srun/sbatch/sinfo."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.conf = workdir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pidfiles: list[Path] = []

    def _start_munge(self) -> None:
        if _munge_works():
            return
        if not MUNGE_KEY.exists():
            MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
            MUNGE_KEY.write_bytes(secrets.token_bytes(1024))
        for path in (MUNGE_KEY.parent, Path("/run/munge"), Path("/var/log/munge"), Path("/var/lib/munge")):
            path.mkdir(parents=True, exist_ok=True)
            shutil.chown(path, "munge", "munge")
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        pidfile = self.dir / "munged.pid"
        subprocess.run(["munged", "--force", f"--pid-file={pidfile}"], check=True, timeout=30)
        self._pidfiles.append(pidfile)

    def _write_conf(self) -> None:
        host = socket.gethostname()
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir(exist_ok=True)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=hvdplustest",
                    f"SlurmctldHost={host}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    f"StateSaveLocation={self.dir / 'state'}",
                    f"SlurmdSpoolDir={self.dir / 'spool'}",
                    f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.dir / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.dir / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.dir / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",
                    "InactiveLimit=0",
                    "KillWait=2",
                    "MinJobAge=5",
                    # 4 CPUs declared on this 2-core machine, so that 3- and 4-task jobs fit (config_overrides).
                    f"NodeName={host} NodeAddr=127.0.0.1 CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 "
                    "ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
                    "",
                ]
            )
        )

    def start(self, timeout: float = 60.0) -> None:
        """Start munge (unless one already works), slurmctld and slurmd; wait until the node is idle."""
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], check=True, env=self.env, timeout=30)
            self._pidfiles.append(self.dir / f"{daemon}.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env)
            if state.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"Slurm node not idle after {timeout} s: {state.stdout.strip()} {state.stderr.strip()}; "
            f"see {self.dir}/slurmctld.log and slurmd.log"
        )

    def stop(self) -> None:
        """Stop the daemons this cluster started, by their pid files."""
        for pidfile in reversed(self._pidfiles):
            try:
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
