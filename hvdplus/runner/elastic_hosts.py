"""Which hosts an elastic job may use: discovered (a script, or the fixed -H list), minus the blacklisted.

Hosts keep the order in which they (re)appeared: the launcher gives the lowest ranks to the longest-lived hosts.
A host where a worker failed is blacklisted; with a cooldown range (MIN, MAX) it comes back after a randomised
cooldown that doubles with each failure (Horovod's rule: MIN * 2**failures + up to MIN more, within MIN..MAX) and
is then treated as a new host, from the moment its cooldown ends (not only at the next discovery round, so that
the others start waiting for its workers at once). Without one, it never comes back.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from dataclasses import dataclass, field

__all__ = ["HostManager", "discover_with_script", "parse_discovery_output"]

DISCOVERY_TIMEOUT_SECONDS = 30.0


def parse_discovery_output(text: str, slots_per_host: int) -> dict[str, int]:
    """`host` or `host:slots` lines (blank lines skipped) as {host: slots}; ValueError naming a bad line."""
    hosts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        host, has_slots, slots = line.partition(":")
        try:
            count = int(slots) if has_slots else slots_per_host
        except ValueError:
            raise ValueError(f"host discovery printed {line!r}: expected 'host' or 'host:slots'") from None
        if not host or count < 1:
            raise ValueError(f"host discovery printed {line!r}: expected 'host' or 'host:slots' with slots >= 1")
        hosts[host] = count
    return hosts


def discover_with_script(script: str, slots_per_host: int) -> dict[str, int]:
    """Run the discovery script once; its hosts, or RuntimeError with its exit status and error output."""
    done = subprocess.run([script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_SECONDS)
    if done.returncode != 0:
        raise RuntimeError(
            f"host discovery script {script} failed with exit code {done.returncode}: {done.stderr.strip()[-500:]}"
        )
    return parse_discovery_output(done.stdout, slots_per_host)


@dataclass
class _HostState:
    failures: int = 0
    blacklisted_until: float | None = None  # None: not blacklisted; inf: for good


@dataclass
class HostManager:
    """The discovered hosts, their order, and the blacklist (thread-safe)."""

    cooldown_range: tuple[float, float] | None = None
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._discovered: dict[str, int] = {}
        self._order: list[str] = []  # usable hosts, in order of (re)appearance
        self._states: dict[str, _HostState] = {}
        self._version = 0

    @property
    def version(self) -> int:
        """Bumped whenever the usable hosts or their slots change (a cooldown that ends included)."""
        with self._lock:
            self._end_cooldowns()
            return self._version

    def update(self, discovered: dict[str, int]) -> bool:
        """Take a discovery result; whether the usable hosts changed."""
        with self._lock:
            self._end_cooldowns()
            before = self._usable()
            self._discovered = dict(discovered)
            self._order = [h for h in self._order if h in discovered and not self._blacklisted(h)]
            self._order += [h for h in discovered if h not in self._order and not self._blacklisted(h)]
            changed = self._usable() != before
            self._version += changed
            return changed

    def _end_cooldowns(self) -> None:
        """Hosts whose cooldown has ended are usable again, as new hosts (last), if the last discovery listed them."""
        now = time.monotonic()
        for host, state in self._states.items():
            if state.blacklisted_until is not None and state.blacklisted_until <= now:
                state.blacklisted_until = None
                if host in self._discovered and host not in self._order:
                    self._order.append(host)
                    self._version += 1

    def blacklist(self, host: str) -> None:
        """A worker failed on `host`: stop using it (for its cooldown, or for good). A host already in its
        cooldown keeps it: a second worker failing there is the same failure (Horovod's HostState.blacklist)."""
        with self._lock:
            self._end_cooldowns()
            state = self._states.setdefault(host, _HostState())
            if state.blacklisted_until is None:
                state.failures += 1
                state.blacklisted_until = time.monotonic() + self._cooldown(state.failures)
            if host in self._order:
                self._order.remove(host)
                self._version += 1

    def _cooldown(self, failures: int) -> float:
        if self.cooldown_range is None:
            return float("inf")
        low, high = self.cooldown_range
        return max(low, min(high, low * (1 << failures) + self.rng.uniform(0, 1) * low))

    def _blacklisted(self, host: str) -> bool:
        state = self._states.get(host)
        return state is not None and state.blacklisted_until is not None

    def is_blacklisted(self, host: str) -> bool:
        with self._lock:
            self._end_cooldowns()
            return self._blacklisted(host)

    def returned(self, host: str) -> bool:
        """Whether `host` was blacklisted and is back from its cooldown."""
        with self._lock:
            self._end_cooldowns()
            state = self._states.get(host)
            return state is not None and state.failures > 0 and state.blacklisted_until is None

    def _usable(self) -> list[tuple[str, int]]:
        return [(h, self._discovered[h]) for h in self._order]

    def usable(self) -> list[tuple[str, int]]:
        """(host, slots) of the hosts the job may use, longest-lived first."""
        with self._lock:
            self._end_cooldowns()
            return self._usable()

    def discovered(self) -> list[str]:
        with self._lock:
            return list(self._discovered)
