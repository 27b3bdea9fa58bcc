"""Gloo mode: hvdplusrun starts every rank itself (locally or over ssh) around an authenticated rendezvous."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from hvdplus.common.rendezvous import RendezvousServer, new_secret
from hvdplus.runner import agent
from hvdplus.runner.cluster_env import rank_variables
from hvdplus.runner.env import exportable
from hvdplus.runner.hosts import Slot, is_local
from hvdplus.runner.job_spec import JobSpec
from hvdplus.runner.preflight import LaunchError, preflight
from hvdplus.runner.supervise import Process, Supervisor

__all__ = ["rendezvous_addresses", "run_gloo", "slot_env", "start_agent"]

AGENT = os.path.abspath(agent.__file__)


def rendezvous_addresses(hostnames: list[str], nics: list[str]) -> dict[str, str]:
    """For each host, the launcher address its workers reach the rendezvous at (never 0.0.0.0).

    Only local ranks: loopback. Otherwise the address of --network-interfaces' first interface, or the
    address this machine routes from towards each remote host (local ranks use the first of those)."""
    remote = [h for h in hostnames if not is_local(h)]
    if not remote:
        return {h: "127.0.0.1" for h in hostnames}
    if nics:
        address = agent.interface_address(nics[0])
        if address is None:
            raise LaunchError(f"--network-interfaces: this machine has no IPv4 address on {nics[0]!r}")
        return {h: address for h in hostnames}
    addresses = {}
    for host in remote:
        try:
            addresses[host] = agent.source_address(host)
        except OSError as exc:
            raise LaunchError(f"no route from this machine to {host}: {exc}") from None
    first = addresses[remote[0]]
    return {h: addresses.get(h, first) for h in hostnames}


def slot_env(spec: JobSpec, slot: Slot, address: str, port: int, secret: str) -> dict[str, str]:
    """The worker environment for `slot`: Horovod's rank variables, and how to reach the rendezvous."""
    env = dict(spec.env)
    env.update(rank_variables(slot, address, port, secret))
    if spec.nics:
        env.setdefault("GLOO_SOCKET_IFNAME", spec.nics[0])
    return env


def start_agent(
    spec: JobSpec,
    supervisor: Supervisor,
    host: str,
    env: dict[str, str],
    address: str,
    label: str,
    rank: int | None = None,
    tag: str | None = None,
) -> Process:
    """Start one worker under the agent on `host` (over ssh unless local), `env` in its stdin, never on a command
    line; a remote host gets only the exportable variables."""
    local = is_local(host)
    if not local:
        env = {k: v for k, v in env.items() if exportable(k)}
    payload = json.dumps({"argv": spec.command, "env": env, "cwd": os.getcwd(), "route_to": address})
    argv = [sys.executable, AGENT] if local else spec.ssh.command(host, [sys.executable, AGENT])
    if spec.verbose:
        print(
            f"hvdplusrun: {label}: {' '.join(argv)} (rendezvous {address}:{env['HVDPLUS_RENDEZVOUS_PORT']})",
            file=sys.stderr,
            flush=True,
        )
    return supervisor.start(label, argv, rank=rank, payload=(payload + "\n").encode(), tag=tag)


def run_gloo(spec: JobSpec, prepare: Callable[[RendezvousServer], None] | None = None) -> tuple[int, RendezvousServer]:
    """Run the job; return the exit code and the (closed) rendezvous server, whose store holds what ranks left.

    `prepare(server)` may put values in the store before the first rank starts."""
    preflight(spec)
    hostnames = [h.name for h in spec.hosts]
    addresses = rendezvous_addresses(hostnames, spec.nics)
    secret = new_secret()
    server = RendezvousServer(addresses.values(), secret)
    try:
        if prepare:
            prepare(server)
        supervisor = Supervisor(spec.output_dir, {slot.rank: slot.hostname for slot in spec.slots})
        try:
            _start_ranks(spec, supervisor, addresses, server, secret)
        except BaseException:
            supervisor.stop_all()
            raise
        return supervisor.wait(), server
    finally:
        server.close()


def _start_ranks(
    spec: JobSpec, supervisor: Supervisor, addresses: dict[str, str], server: RendezvousServer, secret: str
) -> None:
    for slot in spec.slots:
        address = addresses[slot.hostname]
        env = slot_env(spec, slot, address, server.port(address), secret)
        start_agent(
            spec, supervisor, slot.hostname, env, address, f"rank {slot.rank} on {slot.hostname}", rank=slot.rank
        )
