"""Process-wide state shared by every adapter: init, shutdown, ranks, process sets, build queries."""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import logging
import socket
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from hvdplus.common.control.coordinator import Coordinator
from hvdplus.common.control.messages import Request
from hvdplus.common.data.buffer_ops import agreed_device_kinds
from hvdplus.common.elastic.rendezvous import ElasticWorker
from hvdplus.common.engines import create_engine
from hvdplus.common.exceptions import NotInitializedError
from hvdplus.common.ops import OpKind
from hvdplus.common.settings import Settings
from hvdplus.common.timeline import Timeline
from hvdplus.common.topology import Topology

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "ProcessSet",
    "global_process_set",
    "init",
    "shutdown",
    "is_initialized",
    "runtime",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "add_process_set",
    "remove_process_set",
    "mpi_built",
    "mpi_enabled",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "mpi_threads_supported",
    "start_timeline",
    "stop_timeline",
    "elastic_worker",
]

log = logging.getLogger("hvdplus")
_LOG_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}


class ProcessSet:
    """A subset of ranks that runs collectives among itself (Horovod's process sets).

    Pass `process_set=` to any collective; only members may call it."""

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        self.mpi_comm: MPI.Comm | None = None
        """The mpi4py communicator it was built from, if any (its ranks then differ from rank to rank)."""
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            from mpi4py import MPI

            world = MPI.COMM_WORLD.Get_group()
            comm = self.mpi_comm = cast("MPI.Comm", ranks_or_comm)
            ranks_or_comm = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world)
        ranks = sorted(int(r) for r in ranks_or_comm)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"process set ranks must be unique, got {list(ranks_or_comm)}")
        self.ranks: list[int] = ranks
        """The members' global ranks, sorted (empty for the global set, which is every rank)."""
        self.process_set_id: int | None = None
        """Its id once registered (`init(process_sets=...)` or `add_process_set`); 0 is the global set."""
        self.registered_in: Runtime | None = None
        """The runtime it is registered in: an elastic reset makes a new runtime, without this set."""

    def _runtime_ranks(self) -> list[int]:
        return list(range(runtime().size)) if self.process_set_id == 0 else self.ranks

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self._runtime_ranks())

    def rank(self) -> int:
        """This process's rank within the set (ValueError if it is not a member)."""
        ranks = self._runtime_ranks()
        if runtime().rank not in ranks:
            raise ValueError(f"rank {runtime().rank} is not in process set {self.process_set_id} ({ranks})")
        return ranks.index(runtime().rank)

    def included(self) -> bool:
        """True if this process is a member."""
        return runtime().rank in self._runtime_ranks()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
"""The process set of every rank (id 0), the default `process_set` of every collective."""
global_process_set.process_set_id = 0


class Runtime:
    """Everything `init()` builds: settings, engine, topology and the background coordinator."""

    def __init__(self, settings: Settings, comm: Any, set_ranks: Sequence[Sequence[int]] = ()) -> None:
        """`set_ranks`: this rank's process sets for init (`init_set_ranks` becomes every rank's, by rank)."""
        self.settings = settings
        self.engine = create_engine(settings, comm)
        hostname = settings.launch.hostname or socket.gethostname()
        mine = json.dumps([hostname, [list(ranks) for ranks in set_ranks]]).encode()
        gathered = [json.loads(both) for both in self.engine.allgather_bytes(mine, self.engine.world)]
        self.init_set_ranks: list[list[tuple[int, ...]]] = [[tuple(r) for r in sets] for _, sets in gathered]
        self.topology = Topology(self.engine.rank, tuple(host for host, _ in gathered))
        self.coordinator = Coordinator(self.engine, settings, self.topology, agreed_device_kinds(self.engine, settings))
        self._counters: dict[str, int] = {}
        self._counter_lock = threading.Lock()
        # Named allreduce requests already checked, by their arguments (collectives.submit_allreduce): the same call
        # again skips the checks and the request's construction.
        self.checked_requests: dict[tuple[Any, ...], Request] = {}

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    @property
    def bucket_bytes(self) -> int:
        """Gradient bucket size: HVDPLUS_BUCKET_BYTES if set, else the engine's (Engine.bucket_bytes)."""
        return self.engine.bucket_bytes if self.settings.bucket_bytes is None else self.settings.bucket_bytes

    def auto_name(self, kind: str, process_set: int) -> str:
        """Names for unnamed collectives: equal on every rank that calls them in the same order."""
        key = f"{kind}.noname.ps{process_set}"
        with self._counter_lock:
            count = self._counters.get(key, 0)
            self._counters[key] = count + 1
        return f"{key}.{count}"


