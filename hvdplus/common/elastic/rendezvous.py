"""A worker's side of an elastic job: join the next generation the launcher planned, and see newer ones coming.

A new worker first tells the launcher it has reached hvd.init (its start and imports are done), and waits for a
generation that includes it. At each `init()` a worker waits for the first generation after the one it last ran,
takes the latest, finds its rank there and meets the generation's other workers in the store before any engine
connects. A worker that died before arriving therefore costs no engine timeout: the launcher plans a newer
generation and the others move on to it. A worker that has run and that the latest plan leaves out (its host was
removed) exits cleanly, with status 0.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from hvdplus.common.elastic.plan import (
    LATEST_KEY,
    Plan,
    arrived_key,
    failure_notice_key,
    generation_prefix,
    holds_key,
    host_of,
    plan_key,
    waiting_key,
)
from hvdplus.common.rendezvous import RendezvousClient, RendezvousTimeout
from hvdplus.common.settings import LaunchEnv

__all__ = ["ElasticWorker"]

_POLL_SECONDS = 0.005


class ElasticWorker:
    """This process's membership in an elastic job, across the generations it runs (one per init)."""

    def __init__(self, launch: LaunchEnv, connect_timeout: float) -> None:
        if not (launch.rendezvous_addr and launch.rendezvous_port and launch.secret_key and launch.elastic_worker):
            raise RuntimeError(
                "an elastic worker needs hvdplusrun's rendezvous (address, port, secret) and its "
                "worker id: start elastic jobs with hvdplusrun --min-np or --host-discovery-script"
            )
        self.worker = launch.elastic_worker
        self._client = RendezvousClient(
            launch.rendezvous_addr, launch.rendezvous_port, launch.secret_key, connect_timeout
        )
        self._next = launch.elastic_generation
        self.plan: Plan | None = None  # the generation this worker runs now
        self._client.set(waiting_key(self.worker), str(launch.elastic_generation).encode())  # ready to join

    def join(self, launch: LaunchEnv, timeout: float) -> LaunchEnv:
        """Wait (up to `timeout` s) for the next generation, meet its workers; `launch` with this worker's rank,
        size and the generation's store namespace. SystemExit(0) if the latest plan leaves this worker out."""
        deadline = time.monotonic() + timeout
        wanted = self._next
        while True:
            try:
                self._client.wait([plan_key(wanted)], timeout=max(0.0, deadline - time.monotonic()))
            except RendezvousTimeout:
                raise RuntimeError(
                    f"elastic worker {self.worker}: the launcher planned no generation {wanted} of "
                    f"the job with this worker within {timeout:g} s (HOROVOD_ELASTIC_TIMEOUT)"
                ) from None
            plan = Plan.decode(self._client.get(plan_key(self.latest())))
            rank = plan.rank_of(self.worker)
            if rank is None and self.plan is None:  # not let in yet (the plan was made before this worker was ready)
                wanted = plan.generation + 1
                continue
            if rank is None:
                print(
                    f"hvdplus: elastic worker {self.worker} is not part of generation {plan.generation} of the job "
                    "(its host was removed): exiting",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(0)
            if self._meet(plan, rank, deadline):
                break
            wanted = plan.generation + 1
        self.plan, self._next = plan, plan.generation + 1
        local_rank = sum(1 for w in plan.workers[:rank] if host_of(w) == host_of(self.worker))
        return dataclasses.replace(
            launch,
            rank=rank,
            size=plan.size,
            local_rank=local_rank,
            store_prefix=generation_prefix(plan.generation),
            elastic_generation=plan.generation,
        )

    def _meet(self, plan: Plan, rank: int, deadline: float) -> bool:
        """Announce this worker in `plan` and wait for all of its workers; False if a newer plan replaced it."""
        self._client.set(arrived_key(plan.generation, rank), b"1")
        everyone = [arrived_key(plan.generation, r) for r in range(plan.size)]
        while not self._client.check(everyone):
            if self.latest() != plan.generation:
                return False
            if time.monotonic() > deadline:
                missing = [plan.workers[r] for r in range(plan.size) if not self._client.check([everyone[r]])]
                raise RuntimeError(
                    f"elastic worker {self.worker}: workers {missing} never joined generation "
                    f"{plan.generation} of the job (HOROVOD_ELASTIC_TIMEOUT)"
                )
            time.sleep(_POLL_SECONDS)
        return True

    def mark_holding(self) -> None:
        """Tell the launcher this worker holds the training state of its generation (after the state sync)."""
        if self.plan is not None:
            self._client.set(holds_key(self.worker), str(self.plan.generation).encode())

    def lost_in(self, plan: Plan) -> list[str]:
        """The launcher's notices of the workers of `plan` that failed (it writes one before planning anew)."""
        keys = [failure_notice_key(plan.generation, rank) for rank in range(plan.size)]
        return [self._client.get(key).decode(errors="replace") for key in keys if self._client.check([key])]

    def latest(self) -> int:
        """The newest generation the launcher has planned."""
        return int(self._client.get(LATEST_KEY))

    def planned(self, generation: int) -> Plan:
        return Plan.decode(self._client.get(plan_key(generation)))

    def wait_for_newer(self, timeout: float | None) -> bool:
        """Block until the launcher plans a generation after the running one (or `timeout` s pass); whether it has."""
        if self.plan is None:
            return False
        try:
            self._client.wait([plan_key(self.plan.generation + 1)], timeout=timeout)
            return True
        except RendezvousTimeout:
            return False
