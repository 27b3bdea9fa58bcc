"""Elastic mode: hvdplusrun keeps a job running while workers fail and hosts come and go (Horovod Elastic's driver).

The job runs in generations. Each is a plan (hvdplus/common/elastic/plan.py): the workers, by their lasting ids
("host/slot"), in rank order, published in the authenticated rendezvous store. The driver:
- polls discovery (the script, or the fixed -H/--hostfile hosts) about every second in a thread of its own;
- plans a new generation when a worker fails (its host is blacklisted, its host's other workers are stopped, and
  its failure is written where the old generation's peers look, so they raise within a second instead of waiting
  for a transport timeout), or when the usable hosts would change the plan (workers see it at their next commit);
- starts workers for new slots at once, and lets them join a generation once they reach hvd.init, so the
  others train on while they start and import;
- lets workers on a host back from its blacklist cooldown in at once (the others wait for them from their next
  commit, as in Horovod), so that the job regains its size; with --wait-for-new-workers, every new worker;
- gives the lowest ranks to the longest-lived hosts, and rank 0 always to a worker that holds the state;
- never plans a generation without a worker that holds the last commit (a worker holds it once its state sync is
  over: common/elastic/state.py marks it in the store): when discovery removes every host whose workers hold it, they
  stay in the job as a bridge until workers on the remaining hosts have synced from them, then leave;
- counts a reset, as Horovod's driver does, for each worker failure and each host change that changes the workers
  it wants, when it happens, even while new workers are still starting;
- ends the job with a message naming the cause when every worker failed, every host is blacklisted, no worker
  holding the state is left, fewer than --min-np slots stay available for --elastic-timeout seconds, or the
  resets pass --reset-limit.
The job succeeds once a worker of the current generation exits 0 and the rest of that generation ends the same
way (a worker of it that never synced, planned as the others finished, is stopped); a worker that a plan left out
exits by itself (status 0) and counts for nothing (one still running 5 s after the new generation synced is
stopped), and its id is planned again only once it has ended.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

from hvdplus.common.elastic.plan import (
    LATEST_KEY,
    Plan,
    failure_notice_key,
    holds_key,
    host_of,
    plan_key,
    waiting_key,
    worker_id,
)
from hvdplus.common.rendezvous import RendezvousServer, new_secret
from hvdplus.runner.agent import source_address
from hvdplus.runner.elastic_hosts import HostManager
from hvdplus.runner.gloo_run import slot_env, start_agent
from hvdplus.runner.hosts import Host, Slot, assign_slots, is_local
from hvdplus.runner.job_spec import ElasticOptions, JobSpec
from hvdplus.runner.preflight import preflight
from hvdplus.runner.supervise import POLL_SECONDS, Process, Supervisor, describe_exit

__all__ = ["ElasticOptions", "run_elastic"]

DISCOVERY_SECONDS = 1.0
LEFT_OUT_GRACE_SECONDS = 5.0  # how long a worker the plan left out may take to exit by itself


class ElasticJobError(RuntimeError):
    """The elastic job cannot go on; the message names why."""


class _Signalled(BaseException):
    """hvdplusrun got SIGINT, SIGTERM or SIGHUP: the job ends."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Discovery(threading.Thread):
    """Runs discovery about every second and hands each result to the host manager."""

    def __init__(self, discover: Callable[[], dict[str, int]], hosts: HostManager) -> None:
        super().__init__(name="hvdplusrun-discovery", daemon=True)
        self._discover, self._hosts = discover, hosts
        self.stopped = threading.Event()
        self.error: Exception | None = None
        self.rounds = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self._hosts.update(self._discover())
                self.error = None
            except Exception as exc:  # a transient failure is retried; the first one ends the job (see _wait_first)
                self.error = exc
            self.rounds += 1
            self.stopped.wait(DISCOVERY_SECONDS)