_runtime: Runtime | None = None
_elastic: ElasticWorker | None = None  # elastic mode: outlives each generation's runtime
_init_lock = threading.Lock()


def init(
    comm: MPI.Comm | list[int] | tuple[int, ...] | None = None,
    process_sets: Iterable[ProcessSet] | Literal["dynamic"] | None = None,
) -> None:
    """Start hvdplus: connect to the other ranks and start the background thread.

    Collective: every rank must call this. `comm` is an mpi4py communicator (or a list of ranks)
    to run on instead of MPI.COMM_WORLD; `process_sets` are registered right away: every rank's, so a set built
    from a communicator (its ranks differ by rank) is registered once per group. As in Horovod, an entry whose
    ranks an earlier one or the global set has raises ValueError on the ranks that listed it, after the others
    are registered; a later init() (hvdplus already running) registers those of its sets the job lacks and gives
    each the id of its ranks' set."""
    global _runtime
    with _init_lock:
        sets = [] if process_sets is None or process_sets == "dynamic" else list(process_sets)
        started = _runtime is not None and _runtime.coordinator.running
        if not started:
            settings = Settings.from_env()
            logging.basicConfig()
            log.setLevel(_LOG_LEVELS.get(settings.log_level.lower(), logging.WARNING))
            set_ranks = [process_set.ranks for process_set in sets]
            if settings.launch.elastic_worker:
                _runtime = _elastic_runtime(settings, comm, set_ranks)
            else:
                _runtime = Runtime(settings, comm, set_ranks)
            # atexit runs the last registered first: shut down before what the engine registered (MPI_Finalize,
            # where hvdplus initialized MPI), while no thread of ours is inside an MPI call.
            atexit.unregister(shutdown)
            atexit.register(shutdown)
    rt = runtime()
    global_process_set.ranks = list(range(rt.size))
    # A later init() registers its sets that this job lacks (init() then shutdown() and init() again with them):
    # every rank lists the same ranks then, as Horovod asks of sets given by ranks.
    order = _later_set_order(rt, sets) if started else _agreed_set_order(rt.init_set_ranks)
    for ranks in order:
        if rt.coordinator.process_set_id_of(ranks) is None:
            register_process_set(ProcessSet(ranks))
    _assign_set_ids(rt, sets)


