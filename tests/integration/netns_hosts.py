"""Test hosts on one machine: network namespaces joined by veth pairs and a bridge, each host with its own sshd.

    hvdL  (launcher, hostname hvdlaunch, 10.77.0.254 on bridge hvd0)
      |-- veth --  hvdA  (hostname hostA, 10.77.0.1 on hvd0, sshd)
      `-- veth --  hvdB  (hostname hostB, 10.77.0.2 on hvd0, sshd)

Host names resolve through /etc/netns/<ns>/hosts (which `ip netns exec` mounts over /etc/hosts), the
sshds use the system host keys and an authorized_keys file in the test's directory, and a fresh client
key stands in for the user's. Traffic stays on 10.77.0.0/24 inside these namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["NetnsHosts", "missing_for_netns", "HOSTS", "LAUNCHER"]

SUBNET = "10.77.0"
LAUNCHER = ("hvdL", "hvdlaunch", f"{SUBNET}.254")
HOSTS = {"hostA": ("hvdA", f"{SUBNET}.1"), "hostB": ("hvdB", f"{SUBNET}.2")}


def missing_for_netns() -> str | None:
    """Why namespaced ssh hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces and sshd need root"
    tools = [t for t in ("ip", "unshare", "ssh", "ssh-keygen", "/usr/sbin/sshd") if not shutil.which(t)]
    return f"not installed: {', '.join(tools)} (scripts/setup_system.sh installs them)" if tools else None


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


class NetnsHosts:
    """Build with `start()`, remove with `stop()`; `launcher_argv(cmd)` runs cmd on the launcher host."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.key = workdir / "id_ed25519"
        self._namespaces = [LAUNCHER[0], *(ns for ns, _ in HOSTS.values())]

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", f"{LAUNCHER[2]} {LAUNCHER[1]}"]
        return "\n".join(lines + [f"{addr} {name}" for name, (_, addr) in HOSTS.items()]) + "\n"

    def _network(self) -> None:
        launcher_ns = LAUNCHER[0]
        for ns in self._namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # left by a killed run
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self._hosts_file())
        _sh("ip", "-n", launcher_ns, "link", "add", "hvd0", "type", "bridge")
        _sh("ip", "-n", launcher_ns, "addr", "add", f"{LAUNCHER[2]}/24", "dev", "hvd0")
        _sh("ip", "-n", launcher_ns, "link", "set", "hvd0", "up")
        for name, (ns, addr) in HOSTS.items():
            port = f"p{name[-1]}"
            _sh("ip", "link", "add", port, "netns", launcher_ns, "type", "veth", "peer", "name", "hvd0", "netns", ns)
            _sh("ip", "-n", launcher_ns, "link", "set", port, "master", "hvd0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "hvd0")
            _sh("ip", "-n", ns, "link", "set", "hvd0", "up")

    def _sshd(self) -> None:
        Path("/run/sshd").mkdir(exist_ok=True)
        _sh("ssh-keygen", "-A")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        (self.dir / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        (self.dir / "authorized_keys").chmod(0o600)
        for name, (ns, addr) in HOSTS.items():
            pidfile = self.dir / f"sshd-{name}.pid"
            sshd = (f"/usr/sbin/sshd -o ListenAddress={addr} -o PidFile={pidfile} -o PermitRootLogin=prohibit-password "
                    f"-o AuthorizedKeysFile={self.dir / 'authorized_keys'} -o StrictModes=no -o UseDNS=no "
                    f"-o MaxStartups=100 -o MaxSessions=100")
            _sh("ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f"hostname {name} && {sshd}")
        for name in HOSTS:
            self._wait_for(self.dir / f"sshd-{name}.pid")

    @staticmethod
    def _wait_for(path: Path) -> None:
        for _ in range(100):
            if path.exists() and path.read_text().strip():
                return
            time.sleep(0.1)
        raise RuntimeError(f"sshd did not write {path}")

    def start(self) -> None:
        """Create the namespaces, links, host names and sshds (tears down what it made if a step fails)."""
        try:
            self._network()
            self._sshd()
        except BaseException:
            self.stop()
            raise

    def launcher_argv(self, command: str) -> list[str]:
        """argv that runs the shell `command` on the launcher host (its namespace and host name)."""
        ns, hostname, _ = LAUNCHER
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f"hostname {hostname} && {command}"]

    def stop(self) -> None:
        """Stop the sshds by their pid files, delete the namespaces (and their links) and host files."""
        for name in HOSTS:
            pidfile = self.dir / f"sshd-{name}.pid"
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        for ns in self._namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
