"""ssh to the remote hosts: the command line (port, identity, no prompts) and a reachability check."""

from __future__ import annotations

import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = ["SshOptions", "check_reachable"]


@dataclass(frozen=True)
class SshOptions:
    """How hvdplusrun reaches remote hosts: port, identity file and connect timeout."""

    port: int | None = None
    identity_file: str | None = None
    connect_timeout: int = 10

    def options(self) -> list[str]:
        """ssh options shared by every remote call: never prompt, never hang on a dead host."""
        opts = [
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            "LogLevel=ERROR",
            "-o",
            f"ConnectTimeout={self.connect_timeout}",
            "-o",
            "ServerAliveInterval=5",
            "-o",
            "ServerAliveCountMax=3",
        ]
        if self.port:
            opts += ["-p", str(self.port)]
        if self.identity_file:
            opts += ["-i", self.identity_file]
        return opts

    def command(self, host: str, remote_argv: list[str]) -> list[str]:
        """The local argv that runs `remote_argv` on `host` (no tty: stdin stays a plain pipe)."""
        return ["ssh", *self.options(), "-T", host, shlex.join(remote_argv)]


def _probe(host: str, ssh: SshOptions) -> str | None:
    try:
        done = subprocess.run(
            ssh.command(host, ["true"]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ssh.connect_timeout + 5,
        )
    except subprocess.TimeoutExpired:
        return f"ssh to {host} did not finish within {ssh.connect_timeout + 5} s"
    except FileNotFoundError:
        return "no ssh client found: install openssh-client"
    if done.returncode == 0:
        return None
    detail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return f"cannot reach {host} over ssh: {detail}"


def check_reachable(hosts: list[str], ssh: SshOptions) -> list[str]:
    """Try `ssh host true` on every host at once; return one message per host that failed."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [problem for problem in pool.map(lambda h: _probe(h, ssh), hosts) if problem]
