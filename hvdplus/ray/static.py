"""A static Ray job: a fixed set of rank actors in a placement group, and the calls that run on all of them.

Every call (start's executable, run, run_remote, execute, execute_single) gets a rendezvous of its own: a new
authenticated server with a new secret, handed to each actor as an argument of that call (never through a file).
So a function that calls hvd.init() and hvd.shutdown() can run any number of times, even after a failed call
whose ranks met only partly. A server stays up while a runtime started on it still runs in some actor (an
executable that called hvd.init() in its constructor, say), and is closed at the next call once none does."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from hvdplus.common.rendezvous import RendezvousServer, new_secret
from hvdplus.ray.calls import FAILURE_GRACE_S, Outcome, wait_all
from hvdplus.ray.placement import Placement
from hvdplus.ray.ranks import WorkerNode, cuda_visible_devices, place_ranks
from hvdplus.ray.settings import RaySettings, settings_env
from hvdplus.runner.cluster_env import rank_env
from hvdplus.runner.hosts import Slot

__all__ = ["StaticJob"]

log = logging.getLogger("hvdplus.ray")

Submit = Callable[[Any, dict[str, str]], Any]  # (actor, the rank's environment) -> ObjectRef


class StaticJob:
    """The actors of a static job (`actors[i]` runs in `placement`'s bundle for worker i) and their calls."""

    def __init__(self, settings: RaySettings, placement: Placement) -> None:
        self.settings, self.placement = settings, placement
        self.actors: list[Any] = []
        self.nodes: list[WorkerNode] = []
        self.slots: list[Slot] = []
        self._address = ""
        self._env: dict[str, str] = {}
        self._executable: tuple[type | None, list[Any], dict[str, Any]] = (None, [], {})
        self._servers: dict[int, RendezvousServer] = {}
        self._lost: set[int] = set()  # workers whose actors died or were ended: restarted at the next call

    # ------------------------------------------------------------------ lifecycle
    def start(
        self,
        executable_cls: type | None,
        executable_args: list[Any] | None,
        executable_kwargs: dict[str, Any] | None,
        extra_env_vars: dict[str, Any] | None,
    ) -> None:
        """Reserve the placement group, start the actors, rank them by node, create the executables."""
        if self.actors:
            raise RuntimeError("hvdplus.ray: this executor has started already; call shutdown() first")
        self.placement.reserve()
        self._address = ray.util.get_node_ip_address()
        self._env = {**settings_env(self.settings), **{k: str(v) for k, v in (extra_env_vars or {}).items()}}
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        self._executable = (executable_cls, list(executable_args or []), dict(executable_kwargs or {}))
        self.actors = [self.placement.start_actor(i) for i in range(self.placement.size)]
        self._locate()
        self._create_executables()

    def shutdown(self) -> None:
        """End every actor, close every rendezvous and release the placement group."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.nodes, self.slots = [], [], []
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        self.placement.release()

    # ------------------------------------------------------------------ calls
    def submit(self, submit: Submit, ranks: list[int] | None = None) -> list[Any]:
        """Start one call on the given ranks (default: all), each with its environment; refs in rank order."""
        if not self.actors:
            raise RuntimeError("hvdplus.ray: call start() before running functions on the workers")
        self._restart_lost()
        self._close_idle_servers()
        secret = new_secret()
        server = RendezvousServer([self._address], secret)
        port = server.port(self._address)
        self._servers[port] = server
        by_rank = sorted(zip(self.slots, self.actors), key=lambda pair: pair[0].rank)
        wanted = range(len(by_rank)) if ranks is None else ranks
        return [
            submit(actor, {**self._env, **rank_env(slot, self._address, port, secret)})
            for slot, actor in (by_rank[r] for r in wanted)
        ]

    def results(self, refs: list[Any]) -> list[Any]:
        """The values of a call's refs (rank order), or its root error, raised within seconds of a failure."""
        outcome = wait_all(refs)
        if outcome.errors:
            raise self._failure(outcome)
        return outcome.values

    def run(self, submit: Submit, ranks: list[int] | None = None) -> list[Any]:
        return self.results(self.submit(submit, ranks))

    # ------------------------------------------------------------------ internals
    def _locate(self) -> None:
        """Learn each actor's node, give ranks contiguous per node, and set CUDA_VISIBLE_DEVICES as Horovod does."""
        self.nodes = ray.get([actor.where.remote() for actor in self.actors])
        self.slots = place_ranks(self.nodes)
        visible = cuda_visible_devices(self.nodes, self.slots)
        ray.get(
            [
                actor.update_env_vars.remote({"CUDA_VISIBLE_DEVICES": visible[i]})
                for i, actor in enumerate(self.actors)
                if i in visible
            ]
        )

    def _create_executables(self) -> None:
        cls, args, kwargs = self._executable
        if cls is not None:
            self.run(lambda actor, env: actor.start_executable.remote(cls, args, kwargs, env))

    def _failure(self, outcome: Outcome) -> BaseException:
        """The root error, noted with its rank and what became of the others; stuck actors are ended."""
        by_rank = {slot.rank: i for i, slot in enumerate(self.slots)}
        for rank in outcome.stuck:
            ray.kill(self.actors[by_rank[rank]], no_restart=True)
        self._lost |= {by_rank[rank] for rank in outcome.lost}
        rank, error = outcome.root_error()
        note = f"hvdplus.ray: rank {rank} of {len(self.slots)} failed (host {self.slots[by_rank[rank]].hostname})"
        others = sorted(set(outcome.errors) - {rank})
        if others:
            note += f"; rank(s) {others} failed after it"
        if outcome.stuck:
            note += (
                f"; rank(s) {outcome.stuck} had not ended {FAILURE_GRACE_S:g} s later and were killed "
                "(their actors restart at the next call)"
            )
        add_note = getattr(error, "add_note", None)
        if add_note is not None:
            add_note(note)
        log.error("%s: %s", note, error)
        return error

    def _restart_lost(self) -> None:
        """Replace the actors that died or were ended, rank again by node, and (with an executable class)
        re-create every rank's executable."""
        if not self._lost:
            return
        for index in sorted(self._lost):
            ray.kill(self.actors[index], no_restart=True)
            self.actors[index] = self.placement.start_actor(index)
        log.warning("hvdplus.ray: restarted the actors of worker(s) %s", sorted(self._lost))
        self._lost.clear()
        self._locate()
        self._create_executables()

    def _close_idle_servers(self) -> None:
        """Close the rendezvous servers no running hvdplus runtime uses any more. An actor busy with an earlier
        call answers after it: then this waits a second at most and closes nothing this time."""
        if not self._servers:
            return
        refs = [actor.live_rendezvous_port.remote() for actor in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        if len(ready) < len(refs):
            return
        try:
            live = set(ray.get(refs))
        except RayActorError:
            return
        for port in [p for p in self._servers if p not in live]:
            self._servers.pop(port).close()