class ElasticDriver:
    """Plans the generations of one elastic job and runs its workers (see the module docstring)."""

    def __init__(self, spec: JobSpec, options: ElasticOptions) -> None:
        self.spec, self.options = spec, options
        self.hosts = HostManager(options.cooldown_range)
        self.discovery = _Discovery(options.discover, self.hosts)
        self.secret = new_secret()
        self.server = RendezvousServer(["127.0.0.1"], self.secret)
        self.supervisor = Supervisor(spec.output_dir)
        self.workers: dict[str, Process] = {}  # the latest process of each worker id, running or ended
        self._handled: dict[int, Process] = {}  # the ended processes already acted on, by id (kept: ids stay unique)
        self._holders: set[str] = set()  # workers that hold the training state (the first generation's, or synced)
        self._synced_in: dict[str, int] = {}  # the latest generation in which each worker's process marked a sync
        self._joining: set[str] = set()  # started, in no generation yet: they join one once they reach hvd.init
        self._started_for: dict[str, int] = {}  # the generation each worker's latest process was started for
        self.plan: Plan | None = None
        self.resets = 0
        self._plan_version = -1  # the host manager's version the current plan was made from
        self._short_since: float | None = None  # when the usable slots fell below --min-np
        self._member_failed = False  # a worker of the running generation failed: a new plan is due
        self._wanted: frozenset[str] = frozenset()  # the workers on usable hosts that the last counted reset wanted
        self._failure_uncounted = False  # a worker failed since the last counted reset
        self._hosts_seen: dict[str, int] = {}  # the usable hosts when the driver last planned
        self._bridging = False  # the plan keeps workers of removed hosts until the state is handed over
        self._synced_at: tuple[int, float] | None = None  # (generation, when every worker of it had synced)
        self._leaving: set[str] = set()  # left out by a plan, still running: not planned again until they end
        self._stopped: set[str] = set()  # those of them the driver stopped (_stop_left_out)
        self._finishing = False

    def run(self) -> int:
        """Run the job to its end; its exit status. Every worker is stopped on the way out, whatever the way
        (success, failure, Ctrl-C, SIGTERM or SIGHUP: 128 + the signal)."""
        self.discovery.start()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            self._wait_first()
            return self._watch()
        except ElasticJobError as exc:
            self.say(f"hvdplusrun: elastic job failed: {exc}")
            return 1
        except _Signalled as signalled:
            self.say(f"hvdplusrun: got {signal.Signals(signalled.signum).name}; stopping every worker")
            return 128 + signalled.signum
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.discovery.stopped.set()
            self.supervisor.stop_all()
            self.server.close()

    @staticmethod
    def _on_signal(signum: int, frame: object) -> None:
        raise _Signalled(signum)

    def _wait_first(self) -> None:
        """Wait until discovery offers --np slots (or --min-np after --elastic-timeout), then start generation 0."""
        deadline = time.monotonic() + self.options.timeout
        while True:
            if self.discovery.error is not None and self.discovery.rounds <= 1:
                raise ElasticJobError(f"host discovery failed: {self.discovery.error}")
            slots = sum(n for _, n in self.hosts.usable())
            if self.discovery.rounds and (
                slots >= self.options.np or (time.monotonic() > deadline and slots >= self.options.min_np)
            ):
                self._replan("start")
                if self.plan is not None:  # None: a host went away since `slots` was counted; wait for more
                    self._holders = set(self.plan.workers)  # the first generation's state is every worker's own
                    return
            if time.monotonic() > deadline:
                raise ElasticJobError(
                    f"only {slots} slot(s) became available within --elastic-timeout "
                    f"{self.options.timeout:g} s; the job needs at least {self.options.min_np}"
                )
            time.sleep(POLL_SECONDS)

    def _watch(self) -> int:
        while True:
            code = self._check_exits()
            if code is not None:
                return code
            self._refresh_holders()
            if not self._finishing and self.hosts.version != self._plan_version:
                self._replan(self._host_change())
            elif not self._finishing and self._joining and all(self._ready(w) for w in self._joining):
                self._replan("new workers ready")
            elif not self._finishing and self._handed_over():
                self._replan("the state was handed over to the remaining hosts' workers")
            self._stop_left_out()
            time.sleep(POLL_SECONDS)

    def _host_change(self) -> str:
        """What changed in the usable hosts since the driver last planned, in words (a generation's reason)."""
        now = dict(self.hosts.usable())
        added = [h for h in now if h not in self._hosts_seen]
        back = [h for h in added if self.hosts.returned(h)]
        new = [h for h in added if h not in back]
        removed = [h for h in self._hosts_seen if h not in now]
        parts = [
            f"{', '.join(back)} back from the blacklist cooldown" if back else "",
            f"added {', '.join(new)}" if new else "",
            f"removed {', '.join(removed)}" if removed else "",
            "slots changed" if any(h in self._hosts_seen and now[h] != self._hosts_seen[h] for h in now) else "",
        ]
        said = "; ".join(part for part in parts if part)
        return f"hosts changed: {said}" if said else "hosts changed"

    def _check_exits(self) -> int | None:
        """Act on workers that ended; the job's exit status once it is over."""
        assert self.plan is not None
        self.check_engine()
        members = set(self.plan.workers) | self._joining
        for wid, process in list(self.workers.items()):
            if not process.exited.is_set() or id(process) in self._handled:
                continue
            self._handled[id(process)] = process
            if wid in self._leaving:  # gone at last: its id may be planned again (a new process)
                self._leaving.discard(wid)
                self._stopped.discard(wid)
                self._plan_version = -1
            code = process.proc.returncode
            if wid not in members:
                continue  # left out of the plan (it exits by itself) or stopped by the driver
            if code == 0:
                self._finishing = True
                continue
            if self._finishing:  # the job was ending well, then a worker of its last generation failed
                self.say(f"hvdplusrun: worker {wid} failed with {describe_exit(code)} after the job finished")
                return code if code > 0 else 1
            self._on_failure(wid, code)
            members = set(self.plan.workers) | self._joining
        return self._finished() if self._finishing else None

    def _finished(self) -> int | None:
        """The job's exit status once the plan's workers that hold the state have ended. The plan's workers that
        never synced (planned after the others' last commit: a host added or back as the job ended) would wait for
        the finished ones until --elastic-timeout: they are stopped instead."""
        assert self.plan is not None
        self._refresh_holders()
        trained = [w for w in self.plan.workers if w in self._holders]
        if not all(self.workers[w].exited.is_set() for w in trained):
            return None
        for wid in self.plan.workers:
            if wid not in trained and not self.workers[wid].exited.is_set():
                self.say(f"hvdplusrun: stopping worker {wid}: the job finished before it joined")
                self.workers[wid].stop()
        codes = [self.workers[w].proc.returncode for w in trained]
        return next((c for c in codes if c != 0), 0)

    def _on_failure(self, wid: str, code: int) -> None:
        """A worker of the running generation (or one starting to join) failed: blacklist its host, stop its host's
        other workers, tell the running generation's peers, and plan the next one."""
        assert self.plan is not None
        host = host_of(wid)
        rank = self.plan.rank_of(wid)
        where = f"rank {rank} of generation {self.plan.generation}" if rank is not None else "starting"
        self.say(f"hvdplusrun: worker {wid} ({where}) failed with {describe_exit(code)}; blacklisting host {host}")
        if rank is not None:
            self.server.put(
                failure_notice_key(self.plan.generation, rank),
                f"rank {rank} (worker {wid}) exited with {describe_exit(code)}".encode(),
            )
            self._member_failed = True
        self._failure_uncounted = True
        self._joining.discard(wid)
        self.hosts.blacklist(host)
        for other, process in self.workers.items():
            if host_of(other) == host and not process.exited.is_set():
                process.stop()
        self._replan(f"worker {wid} failed")

    def _holding(self) -> set[str]:
        """The workers that hold the training state and still run on usable hosts."""
        return {
            w
            for w in self._holders
            if not self.workers[w].exited.is_set() and not self.hosts.is_blacklisted(host_of(w))
        }

    def _candidates(self, holding: set[str]) -> list[str]:
        """The workers the job wants: every usable slot, hosts whose workers hold the state first (rank 0 is the
        sync's root), each group by age; at most --max-np."""
        usable = self.hosts.usable()
        usable.sort(key=lambda hs: not any(host_of(w) == hs[0] for w in holding))  # stable
        workers = [worker_id(host, slot) for host, slots in usable for slot in range(slots)]
        return workers[: self.options.max_np] if self.options.max_np else workers

    def _bridged(self, wanted: list[str], holding: set[str]) -> list[str]:
        """`wanted`, after the plan's workers that hold the state if none of `wanted` does (discovery removed
        every host that holds it): they stay, as rank 0 and up, until the others have synced from them."""
        bridging = self.plan is not None and bool(wanted) and not holding & set(wanted)
        if not bridging:
            self._bridging = False
            return wanted
        assert self.plan is not None
        bridge = [w for w in self.plan.workers if w in holding]
        if not self._bridging:
            self.say(
                f"hvdplusrun: every host whose workers hold the training state was removed; "
                f"{', '.join(bridge)} keep training until {', '.join(wanted)} have started and synced from them"
            )
        self._bridging = True
        return bridge + [w for w in wanted if w not in bridge]

    def _handed_over(self) -> bool:
        """Whether the plan keeps workers of removed hosts as a bridge and a worker of a usable host now holds
        the state: the bridge can go."""
        if self.plan is None or not self._bridging:
            return False
        usable, holding = {host for host, _ in self.hosts.usable()}, self._holding()
        return any(host_of(w) in usable and w in holding for w in self.plan.workers)

    def _refresh_holders(self) -> None:
        """Read the sync marks of the plan's workers that have not synced in its generation yet; a worker whose
        process marked one since its start holds the state."""
        if self.plan is None:
            return
        for wid in self.plan.workers:
            if self._synced_in.get(wid, -1) < self.plan.generation:
                mark = self.server.get(holds_key(wid))
                if mark is not None and int(mark) >= self._started_for[wid]:
                    self._synced_in[wid] = int(mark)
                    self._holders.add(wid)

    def _count_reset(self, wanted: list[str], reason: str) -> None:
        """Count a reset, as Horovod's driver does, for a failure or a change in the workers the job wants, when
        it happens (not when the generation that answers it starts); past --reset-limit the job ends."""
        changed = frozenset(wanted) != self._wanted or self._failure_uncounted
        self._wanted, self._failure_uncounted = frozenset(wanted), False
        if self.plan is None or not changed:
            return
        if self.options.reset_limit is not None and self.resets >= self.options.reset_limit:
            raise ElasticJobError(
                f"the job was reset {self.resets} time(s), the --reset-limit; the last reset was asked for "
                f"because {reason}"
            )
        self.resets += 1

    def _ready(self, wid: str) -> bool:
        """Whether a started worker has reached hvd.init (started, imported) and waits to join a generation."""
        return self.server.get(waiting_key(wid)) == str(self._started_for[wid]).encode()

    def _replan(self, reason: str) -> None:
        """Publish the next generation if the usable hosts give enough slots (else wait, up to --elastic-timeout).

        Workers for new slots start at once, but join a generation only once they have reached hvd.init: until
        then the others train on (a scale-up does not pause training for a new worker's start and imports).
        The workers the others wait for (_waited_for) are in the next generation at once, started or not."""
        version = self.hosts.version
        self._hosts_seen = dict(self.hosts.usable())
        holding = self._holding()
        if self.plan is not None and not holding:
            raise ElasticJobError(self._nobody_left())
        wanted = self._candidates(holding)
        self._count_reset(wanted, reason)
        # A process the last plan left out is on its way out (it saw the plan): its id waits for its exit.
        candidates = [w for w in self._bridged(wanted, holding) if w not in self._leaving]
        generation = 0 if self.plan is None else self.plan.generation + 1
        for wid in candidates:
            if wid not in self.workers or self.workers[wid].exited.is_set():
                self._start(wid, generation, candidates)
        starting = [w for w in candidates if w not in holding and not self._ready(w) and not self._waited_for(w)]
        admitted = self.plan is None or not starting  # one reset for a whole scale-up
        workers = [w for w in candidates if w in holding or admitted or self._waited_for(w)]
        if self.plan is not None and tuple(workers) == self.plan.workers and not self._member_failed:
            self._plan_version = version  # the change does not change the plan
            return
        if len(workers) < self.options.min_np:
            self._short_of_slots(len(workers), starting)
            return
        self._short_since = None
        self.plan = Plan(generation, tuple(workers))
        self._joining -= set(workers)
        self._holders &= set(workers)  # a holder the plan leaves out exits: it can bridge nothing any more
        self._leaving |= {
            w for w, p in self.workers.items() if w not in workers and w not in self._joining and not p.exited.is_set()
        }
        self._plan_version = version
        self.server.put(plan_key(generation), self.plan.encode())
        self.server.put(LATEST_KEY, str(generation).encode())
        if self.spec.verbose or generation:
            self.say(
                f"hvdplusrun: generation {generation} ({reason}): {self.plan.size} worker(s): {', '.join(workers)}"
            )
        self._member_failed = False

    def _nobody_left(self) -> str:
        for wid in self._holders:  # failures not acted on yet (they ended together) blacklist their hosts too
            host = host_of(wid)
            if self.workers[wid].proc.returncode not in (None, 0) and not self.hosts.is_blacklisted(host):
                self.hosts.blacklist(host)
        discovered = self.hosts.discovered()
        if discovered and all(self.hosts.is_blacklisted(h) for h in discovered):
            return f"every host is blacklisted ({', '.join(discovered)}): workers failed on each of them"
        return (
            f"every worker that held the training state has failed or left ({', '.join(sorted(self._holders))}): "
            "there is no state to carry on from"
        )

    def _waited_for(self, wid: str) -> bool:
        """Whether the others wait for new worker `wid` from their next commit (bounded by --elastic-timeout)
        instead of training on while it starts: its host is back from a blacklist cooldown (as in Horovod), or
        --wait-for-new-workers asks for Horovod's scale-up, where a script sees the new size at its next commit."""
        return self.options.wait_for_new_workers or self.hosts.returned(host_of(wid))

    def _short_of_slots(self, slots: int, starting: list[str]) -> None:
        """Fewer than --min-np workers can be planned: say what the driver waits for, up to --elastic-timeout."""
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
            wait = f"waiting up to {self.options.timeout:g} s (--elastic-timeout)"
            if slots + len(starting) >= self.options.min_np:
                self.say(
                    f"hvdplusrun: {slots} worker(s) ready, fewer than --min-np {self.options.min_np}: {wait} for "
                    f"{', '.join(starting)} to start (reach hvd.init)"
                )
            else:
                self.say(
                    f"hvdplusrun: {slots + len(starting)} slot(s) usable, fewer than --min-np "
                    f"{self.options.min_np}: {wait} for more hosts"
                )
        elif now - self._short_since > self.options.timeout:
            raise ElasticJobError(
                f"fewer than --min-np {self.options.min_np} slots ({slots}) stayed available for "
                f"--elastic-timeout {self.options.timeout:g} s"
            )
        self._plan_version = -1  # look again at the next round

    def _stop_left_out(self) -> None:
        """Stop the workers the plan left out that still run LEFT_OUT_GRACE_SECONDS after every worker of the plan
        has synced in its generation. Before that they may still be in a collective of the generation before; a
        left-out worker that is not stuck exits by itself (status 0, saying why) once it sees the plan."""
        plan = self.plan
        if plan is None or any(self._synced_in.get(w, -1) < plan.generation for w in plan.workers):
            return
        if self._synced_at is None or self._synced_at[0] != plan.generation:
            self._synced_at = (plan.generation, time.monotonic())
        if time.monotonic() - self._synced_at[1] < LEFT_OUT_GRACE_SECONDS:
            return
        for wid in sorted(self._leaving - self._stopped):
            process = self.workers[wid]
            if process.exited.is_set():
                continue
            self.say(
                f"hvdplusrun: stopping worker {wid}: generation {plan.generation} left it out, and it still runs "
                f"{LEFT_OUT_GRACE_SECONDS:g} s after that generation's workers synced"
            )
            self._stopped.add(wid)
            process.stop()

    def _start(self, wid: str, generation: int, workers: list[str]) -> None:
        """Start worker `wid` to join generation `generation` or a later one; `workers`: the planned ranks."""
        slot = assign_slots([Host(h, n) for h, n in Counter(map(host_of, workers)).items()], len(workers))[
            workers.index(wid)
        ]
        elastic = {
            "HOROVOD_ELASTIC": "1",
            "HVDPLUS_ELASTIC_WORKER": wid,
            "HVDPLUS_ELASTIC_GENERATION": str(generation),
            "HVDPLUS_ELASTIC_TIMEOUT": str(self.options.timeout),
        }
        self.workers[wid] = self.launch_worker(wid, slot, elastic)
        self._started_for[wid] = generation
        self._holders.discard(wid)  # a new process holds nothing until its first sync
        self._synced_in.pop(wid, None)
        self._joining.add(wid)

    def launch_worker(self, wid: str, slot: Slot, elastic: dict[str, str]) -> Process:
        """Start worker `wid` in `slot` (its ranks) with the `elastic` variables; what the driver watches (exit
        status, stop). hvdplusrun starts an agent on the worker's host, over ssh unless local; a cluster engine
        (hvdplus.ray, hvdplus.spark) overrides this to start an actor or hand the worker to a task."""
        host = host_of(wid)
        address = "127.0.0.1" if is_local(host) else source_address(host)
        env = slot_env(self.spec, slot, address, self.server.listen(address), self.secret)
        env.update(elastic)
        env["HVDPLUS_CPU_OPERATIONS"] = "gloo"
        return start_agent(self.spec, self.supervisor, host, env, address, f"worker {wid}", tag=wid)

    def check_engine(self) -> None:
        """Raise ElasticJobError if what starts the workers has failed as a whole (hvdplusrun's agents fail one
        by one, as workers; a cluster engine's job of tasks can fail at once)."""

    def say(self, message: str) -> None:
        """A notice of the driver's, to the launcher's stderr."""
        print(message, file=sys.stderr, flush=True)


def run_elastic(spec: JobSpec, options: ElasticOptions) -> int:
    """Run an elastic job in Gloo mode until it ends; its exit status."""
    preflight(spec)
    return ElasticDriver(spec, options).run()
