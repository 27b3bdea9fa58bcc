"""Hosts on one machine: network namespaces joined by veth pairs and a bridge, each host with its own sshd.

    <prefix>L  (launcher, hostname hvdlaunch, last address of the subnet, on bridge <prefix>0)
      |-- veth --  <prefix>A  (hostname hostA, first address, sshd)
      |-- veth --  <prefix>B  (hostname hostB, second address, sshd)
      `-- ...      (hostC, hostD, ...; the letter L is the launcher's, so hostK is followed by hostM)

The test fixture builds the default: hvdL, hvdA, hvdB on 10.77.0.0/24. `scripts/topology.sh` (this module's
`main()`) builds topoL, topoA, ... on 10.78.0.0/24 for benchmarks, so both can exist at once.

Host names resolve through /etc/netns/<ns>/hosts (which `ip netns exec` mounts over /etc/hosts), the sshds use
the system host keys and an authorized_keys file in the work directory, and a fresh client key stands in for the
user's; the launcher namespace gets its own /etc/ssh (via /etc/netns) whose ssh_config uses that key and a
known_hosts file of the hosts' keys. Traffic stays on the subnet inside these namespaces; traffic within a host
stays on its loopback.

With a rate and/or a delay, tc shapes every link: each host's egress gets netem (the one-way delay) and tbf (the
rate), and the bridge's port towards each host gets tbf alone, so a host receives at most the rate however many
hosts send to it (a switch port), and a host-to-host round trip grows by twice the delay.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "NetnsHosts",
    "Host",
    "layout",
    "missing_for_netns",
    "rate_bps",
    "delay_s",
    "measure",
    "main",
    "HOSTS",
    "LAUNCHER",
]

ROOT = Path(__file__).resolve().parents[2]
LETTERS = string.ascii_uppercase.replace("L", "")
TOPOLOGY_PREFIX = "topo"
TOPOLOGY_SUBNET = "10.78.0.0/24"
MEASURE_PORT = 5201
_RATE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Host:
    """One simulated host: its host name (inside its UTS namespace), network namespace and address."""

    name: str
    ns: str
    addr: str


def layout(count: int, prefix: str = "hvd", subnet: str = "10.77.0.0/24") -> tuple[Host, list[Host]]:
    """The launcher and `count` hosts: namespaces <prefix>L and <prefix>A, <prefix>B, ..., addresses from
    the start of `subnet` (the launcher takes its last one)."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,13}", prefix):
        raise ValueError(f"prefix {prefix!r}: 1 to 14 letters and digits, starting with a letter")
    net = ipaddress.ip_network(subnet)
    if not 1 <= count <= min(len(LETTERS), net.num_addresses - 3):
        raise ValueError(f"{count} hosts: between 1 and {min(len(LETTERS), net.num_addresses - 3)} fit {subnet}")
    hosts = [Host(f"host{c}", f"{prefix}{c}", str(net[i + 1])) for i, c in enumerate(LETTERS[:count])]
    return Host("hvdlaunch", f"{prefix}L", str(net[-2])), hosts


_FIXTURE_LAUNCHER, _FIXTURE_HOSTS = layout(2)
LAUNCHER = (_FIXTURE_LAUNCHER.ns, _FIXTURE_LAUNCHER.name, _FIXTURE_LAUNCHER.addr)
HOSTS = {h.name: (h.ns, h.addr) for h in _FIXTURE_HOSTS}


def rate_bps(rate: str) -> float:
    """Bits per second of a tc rate such as '200mbit' (only the *bit units: tc's 'mbps' means bytes)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate)
    if not match:
        raise ValueError(f"rate {rate!r}: a number with bit, kbit, mbit, gbit or tbit, e.g. 1gbit")
    return float(match[1]) * _RATE_UNITS[match[2]]


def delay_s(delay: str) -> float:
    """Seconds of a tc time such as '0.2ms'."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay)
    if not match:
        raise ValueError(f"delay {delay!r}: a number with us, ms or s, e.g. 0.2ms")
    return float(match[1]) * _DELAY_UNITS[match[2]]


