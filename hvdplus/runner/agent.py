"""Runs one worker on its host for hvdplusrun and ends it with the launcher: no orphans (stdlib only).

Started as `python /path/to/agent.py`, locally or through ssh (it imports nothing from hvdplus, so it
runs before any environment is set up). It reads one JSON line from stdin:
    {"argv": [...], "env": {...}, "cwd": "...", "route_to": "10.0.0.1"}
so the job's secret never appears on a command line, then keeps stdin open as a lifeline: end of
input (the launcher stopped the job, died, or the ssh connection dropped), SIGTERM, SIGINT or SIGHUP
stop the worker's whole process group with SIGTERM, then SIGKILL after GRACE_SECONDS. The worker gets its share of
this host's cores as OMP_NUM_THREADS unless the environment sets it (thread_share).
Exit status: the worker's own, or 128 + the signal number that ended it.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

GRACE_SECONDS = 1.0
SIOCGIFADDR = 0x8915
THREADS_VARIABLE = "OMP_NUM_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which cgroups and taskset narrow), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def thread_share(env: Mapping[str, str], local_size: int | None = None, cores: int | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS for a rank whose environment is `env` and whose host runs `local_size` ranks (default: env's
    HOROVOD_LOCAL_SIZE): the host's cores divided among them, at least 1, so that ranks sharing a host do not each
    start a thread per core (torchrun sets 1 when it starts several local ranks). Empty when `env` sets
    OMP_NUM_THREADS (the user's value wins) or the rank is alone on its host (its share is every core already)."""
    if local_size is None:
        local_size = int(env.get("HOROVOD_LOCAL_SIZE") or 1)
    if THREADS_VARIABLE in env or local_size <= 1:
        return {}
    return {THREADS_VARIABLE: str(max(1, (cores or usable_cores()) // local_size))}


def source_address(host: str) -> str:
    """The local IPv4 address this machine sends from to reach `host` (OSError if there is no route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # a UDP connect only picks the route; nothing is sent
        address: str = probe.getsockname()[0]  # (host, port) for AF_INET
        return address


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(host: str) -> str | None:
    """The name of the network interface this machine uses to reach `host`, or None."""
    try:
        source = source_address(host)
    except OSError:
        return None
    return next((name for _, name in socket.if_nameindex() if interface_address(name) == source), None)


class Worker:
    """The worker process (its own session, so the whole group can be signalled) and its shutdown."""

    def __init__(self, spec: dict) -> None:
        env = {**os.environ, **spec.get("env", {})}
        env.update(thread_share(env))
        if spec.get("route_to") and "GLOO_SOCKET_IFNAME" not in env:
            interface = interface_towards(spec["route_to"])
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
        cwd = spec.get("cwd")
        if cwd and not os.path.isdir(cwd):
            print(
                f"hvdplusrun: {socket.gethostname()} has no directory {cwd}; running in {os.getcwd()}",
                file=sys.stderr,
                flush=True,
            )
            cwd = None
        self.proc = subprocess.Popen(spec["argv"], env=env, cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True)
        self._stopping = threading.Lock()

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """SIGTERM the worker's group now and SIGKILL it after the grace period (idempotent)."""
        if not self._stopping.acquire(blocking=False):
            return
        self._signal_group(signal.SIGTERM)
        timer = threading.Timer(GRACE_SECONDS, self._signal_group, args=(signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    def wait(self) -> int:
        """Wait for the worker, clear out anything it left in its group, return the exit status."""
        code = self.proc.wait()
        self._signal_group(signal.SIGKILL)
        return code if code >= 0 else 128 - code


def _read_spec(fd: int) -> dict[str, Any] | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
    spec: dict[str, Any] = json.loads(data)  # the launcher's JSON object
    return spec


def _watch_lifeline(fd: int, worker: Worker) -> None:
    while os.read(fd, 4096):  # raw reads: a buffered stdin would block interpreter shutdown
        pass
    worker.stop()


def main() -> int:
    """Read the spec, run the worker, stop it when the lifeline or a signal says so."""
    spec = _read_spec(0)
    if spec is None:
        return 1
    try:
        worker = Worker(spec)
    except OSError as exc:
        print(
            f"hvdplusrun: cannot start {spec['argv'][0]!r} on {socket.gethostname()}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 127
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: worker.stop())
    threading.Thread(target=_watch_lifeline, args=(0, worker), daemon=True).start()
    return worker.wait()


if __name__ == "__main__":
    sys.exit(main())
