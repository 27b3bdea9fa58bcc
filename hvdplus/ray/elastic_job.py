"""An elastic Ray job: hvdplusrun's elastic driver (hvdplus/runner/elastic_run.py) with Ray actors as workers.

The driver is the same one hvdplusrun runs: generations planned in the authenticated rendezvous store, a failed
worker's host blacklisted, new hosts' workers let in at the next commit, rank 0 to a worker that holds the state.
Only two things differ. Discovery is Ray's live nodes (`RayHostDiscovery`: slots from each node's CPUs and GPUs,
a node named by its IP and Ray node id). A worker is an actor pinned to its node (`ActorProcess`), which runs the
user's function with the worker's environment, the rendezvous secret included, passed as a call argument; the
actor ends when the function returns, raises, or the driver stops it, like a worker process under hvdplusrun."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hvdplus.common.elastic.plan import host_of
from hvdplus.ray.ranks import host_name
from hvdplus.ray.worker import LEFT_OUT, BaseHorovodWorker
from hvdplus.runner.cluster_env import rank_env
from hvdplus.runner.elastic_run import ElasticDriver
from hvdplus.runner.hosts import Slot
from hvdplus.runner.job_spec import ElasticOptions, JobSpec
from hvdplus.runner.supervise import Process

__all__ = ["RayHostDiscovery", "ActorProcess", "RayElasticDriver", "ElasticJob"]

log = logging.getLogger("hvdplus.ray")

KILLED = 128 + 9  # the exit status a worker whose actor died (or was stopped) reports, as for SIGKILL


class RayHostDiscovery:
    """Horovod's RayHostDiscovery: every live Ray node, with as many slots as its CPUs (and GPUs) allow."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1, gpus_per_worker: float = 1) -> None:
        self.use_gpu, self.cpus_per_worker, self.gpus_per_worker = use_gpu, cpus_per_worker, gpus_per_worker
        self.nodes: dict[str, str] = {}  # host name -> Ray node id

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """{host: slots} of the live nodes that fit at least one worker."""
        hosts: dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0) // self.cpus_per_worker) if self.cpus_per_worker else sys.maxsize
            if self.use_gpu:
                slots = min(slots, int(resources.get("GPU", 0) // self.gpus_per_worker))
            if slots > 0:
                host = host_name(node["NodeManagerAddress"], node["NodeID"])
                self.nodes[host] = node["NodeID"]
                hosts[host] = slots
        return hosts


@dataclass
class _Status:
    returncode: int | None = None


class ActorProcess:
    """One elastic worker's actor, seen by the driver as hvdplusrun sees a worker process: `exited`,
    `proc.returncode` (0: returned or left out, 1: raised, 137: the actor died or was stopped) and `stop()`."""

    def __init__(self, label: str, actor: Any, ref: Any) -> None:
        self.label, self.actor, self.ref = label, actor, ref
        self.proc = _Status()
        self.exited = threading.Event()
        self.exited_at = 0.0
        self.value: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._wait, name=f"hvdplus-ray-{label}", daemon=True).start()

    def _wait(self) -> None:
        try:
            self.value = ray.get(self.ref)
            code = 0
        except RayActorError as exc:
            self.error, code = exc, KILLED
        except Exception as exc:
            self.error, code = exc, 1
            print(f"hvdplus.ray: worker {self.label} raised:\n{_text(exc)}", file=sys.stderr, flush=True)
        self.stop()
        self.proc.returncode = code
        self.exited_at = time.monotonic()
        self.exited.set()

    def stop(self) -> None:
        """End the actor (its process): its peers see it go at once, as when a worker process ends."""
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # already gone
            log.debug("hvdplus.ray: ending worker %s: %s", self.label, exc)

    kill = stop

    @property
    def left_out(self) -> bool:
        return isinstance(self.value, str) and self.value == LEFT_OUT


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


class RayElasticDriver(ElasticDriver):
    """hvdplusrun's elastic driver, starting each worker as an actor on its Ray node (`launch`)."""

    def __init__(
        self,
        spec: JobSpec,
        options: ElasticOptions,
        launch: Callable[[str, str, dict[str, str]], ActorProcess],
        env: dict[str, str],
    ) -> None:
        super().__init__(spec, options)
        self.launch, self.env = launch, env
        self.address = ray.util.get_node_ip_address()
        self.processes: dict[str, ActorProcess] = {}
        self.messages: list[str] = []

    def launch_worker(self, wid: str, slot: Slot, elastic: dict[str, str]) -> Process:
        """Start worker `wid` as an actor on its host's node, in `slot` with the `elastic` variables."""
        env = {**self.env, **rank_env(slot, self.address, self.server.listen(self.address), self.secret), **elastic}
        process = self.launch(wid, host_of(wid), env)
        self.processes[wid] = process
        return cast(Process, process)

    def say(self, message: str) -> None:
        message = message.replace("hvdplusrun:", "hvdplus.ray:", 1)
        self.messages.append(message)
        print(message, file=sys.stderr, flush=True)


class ElasticJob:
    """An elastic job's settings; `run(fn)` runs `fn` on the workers the driver plans, to the end."""

    def __init__(
        self,
        options: ElasticOptions,
        discovery: Any,
        cpus_per_worker: float,
        gpus_per_worker: float,
        verbose: bool,
    ) -> None:
        self.options, self.discovery = options, discovery
        self.cpus_per_worker, self.gpus_per_worker, self.verbose = cpus_per_worker, gpus_per_worker, verbose
        self.env: dict[str, str] = {}

    def run(self, fn: Callable[[], Any]) -> list[Any]:
        """Run `fn()` in every worker until the job ends; the values of the last generation's workers, in rank
        order. RuntimeError naming the cause when the job cannot go on."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("hvdplus.ray: run elastic jobs from the main thread (the driver handles signals)")
        spec = JobSpec(command=[], slots=[], mode="gloo", env={}, verbose=self.verbose)

        def launch(wid: str, host: str, env: dict[str, str]) -> ActorProcess:
            return ActorProcess(wid, *self._start_actor(host, env, fn))

        driver = RayElasticDriver(spec, self.options, launch, self.env)
        try:
            code = driver.run()
        finally:
            for process in driver.processes.values():
                process.stop()
        if code != 0:
            errors = [(p.label, p.error) for p in driver.processes.values() if p.proc.returncode == 1 and p.error]
            detail = f"\nfirst worker error ({errors[0][0]}):\n{_text(errors[0][1])}" if errors else ""
            last = driver.messages[-1] if driver.messages else f"exit status {code}"
            raise RuntimeError(f"hvdplus.ray: the elastic job failed: {last}{detail}")
        assert driver.plan is not None
        return [driver.processes[w].value for w in driver.plan.workers]

    def _start_actor(self, host: str, env: dict[str, str], fn: Callable[[], Any]) -> tuple[Any, Any]:
        node = getattr(self.discovery, "nodes", {}).get(host)
        placement: dict[str, Any] = (
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}
            if node
            else {"resources": {f"node:{host}": 0.01}}  # a user's discovery names hosts by IP, as Horovod's
        )
        if self.gpus_per_worker:
            env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(int(env["HOROVOD_LOCAL_SIZE"])))}
        actor: Any = (
            ray.remote(BaseHorovodWorker)
            .options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0, **placement)
            .remote()
        )
        return actor, actor.execute_elastic.remote(fn, env)