def missing_for_netns(shaping: bool = False) -> str | None:
    """Why namespaced ssh hosts (with tc shaping, if `shaping`) cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces and sshd need root"
    needed = ("ip", "unshare", "ssh", "ssh-keygen", "/usr/sbin/sshd") + (("tc",) if shaping else ())
    tools = [t for t in needed if not shutil.which(t)]
    return f"not installed: {', '.join(tools)} (scripts/setup_system.sh installs them)" if tools else None


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


class NetnsHosts:
    """Build with `start()`, remove with `stop()`; `launcher_argv(cmd)` runs cmd on the launcher host.

    The defaults (2 hosts, prefix hvd, 10.77.0.0/24, no shaping) are the test fixture's hosts."""

    def __init__(
        self,
        workdir: Path,
        hosts: int = 2,
        prefix: str = "hvd",
        subnet: str = "10.77.0.0/24",
        rate: str | None = None,
        delay: str | None = None,
    ) -> None:
        self.dir = workdir
        self.key = workdir / "id_ed25519"
        self.prefix, self.subnet, self.bridge = prefix, subnet, f"{prefix}0"
        self.launcher, self.hosts = layout(hosts, prefix, subnet)
        self.rate, self.delay = rate, delay
        self.rate_bps = rate_bps(rate) if rate else None
        self.delay_s = delay_s(delay) if delay else None
        self.namespaces = [self.launcher.ns, *(h.ns for h in self.hosts)]

    def describe(self) -> dict:
        """What was built, as plain data (the topology's JSON)."""
        return {
            "prefix": self.prefix,
            "subnet": self.subnet,
            "bridge": self.bridge,
            "key": str(self.key),
            "launcher": asdict(self.launcher),
            "hosts": [asdict(h) for h in self.hosts],
            "rate": self.rate,
            "rate_bps": self.rate_bps,
            "delay": self.delay,
            "delay_s": self.delay_s,
        }

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", f"{self.launcher.addr} {self.launcher.name}"]
        return "\n".join(lines + [f"{h.addr} {h.name}" for h in self.hosts]) + "\n"

    @staticmethod
    def _port(host: Host) -> str:
        """The bridge's port (in the launcher namespace) towards `host`."""
        return f"p{host.name.removeprefix('host')}"

    def _network(self) -> None:
        launcher_ns, bits = self.launcher.ns, ipaddress.ip_network(self.subnet).prefixlen
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # left by a killed run
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self._hosts_file())
        _sh("ip", "-n", launcher_ns, "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "-n", launcher_ns, "addr", "add", f"{self.launcher.addr}/{bits}", "dev", self.bridge)
        _sh("ip", "-n", launcher_ns, "link", "set", self.bridge, "up")
        for host in self.hosts:
            port = self._port(host)
            _sh(
                "ip",
                "link",
                "add",
                port,
                "netns",
                launcher_ns,
                "type",
                "veth",
                "peer",
                "name",
                self.bridge,
                "netns",
                host.ns,
            )
            _sh("ip", "-n", launcher_ns, "link", "set", port, "master", self.bridge, "up")
            _sh("ip", "-n", host.ns, "addr", "add", f"{host.addr}/{bits}", "dev", self.bridge)
            _sh("ip", "-n", host.ns, "link", "set", self.bridge, "up")

    def _shape_egress(self, ns: str, dev: str, delay: str | None) -> None:
        """Queue `dev`'s outgoing packets through netem (delay) above tbf (rate), or either alone."""
        tc = ("tc", "-n", ns, "qdisc", "add", "dev", dev)
        tbf = ("tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms") if self.rate else ()
        if delay:
            try:
                _sh(*tc, "root", "handle", "1:", "netem", "delay", delay)
            except subprocess.CalledProcessError as exc:
                raise RuntimeError(
                    f"tc cannot add netem for the delay ({exc.stderr.decode().strip()}); a kernel "
                    "without sch_netem (CONFIG_NET_SCH_NETEM) cannot add delay"
                ) from exc
            if tbf:
                _sh(*tc, "parent", "1:1", "handle", "10:", *tbf)
        elif tbf:
            _sh(*tc, "root", *tbf)

    def _shape(self) -> None:
        """Shape both directions of every host's link: the host's egress and the bridge's port towards it."""
        for host in self.hosts:
            self._shape_egress(host.ns, self.bridge, self.delay)
            self._shape_egress(self.launcher.ns, self._port(host), None)

    def _ssh_client(self) -> None:
        """Give the launcher namespace an ssh_config with the client key and the hosts' keys as known."""
        keys = [" ".join(p.read_text().split()[:2]) for p in sorted(Path("/etc/ssh").glob("ssh_host_*_key.pub"))]
        known = self.dir / "known_hosts"
        known.write_text("".join(f"{h.name},{h.addr} {k}\n" for h in self.hosts for k in keys))
        etc_ssh = Path("/etc/netns") / self.launcher.ns / "ssh"
        etc_ssh.mkdir(exist_ok=True)
        (etc_ssh / "ssh_config").write_text(
            f"Host *\n    IdentityFile {self.key}\n    UserKnownHostsFile {known}\n    StrictHostKeyChecking yes\n"
        )

    def _sshd(self) -> None:
        Path("/run/sshd").mkdir(exist_ok=True)
        _sh("ssh-keygen", "-A")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        (self.dir / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        (self.dir / "authorized_keys").chmod(0o600)
        self._ssh_client()
        for host in self.hosts:
            sshd = (
                f"/usr/sbin/sshd -o ListenAddress={host.addr} -o PidFile={self._pidfile(host)} "
                f"-o PermitRootLogin=prohibit-password -o AuthorizedKeysFile={self.dir / 'authorized_keys'} "
                f"-o StrictModes=no -o UseDNS=no -o MaxStartups=100 -o MaxSessions=100"
            )
            _sh("ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c", f"hostname {host.name} && {sshd}")
        for host in self.hosts:
            self._wait_for(self._pidfile(host))

    def _pidfile(self, host: Host) -> Path:
        return self.dir / f"sshd-{host.name}.pid"

    @staticmethod
    def _wait_for(path: Path) -> None:
        for _ in range(100):
            if path.exists() and path.read_text().strip():
                return
            time.sleep(0.1)
        raise RuntimeError(f"sshd did not write {path}")

    def start(self) -> None:
        """Create the namespaces, links, shaping, host names and sshds (tears down what it made if a step fails)."""
        try:
            self._network()
            self._shape()
            self._sshd()
        except BaseException:
            self.stop()
            raise

    def launcher_argv(self, command: str) -> list[str]:
        """argv that runs the shell `command` on the launcher host (its namespace and host name)."""
        return [
            "ip",
            "netns",
            "exec",
            self.launcher.ns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f"hostname {self.launcher.name} && {command}",
        ]

    def sshd_pid(self, host: Host) -> int | None:
        """`host`'s sshd pid from its pid file, None where there is none or that process is not this sshd
        (ended, a zombie, or the pid reused)."""
        pidfile = self._pidfile(host)
        try:
            pid = int(pidfile.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if str(pidfile).encode() in cmdline else None

    def stop(self) -> None:
        """Stop the sshds by their pid files, delete the namespaces (and their links) and /etc/netns files."""
        for host in self.hosts:
            pid = self.sshd_pid(host)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def bulk_sink(addr: str, port: int) -> None:
    """Receive one stream until EOF, then echo bytes back until EOF; print the stream's bytes and seconds as JSON.

    Runs inside the receiving host's namespace (see `measure`); prints 'ready' once it listens."""
    with socket.create_server((addr, port)) as server:
        print("ready", flush=True)
        bulk, _ = server.accept()
        with bulk:
            total, first = 0, 0.0
            while chunk := bulk.recv(1 << 20):
                first, total = first or time.monotonic(), total + len(chunk)
            seconds = time.monotonic() - first
        echo, _ = server.accept()
        with echo:
            echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while byte := echo.recv(1):
                echo.sendall(byte)
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def bulk_source(addr: str, port: int, seconds: float, round_trips: int = 200) -> None:
    """Stream zeros to `bulk_sink` for `seconds`, then time one-byte round trips; print them as JSON."""
    payload = bytes(1 << 16)
    with socket.create_connection((addr, port)) as bulk:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            bulk.sendall(payload)
        bulk.shutdown(socket.SHUT_WR)
        bulk.recv(1)  # EOF once the sink has read everything
    with socket.create_connection((addr, port)) as echo:
        echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(round_trips):
            start = time.perf_counter()
            echo.sendall(b"x")
            echo.recv(1)
            rtts.append(time.perf_counter() - start)
    print(json.dumps({"rtt_s": rtts}), flush=True)


def _python_in(ns: str, call: str) -> list[str]:
    """argv that runs `call` (a bulk_sink/bulk_source call) with this Python inside namespace `ns`."""
    return [
        "ip",
        "netns",
        "exec",
        ns,
        sys.executable,
        "-c",
        f"from tests.integration.netns_hosts import bulk_sink, bulk_source; {call}",
    ]


def measure(sender: Host, receiver: Host, seconds: float = 2.0) -> dict:
    """TCP throughput from `sender` to `receiver` over `seconds` (as the receiver sees it) and the median and
    fastest of 200 one-byte TCP round trips (Python's own overhead included, some 0.05-0.1 ms here)."""
    sink = subprocess.Popen(
        _python_in(receiver.ns, f"bulk_sink({receiver.addr!r}, {MEASURE_PORT})"),
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the receiver on {receiver.name} did not start")
        sent = subprocess.run(
            _python_in(sender.ns, f"bulk_source({receiver.addr!r}, {MEASURE_PORT}, {seconds})"),
            capture_output=True,
            text=True,
            check=True,
            timeout=seconds + 30,
            cwd=ROOT,
        )
        received = json.loads(sink.communicate(timeout=30)[0])
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    rtts = json.loads(sent.stdout)["rtt_s"]
    return {
        "from": sender.name,
        "to": receiver.name,
        "seconds": received["seconds"],
        "rate_bps": received["bytes"] * 8 / received["seconds"],
        "rtt_ms": statistics.median(rtts) * 1e3,
        "rtt_min_ms": min(rtts) * 1e3,
    }


# ---- scripts/topology.sh: a topology for benchmarks, described by a JSON file in its state directory ----


def state_dir(prefix: str) -> Path:
    """Where topology `prefix` keeps its keys, pid files and topology.json."""
    return Path(f"/tmp/hvdplus-topology-{prefix}")


def _load(prefix: str) -> tuple[NetnsHosts, dict]:
    """The topology `prefix` that `up` built, and its JSON; exits if there is none."""
    path = state_dir(prefix) / "topology.json"
    if not path.exists():
        raise SystemExit(f"no topology '{prefix}' is up ({path} does not exist)")
    state = json.loads(path.read_text())
    hosts = NetnsHosts(
        path.parent, len(state["hosts"]), state["prefix"], state["subnet"], state["rate"], state["delay"]
    )
    return hosts, state


def _existing_namespaces() -> set[str]:
    """Names of the network namespaces on this machine."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _usage(hosts: NetnsHosts, slots: int) -> str:
    """How to reach and use the topology (printed by `up` and `status`)."""
    bindir = Path(sys.executable).parent
    runner = bindir / "hvdplusrun" if (bindir / "hvdplusrun").exists() else "hvdplusrun"
    hosts_arg = ",".join(f"{h.name}:{slots}" for h in hosts.hosts)
    shaping = (
        ", ".join(filter(None, [hosts.rate and f"rate {hosts.rate}", hosts.delay and f"one-way delay {hosts.delay}"]))
        or "not shaped"
    )
    job = (
        f"{runner} -np {slots * len(hosts.hosts)} -H {hosts_arg} -i {hosts.key} "
        f'--mpi-args "--mca mpi_yield_when_idle 1" {sys.executable} train.py'
    )
    rows = [f"  {h.name:<9} {h.addr:<15} namespace {h.ns}" for h in [*hosts.hosts, hosts.launcher]]
    return "\n".join(
        [
            f"topology '{hosts.prefix}': {len(hosts.hosts)} hosts x {slots} slots on {hosts.subnet}, links {shaping}",
            *rows,
            f"ssh identity file: {hosts.key} (ssh in the launcher namespace uses it: ssh hostB hostname)",
            "run a job from the launcher host:",
            f"  ip netns exec {hosts.launcher.ns} unshare --uts sh -c 'hostname {hosts.launcher.name} && {job}'",
            "  (mpi_yield_when_idle: every host shares this machine's cores; without it Open MPI busy-polls)",
            f"measure the link: scripts/topology.sh measure --prefix {hosts.prefix}",
            f"remove it:        scripts/topology.sh down --prefix {hosts.prefix}",
        ]
    )


def _up(args: argparse.Namespace) -> int:
    """Build topology `args.prefix` unless it or its namespaces exist (never replaces a test run's hosts)."""
    reason = missing_for_netns(shaping=bool(args.rate or args.delay))
    if reason:
        raise SystemExit(reason)
    if args.slots < 1:
        raise SystemExit("--slots must be at least 1")
    workdir = state_dir(args.prefix)
    if (workdir / "topology.json").exists():
        raise SystemExit(
            f"topology '{args.prefix}' is up already (scripts/topology.sh status/down --prefix {args.prefix})"
        )
    try:
        hosts = NetnsHosts(workdir, args.hosts, args.prefix, TOPOLOGY_SUBNET, args.rate, args.delay)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    taken = sorted(_existing_namespaces() & set(hosts.namespaces))
    if taken:
        raise SystemExit(
            f"namespaces {', '.join(taken)} exist already (a test run or another topology?); choose another --prefix"
        )
    workdir.mkdir(mode=0o700, exist_ok=True)
    (workdir / "topology.json").write_text(json.dumps({**hosts.describe(), "slots": args.slots}, indent=2) + "\n")
    try:
        hosts.start()
    except (subprocess.CalledProcessError, RuntimeError) as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
        raise SystemExit(f"cannot build the topology: {exc}" + (f": {detail}" if detail else "")) from None
    print(_usage(hosts, args.slots))
    return 0


def _down(args: argparse.Namespace) -> int:
    """Remove what `up` made: sshds by their pid files, namespaces, /etc/netns files, the state directory."""
    if not (state_dir(args.prefix) / "topology.json").exists():
        print(f"no topology '{args.prefix}' is up; nothing to remove")
        return 0
    hosts, _ = _load(args.prefix)
    hosts.stop()
    shutil.rmtree(hosts.dir)
    print(f"removed topology '{args.prefix}' (namespaces {', '.join(hosts.namespaces)})")
    return 0


def _status(args: argparse.Namespace) -> int:
    """Print the topology and its sshds; 1 when an sshd or a namespace is gone."""
    hosts, state = _load(args.prefix)
    pids = {h.name: hosts.sshd_pid(h) for h in hosts.hosts}
    missing = sorted(set(hosts.namespaces) - _existing_namespaces())
    print(_usage(hosts, state["slots"]))
    print("sshd: " + ", ".join(f"{name} {'pid ' + str(pid) if pid else 'NOT RUNNING'}" for name, pid in pids.items()))
    if missing:
        print(f"missing namespaces: {', '.join(missing)}")
    return 0 if all(pids.values()) and not missing else 1


def _measure(args: argparse.Namespace) -> int:
    """Print the TCP rate and round trip from the first host to the second."""
    hosts, _ = _load(args.prefix)
    if len(hosts.hosts) < 2:
        raise SystemExit("measuring needs 2 hosts")
    result = measure(hosts.hosts[0], hosts.hosts[1], args.seconds)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['from']} -> {result['to']}: {result['rate_bps'] / 1e6:.1f} Mbit/s over "
            f"{result['seconds']:.2f} s (shaped: {hosts.rate or 'no'}); TCP round trip "
            f"{result['rtt_ms']:.3f} ms median, {result['rtt_min_ms']:.3f} ms fastest "
            f"(delay: {hosts.delay or 'none'})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """scripts/topology.sh up|down|status|measure: simulated hosts for benchmarks (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="scripts/topology.sh",
        description="Simulated hosts on this machine: "
        "network namespaces with their own sshd and host name, joined by shaped links.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--prefix",
        default=TOPOLOGY_PREFIX,
        help=f"namespace prefix and state directory /tmp/hvdplus-topology-PREFIX (default {TOPOLOGY_PREFIX})",
    )
    up = actions.add_parser("up", parents=[common], help="build the hosts and print how to use them")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts: hostA, hostB, ... (default 2)")
    up.add_argument("--slots", type=int, default=1, help="slots per host for the printed -H string (default 1)")
    up.add_argument("--rate", help="link rate, e.g. 1gbit (tc tbf); default unshaped")
    up.add_argument("--delay", help="one-way delay added on each host's egress, e.g. 0.2ms (tc netem)")
    actions.add_parser("down", parents=[common], help="remove everything up made")
    actions.add_parser("status", parents=[common], help="print the topology; exit 1 if a part is missing")
    meter = actions.add_parser("measure", parents=[common], help="TCP rate and round trip from hostA to hostB")
    meter.add_argument("--seconds", type=float, default=2.0, help="how long to stream (default 2)")
    meter.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    return {"up": _up, "down": _down, "status": _status, "measure": _measure}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
