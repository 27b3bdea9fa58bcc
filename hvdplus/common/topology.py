"""Where each rank lives: local and cross ranks derived from the hostnames gathered at init."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """Rank layout of a job. `hostnames[r]` is the host of global rank r."""

    rank: int
    hostnames: tuple[str, ...]

    @classmethod
    def single_host(cls, rank: int, size: int) -> Topology:
        """Every rank on one host (simulated ranks, tests)."""
        return cls(rank, ("localhost",) * size)

    @property
    def size(self) -> int:
        return len(self.hostnames)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Distinct hosts, in order of their lowest rank."""
        return tuple(dict.fromkeys(self.hostnames))

    def local_ranks_of(self, host: str) -> tuple[int, ...]:
        """Global ranks on `host`, ascending."""
        return tuple(r for r, h in enumerate(self.hostnames) if h == host)

    @property
    def local_peers(self) -> tuple[int, ...]:
        return self.local_ranks_of(self.hostnames[self.rank])

    @property
    def local_rank(self) -> int:
        return self.local_peers.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_peers)

    @property
    def cross_peers(self) -> tuple[int, ...]:
        """Global ranks that share this rank's local rank, one per host (Horovod's cross communicator)."""
        peers = []
        for host in self.hosts:
            on_host = self.local_ranks_of(host)
            if self.local_rank < len(on_host):
                peers.append(on_host[self.local_rank])
        return tuple(peers)

    @property
    def cross_rank(self) -> int:
        return self.cross_peers.index(self.rank)

    @property
    def cross_size(self) -> int:
        return len(self.cross_peers)

    @property
    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of ranks."""
        return len({len(self.local_ranks_of(h)) for h in self.hosts}) == 1
