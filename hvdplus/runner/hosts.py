"""Where ranks run: -H lists, hostfiles, Slurm allocations, and the rank -> host slot assignment."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from hvdplus.common.settings import expand_nodelist

__all__ = [
    "Host",
    "Slot",
    "parse_hosts",
    "parse_hostfile",
    "parse_tasks_per_node",
    "slurm_hosts",
    "assign_slots",
    "is_local",
]

_HOSTNAME = re.compile(r"^[A-Za-z0-9_.\-]+$|^\[?[0-9A-Fa-f:.]+\]?$")


@dataclass(frozen=True)
class Host:
    """A host name and how many ranks it runs."""

    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """One rank's place: its host and its local/cross position there (Horovod's HOROVOD_* values)."""

    rank: int
    size: int
    hostname: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _host(name: str, slots: str, where: str) -> Host:
    if not _HOSTNAME.match(name):
        raise ValueError(f"{where}: {name!r} is not a host name")
    if not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"{where}: slots must be a whole number >= 1, got {slots!r} for host {name!r}")
    return Host(name, int(slots))


def _merge(hosts: list[Host], where: str) -> list[Host]:
    seen = [h.name for h in hosts]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"{where}: host(s) {', '.join(duplicates)} listed more than once; give each host once with its total slots"
        )
    return hosts


def parse_hosts(text: str) -> list[Host]:
    """Parse -H/--hosts: 'node1:4,node2:4' ('node1' alone means 1 slot)."""
    entries = [e.strip() for e in text.split(",")]
    if not text.strip() or "" in entries:
        raise ValueError(f"-H/--hosts {text!r} has an empty entry; write it as host1:slots,host2:slots")
    hosts = []
    for entry in entries:
        name, _, slots = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "1")
        hosts.append(_host(name, slots, f"-H/--hosts entry {entry!r}"))
    return _merge(hosts, "-H/--hosts")


def parse_hostfile(path: str | Path) -> list[Host]:
    """Parse a hostfile: one 'host slots=N' (or just 'host') per line; '#' starts a comment."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read hostfile {path}: {exc.strerror}") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"hostfile {path}, line {number} ({line.strip()!r})"
        if len(fields) > 2 or (len(fields) == 2 and not fields[1].startswith("slots=")):
            raise ValueError(f"{where}: expected 'hostname slots=N'")
        hosts.append(_host(fields[0], fields[1][len("slots=") :] if len(fields) == 2 else "1", where))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts; write one 'hostname slots=N' per line")
    return _merge(hosts, f"hostfile {path}")


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE such as '2(x3),1' into [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE {text!r}: expected entries like 4 or 2(x3)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_hosts(nodelist: str, tasks_per_node: str) -> list[Host]:
    """Hosts and slots of a Slurm allocation (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE)."""
    names, counts = expand_nodelist(nodelist), parse_tasks_per_node(tasks_per_node)
    if len(names) != len(counts):
        raise ValueError(
            f"Slurm allocation lists {len(names)} node(s) ({nodelist}) but {len(counts)} task "
            f"count(s) ({tasks_per_node})"
        )
    return [Host(name, count) for name, count in zip(names, counts) if count > 0]


def assign_slots(hosts: list[Host], np: int) -> list[Slot]:
    """Fill hosts in order (host 1's slots first, as Horovod does) with ranks 0..np-1."""
    if not isinstance(np, int) or isinstance(np, bool) or np < 1:
        raise ValueError(f"-np must be a whole number >= 1, got {np!r}")
    total = sum(h.slots for h in hosts)
    if np > total:
        listing = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise ValueError(
            f"-np {np} is more than the {total} slot(s) available ({listing}); lower -np or add hosts/slots"
        )
    placed, left = [], np
    for host in hosts:
        take = min(host.slots, left)
        if take:
            placed.append((host.name, take))
        left -= take
    slots: list[Slot] = []
    for index, (name, take) in enumerate(placed):
        for local_rank in range(take):
            cross_rank = sum(1 for _, other in placed[:index] if other > local_rank)
            cross_size = sum(1 for _, other in placed if other > local_rank)
            slots.append(Slot(len(slots), np, name, local_rank, take, cross_rank, cross_size))
    return slots


def is_local(hostname: str) -> bool:
    """True when `hostname` names this machine, so its ranks start without ssh."""
    own = socket.gethostname()
    return hostname in {"localhost", "127.0.0.1", "::1", own, own.split(".")[0]}
