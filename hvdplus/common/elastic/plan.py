"""The elastic job's plan, as hvdplusrun's driver publishes it in the authenticated rendezvous store (stdlib only:
the launcher imports it).

Each generation of an elastic job is a plan: the workers, by their lasting ids ("host/slot"), in rank order. The
driver writes `elastic/plan/<g>`, then `elastic/latest` = g. A worker at init waits for the first generation after
the one it last ran and joins the latest; the generation's collectives use the store under `elastic/g<g>/`, so
nothing of an older generation is ever read. Generations are numbered, so a worker that compares the latest
number with its own cannot miss a host change (Horovod's whole-second timestamps could be missed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = [
    "Plan",
    "GenerationReplaced",
    "worker_id",
    "LATEST_KEY",
    "plan_key",
    "arrived_key",
    "generation_prefix",
    "failure_notice_key",
    "failure_key",
    "waiting_key",
    "holds_key",
    "host_of",
]

LATEST_KEY = "elastic/latest"


class GenerationReplaced(RuntimeError):
    """The launcher planned a newer generation while this one's workers were still connecting."""


def waiting_key(worker: str) -> str:
    """Set by a worker once it reaches hvd.init, to the generation it was started for: the launcher lets it join."""
    return f"elastic/waiting/{worker}"


def holds_key(worker: str) -> str:
    """Set by a worker once it holds the training state (its generation's state sync is over), to that generation:
    the launcher never plans a generation in which no worker holds the last commit."""
    return f"elastic/holds/{worker}"


def failure_key(rank: int) -> str:
    """The store key (in the job's store, or a generation's namespace of it) where rank `rank` announces why its
    collectives failed: the Gloo engine's peers raise within a second (TorchDistEngine.failures)."""
    return f"hvdplus/failure/{rank}"


def plan_key(generation: int) -> str:
    return f"elastic/plan/{generation}"


def generation_prefix(generation: int) -> str:
    """Where generation `generation` keeps its keys (its process group's rendezvous, failure notices), as
    torch's PrefixStore joins it: `<prefix>/<key>`."""
    return f"elastic/g{generation}"


def arrived_key(generation: int, rank: int) -> str:
    return f"{generation_prefix(generation)}/arrived/{rank}"


def failure_notice_key(generation: int, rank: int) -> str:
    """Where the Gloo engine of `generation` looks for rank `rank`'s failure (TorchDistEngine.failures)."""
    return f"{generation_prefix(generation)}/{failure_key(rank)}"


def worker_id(host: str, slot: int) -> str:
    """A worker's lasting id: its host and its slot there (its local rank when it started)."""
    return f"{host}/{slot}"


def host_of(worker: str) -> str:
    """The host of worker id `worker`."""
    return worker.rsplit("/", 1)[0]


@dataclass(frozen=True)
class Plan:
    """One generation of the job: its workers in rank order."""

    generation: int
    workers: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.workers)

    def rank_of(self, worker: str) -> int | None:
        """`worker`'s rank in this generation, or None if it is not part of it."""
        try:
            return self.workers.index(worker)
        except ValueError:
            return None

    def encode(self) -> bytes:
        return json.dumps({"generation": self.generation, "workers": list(self.workers)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Plan:
        fields = json.loads(data)
        return cls(int(fields["generation"]), tuple(fields["workers"]))