def _agreed_set_order(set_ranks: list[list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Every rank's init sets (each rank's list may differ: sets built from communicators), in the order every
    rank registers them: by position in the lists, then by rank (Horovod's ids for its multi-comm test)."""
    longest = max((len(sets) for sets in set_ranks), default=0)
    ordered = [sets[i] for i in range(longest) for sets in set_ranks if i < len(sets)]
    return list(dict.fromkeys(ordered))


def _later_set_order(rt: Runtime, sets: list[ProcessSet]) -> list[tuple[int, ...]]:
    """The sets a later init() registers, in its list's order; ValueError for one built from a communicator, whose
    ranks differ from rank to rank: only the first init() gathers every rank's (Horovod's registers them there)."""
    for index, process_set in enumerate(sets):
        if process_set.mpi_comm is not None and rt.coordinator.process_set_id_of(tuple(process_set.ranks)) is None:
            raise ValueError(
                f"process_sets entry number {index} ({process_set}) is built from an MPI communicator and is not "
                "registered: pass it to the first hvd.init(), or build it from the list of its ranks"
            )
    return [tuple(process_set.ranks) for process_set in sets]


def _assign_set_ids(rt: Runtime, sets: list[ProcessSet]) -> None:
    """Give each of `sets` the id of the registered set of its ranks, as Horovod's init does; a set whose ranks an
    earlier entry (or the global set) has is left without one, and the first such entry raises ValueError."""
    seen, first_duplicate = {0}, None
    for index, process_set in enumerate(sets):
        set_id = rt.coordinator.process_set_id_of(tuple(process_set.ranks))
        if set_id is None or set_id in seen:  # None: another rank's init failed to register it
            process_set.process_set_id, process_set.registered_in = None, None
            first_duplicate = first_duplicate or (index, process_set)
        else:
            seen.add(set_id)
            process_set.process_set_id, process_set.registered_in = set_id, rt
    if first_duplicate is not None:
        index, process_set = first_duplicate
        raise ValueError(
            f"Horovod could not be initialized because process_sets entry number {index} is a duplicate: {process_set}"
        )


def _elastic_runtime(settings: Settings, comm: Any, set_ranks: Sequence[Sequence[int]]) -> Runtime:
    """Elastic mode: the runtime of this worker's next generation of the job (see elastic_rendezvous); if the
    launcher replaces that generation while its workers connect (one died), the one after it."""
    global _elastic
    if _elastic is None:
        _elastic = ElasticWorker(settings.launch, settings.timeout_seconds)
    while True:
        launch = _elastic.join(settings.launch, settings.elastic_timeout)
        try:
            return Runtime(dataclasses.replace(settings, launch=launch), comm, set_ranks)
        except Exception:
            if _elastic.latest() == launch.elastic_generation:
                raise
            log.warning(
                "generation %d of the elastic job was replaced while connecting: joining the next",
                launch.elastic_generation,
            )


def elastic_worker() -> ElasticWorker | None:
    """This process's membership in an elastic job (hvdplusrun with --min-np/--max-np or
    --host-discovery-script), or None when the job is not elastic."""
    return _elastic


def runtime() -> Runtime:
    """The runtime from init(), or NotInitializedError. It outlives a background thread stopped by
    another rank's shutdown (as in Horovod): rank() and size() still answer, collectives raise
    HorovodInternalError."""
    if _runtime is None:
        raise NotInitializedError()
    return _runtime


def shutdown() -> None:
    """Stop the background thread and release the engine. Safe to call twice."""
    global _runtime
    with _init_lock:
        if _runtime is not None:
            _runtime.coordinator.shutdown()
            _runtime = None


atexit.register(shutdown)


def is_initialized() -> bool:
    """True between `init()` and `shutdown()`."""
    return _runtime is not None and _runtime.coordinator.running


def rank() -> int:
    """This process's rank in the job (0 .. size-1)."""
    return runtime().topology.rank


def size() -> int:
    """Number of processes in the job."""
    return runtime().topology.size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return runtime().topology.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return runtime().topology.local_size


def cross_rank() -> int:
    """Index of this host among the hosts (ranks with the same local rank)."""
    return runtime().topology.cross_rank


def cross_size() -> int:
    """Number of hosts that run a process with this process's local rank."""
    return runtime().topology.cross_size


def is_homogeneous() -> bool:
    """True if every host runs the same number of processes."""
    return runtime().topology.is_homogeneous


def register_process_set(process_set: ProcessSet) -> ProcessSet:
    """Register `process_set` in this job, as `add_process_set` does but also without HOROVOD_DYNAMIC_PROCESS_SETS
    (init's sets, a pipeline's stage sets). Collective: every rank of the job must call this, in the same order."""
    rt = runtime()
    if process_set.process_set_id is not None and process_set.registered_in is rt:
        raise ValueError(f"{process_set} is already registered")
    bad = [r for r in process_set.ranks if not 0 <= r < rt.size]
    if bad or not process_set.ranks:
        raise ValueError(f"process set ranks must be non-empty and within 0..{rt.size - 1}, got {process_set.ranks}")
    existing = rt.coordinator.process_set_id_of(tuple(process_set.ranks))
    if existing is not None:  # every rank sees the same sets here: adding and removing them are collective
        raise ValueError(
            f"Attempted to add a duplicate process set: {process_set} has the ranks of process set {existing}"
        )
    request = Request(rt.auto_name("add_process_set", 0), OpKind.ADD_PROCESS_SET, ranks=tuple(process_set.ranks))
    process_set.process_set_id = rt.coordinator.submit(request).wait()
    process_set.registered_in = rt
    return process_set


def registered_process_set(ranks: Sequence[int]) -> ProcessSet | None:
    """The process set registered in this job with exactly `ranks` (the global set for every rank), if any: a
    set's ranks are registered once (Horovod's rule), so code that needs a set of given ranks may find it here."""
    rt = runtime()
    set_id = rt.coordinator.process_set_id_of(tuple(sorted(ranks)))
    if set_id is None:
        return None
    if set_id == 0:
        return global_process_set
    found = ProcessSet(ranks)
    found.process_set_id, found.registered_in = set_id, rt
    return found


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a new process set. Collective: every rank of the job must call this, in the same order."""
    if not runtime().settings.dynamic_process_sets:
        raise RuntimeError(
            "add_process_set after init needs HOROVOD_DYNAMIC_PROCESS_SETS=1 (or pass process_sets=[...] to hvd.init())"
        )
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return register_process_set(process_set)


def open_channel() -> Any:
    """A point-to-point channel among all ranks (engines/base.py `Channel`), closed at shutdown. Collective: every
    rank of the job must call this, in the same order relative to its other collectives."""
    rt = runtime()
    return rt.coordinator.submit(Request(rt.auto_name("open_channel", 0), OpKind.OPEN_CHANNEL)).wait()


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set. Collective: every rank of the job must call this, in the same order."""
    rt = runtime()
    if process_set.process_set_id in (None, 0):
        return False
    if rt.coordinator.process_set_ranks(process_set.process_set_id) is None:  # removed already (under another object)
        process_set.process_set_id = None
        return False
    request = Request(rt.auto_name("remove_process_set", 0), OpKind.REMOVE_PROCESS_SET, root=process_set.process_set_id)
    rt.coordinator.submit(request).wait()
    process_set.process_set_id = None
    return True


def _available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def mpi_built() -> bool:
    """True if mpi4py can be imported (hvdplus needs no build step)."""
    return _available("mpi4py")


def mpi_enabled() -> bool:
    """True if this job runs its CPU collectives over MPI."""
    return runtime().engine.name == "mpi"


def gloo_built() -> bool:
    """True if torch can be imported: torch.distributed brings Gloo."""
    return _available("torch")


def gloo_enabled() -> bool:
    """True if this job's CPU collectives run on torch.distributed's Gloo (else on MPI)."""
    return runtime().engine.name == "gloo"


def nccl_built() -> bool:
    """True if torch.distributed has NCCL, which reduces CUDA tensors on the GPU (torch/device_plane.py)."""
    if not _available("torch"):
        return False
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


def cuda_built() -> bool:
    """False: hvdplus has no CUDA kernels of its own; CUDA tensors go through NCCL (`nccl_built`)."""
    return False


def rocm_built() -> bool:
    """False: ROCm is not supported."""
    return False


def mpi_threads_supported() -> bool:
    """True if the MPI library was initialized with MPI_THREAD_MULTIPLE."""
    if not mpi_built():
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline of every collective to `file_path` (rank 0 writes), closing the one
    being written. Collectives submitted after this returns are on it; any thread may call it while collectives
    run."""
    state = runtime()
    state.coordinator.set_timeline(Timeline(file_path, mark_cycles) if state.rank == 0 else None)


def stop_timeline() -> None:
    """Finish and close the timeline started by HOROVOD_TIMELINE or start_timeline(); the file is complete when
    this returns."""
    runtime().coordinator.set_timeline(None)
