"""The one place that reads the environment: every knob is declared once, with its Horovod alias.

`Settings.from_env()` builds a frozen object at `init()`; nothing else in hvdplus calls `os.environ`
for configuration (the launcher writes the environment of its children, it never reads ours).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CROSS_ALGORITHMS",
    "Setting",
    "SETTINGS",
    "Settings",
    "LaunchEnv",
    "describe_settings",
    "expand_nodelist",
    "slurm_port",
]


CROSS_ALGORITHMS = ("auto", "ring", "halving-doubling", "engine")


def _parse_library(text: str) -> str:
    """An operations library name, compared without case as Horovod does (strcasecmp: HOROVOD_CPU_OPERATIONS=MPI,
    and HOROVOD_GPU_OPERATIONS=NCCL as Horovod's build instructions set it)."""
    return text.strip().lower()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


@dataclass(frozen=True)
class Setting:
    """One declared knob: its field name, parser, default, meaning and environment names."""

    field: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    env: str
    alias: str | None = None

    def is_set(self, environ: Mapping[str, str]) -> bool:
        """Whether `environ` gives this setting, by its name or its Horovod alias."""
        return self.env in environ or (self.alias is not None and self.alias in environ)

    def read(self, environ: Mapping[str, str]) -> Any:
        """Return the parsed value from `environ` (HVDPLUS_* wins over the HOROVOD_* alias)."""
        for key in (self.env, self.alias):
            if key and key in environ:
                try:
                    return self.parse(environ[key])
                except ValueError as exc:
                    raise ValueError(f"environment variable {key}={environ[key]!r} is invalid: {exc}") from None
        return self.default


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "fusion_threshold",
        int,
        128 * 1024 * 1024,
        "Bytes packed into one fused allreduce buffer; 0 disables fusion.",
        "HVDPLUS_FUSION_THRESHOLD",
        "HOROVOD_FUSION_THRESHOLD",
    ),
    Setting(
        "bucket_bytes",
        int,
        None,
        "Bytes of gradients a DistributedOptimizer allreduces as one packed bucket when groups= is not given "
        "(also ZeroOptimizer's reduce-scatter buckets); unset, the engine's: 1 MiB of gradients under 1 MiB "
        "over MPI (larger ones go alone, in place), 25 MiB of any gradients over Gloo (DDP's bucket); 0 "
        "allreduces each gradient on its own, as Horovod does.",
        "HVDPLUS_BUCKET_BYTES",
    ),
    Setting(
        "first_bucket_bytes",
        int,
        1 << 20,
        "DDP's first-bucket rule: the first gradient bucket a DistributedOptimizer fills (the last layers') closes "
        "once it holds this many bytes (the gradient that reaches the limit is in it), so its allreduce starts early "
        "in the backward pass; the later buckets hold HVDPLUS_BUCKET_BYTES. 0 gives the first bucket the same size "
        "as the others.",
        "HVDPLUS_FIRST_BUCKET_BYTES",
    ),
    Setting(
        "planned_path",
        _parse_bool,
        True,
        "Once every rank has run the same DistributedOptimizer step (PyTorch, CPU tensors), freeze it in one "
        "agreement and reduce its gradient buckets straight from the backward hooks, non-blocking, with no "
        "negotiation; 0 keeps every step on Horovod's negotiated path.",
        "HVDPLUS_PLANNED_PATH",
    ),
    Setting(
        "cycle_time_ms",
        float,
        1.0,
        "Milliseconds the background thread waits between negotiation cycles.",
        "HVDPLUS_CYCLE_TIME",
        "HOROVOD_CYCLE_TIME",
    ),
    Setting(
        "cache_capacity",
        int,
        1024,
        "Responses remembered so that repeated collectives skip full negotiation; 0 disables.",
        "HVDPLUS_CACHE_CAPACITY",
        "HOROVOD_CACHE_CAPACITY",
    ),
    Setting(
        "negotiation_doubling_ranks",
        int,
        16,
        "From this many ranks on, new (uncached) announcements are exchanged by recursive doubling of merged "
        "tables (log2 N rounds, O(names) bytes a rank) instead of one allgather (1 round, O(ranks x names)).",
        "HVDPLUS_NEGOTIATION_DOUBLING_RANKS",
    ),
    Setting(
        "hierarchical_allreduce",
        _parse_bool,
        False,
        "Allreduce as local reduce-scatter, cross-host allreduce, local allgather (where the hosts run equal "
        "numbers of ranks). Off by default, as in Horovod: it pays where the link between hosts is much slower "
        "than within a host (0.57-0.70x flat at 64 MB over 1 Gbit/s, pipelined; see Tuning); HOROVOD_AUTOTUNE "
        "tries it.",
        "HVDPLUS_HIERARCHICAL_ALLREDUCE",
        "HOROVOD_HIERARCHICAL_ALLREDUCE",
    ),
    Setting(
        "hierarchical_allgather",
        _parse_bool,
        False,
        "Allgather within each host, across hosts between local rank 0s, then broadcast within each host.",
        "HVDPLUS_HIERARCHICAL_ALLGATHER",
        "HOROVOD_HIERARCHICAL_ALLGATHER",
    ),
    Setting(
        "cross_algorithm",
        str,
        "auto",
        "Algorithm of the cross-host step of a hierarchical allreduce: 'ring', 'halving-doubling' (power-of-two "
        "host counts), 'engine' (the library's own allreduce), or 'auto' (halving-doubling, else ring).",
        "HVDPLUS_CROSS_ALGORITHM",
    ),
    Setting(
        "hierarchical_chunk_bytes",
        int,
        4 * 1024 * 1024,
        "A hierarchical allreduce of at least two chunks of this many bytes is pipelined: each chunk's cross-host "
        "step runs on a thread of its own while the next chunk is reduced within the host (0: never).",
        "HVDPLUS_HIERARCHICAL_CHUNK_BYTES",
    ),
    Setting(
        "autotune",
        _parse_bool,
        False,
        "Pick the fusion threshold, cycle time and hierarchical options from measured throughput during the "
        "first steps (settings given explicitly stay fixed).",
        "HVDPLUS_AUTOTUNE",
        "HOROVOD_AUTOTUNE",
    ),
    Setting(
        "autotune_log",
        str,
        "",
        "CSV file where rank 0 writes every autotune sample and the chosen configuration; empty: none.",
        "HVDPLUS_AUTOTUNE_LOG",
        "HOROVOD_AUTOTUNE_LOG",
    ),
    Setting(
        "autotune_warmup_samples",
        int,
        3,
        "Autotune samples discarded at the start (the first steps run slower for other reasons).",
        "HVDPLUS_AUTOTUNE_WARMUP_SAMPLES",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    ),
    Setting(
        "autotune_steps_per_sample",
        int,
        10,
        "Cycles that carried collectives in one autotune sample.",
        "HVDPLUS_AUTOTUNE_STEPS_PER_SAMPLE",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    ),
    Setting(
        "autotune_bayes_opt_max_samples",
        int,
        20,
        "Most configurations autotune measures (after warmup) before it keeps the best.",
        "HVDPLUS_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    ),
    Setting(
        "timeline",
        str,
        "",
        "Path of a Chrome-trace timeline written by rank 0; empty disables it; DYNAMIC (Horovod's value) writes none "
        "until hvd.start_timeline().",
        "HVDPLUS_TIMELINE",
        "HOROVOD_TIMELINE",
    ),
    Setting(
        "timeline_mark_cycles",
        _parse_bool,
        False,
        "Mark every negotiation cycle in the timeline.",
        "HVDPLUS_TIMELINE_MARK_CYCLES",
        "HOROVOD_TIMELINE_MARK_CYCLES",
    ),
    Setting(
        "stall_check_disable",
        _parse_bool,
        False,
        "Turn off the warning about collectives that only some ranks submitted.",
        "HVDPLUS_STALL_CHECK_DISABLE",
        "HOROVOD_STALL_CHECK_DISABLE",
    ),
    Setting(
        "stall_check_time_seconds",
        float,
        60.0,
        "Seconds a collective may wait for missing ranks before a warning names them.",
        "HVDPLUS_STALL_CHECK_TIME_SECONDS",
        "HOROVOD_STALL_CHECK_TIME_SECONDS",
    ),
    Setting(
        "stall_shutdown_time_seconds",
        float,
        0.0,
        "Seconds after which a stalled collective fails on every rank; 0 waits forever.",
        "HVDPLUS_STALL_SHUTDOWN_TIME_SECONDS",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    ),
    Setting(
        "log_level",
        str,
        "warning",
        "Logging level of the 'hvdplus' logger: trace, debug, info, warning, error, fatal.",
        "HVDPLUS_LOG_LEVEL",
        "HOROVOD_LOG_LEVEL",
    ),
    Setting(
        "cpu_operations",
        _parse_library,
        "",
        "Engine for CPU tensors: 'mpi' or 'gloo'; empty chooses MPI when launched by mpirun.",
        "HVDPLUS_CPU_OPERATIONS",
        "HOROVOD_CPU_OPERATIONS",
    ),
    Setting(
        "gpu_operations",
        _parse_library,
        "nccl",
        "Engine for CUDA tensors: 'nccl' (torch.distributed's NCCL, on the GPU), 'gloo' (torch.distributed's Gloo "
        "on CUDA tensors: several ranks may share one GPU, which NCCL refuses) or 'mpi' (staged through host memory "
        "to the CPU engine).",
        "HVDPLUS_GPU_OPERATIONS",
        "HOROVOD_GPU_OPERATIONS",
    ),
    Setting(
        "device_path_on_cpu",
        _parse_bool,
        False,
        "Send CPU torch tensors through the GPU code path (torch buffer operations, a Gloo device engine): "
        "how the NCCL path is tested on machines without a GPU.",
        "HVDPLUS_DEVICE_PATH_ON_CPU",
    ),
    Setting(
        "staged_path_on_cpu",
        _parse_bool,
        False,
        "Treat CPU torch tensors as device tensors that no device plane takes (HOROVOD_GPU_OPERATIONS=mpi): each "
        "collective stages them through a host copy that never shares their memory, and no plan freezes. How the "
        "staged path of CUDA tensors is tested on machines without a GPU.",
        "HVDPLUS_STAGED_PATH_ON_CPU",
    ),
    Setting(
        "dynamic_process_sets",
        _parse_bool,
        False,
        "Allow add_process_set/remove_process_set after init.",
        "HVDPLUS_DYNAMIC_PROCESS_SETS",
        "HOROVOD_DYNAMIC_PROCESS_SETS",
    ),
    Setting(
        "timeout_seconds",
        float,
        60.0,
        "Seconds to wait for peers at rendezvous and inside one engine call before failing.",
        "HVDPLUS_TIMEOUT",
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
    ),
    Setting(
        "elastic_timeout",
        float,
        600.0,
        "Elastic jobs: seconds a worker waits for the next generation of the job at a reset (and the launcher "
        "for --min-np slots) before failing.",
        "HVDPLUS_ELASTIC_TIMEOUT",
        "HOROVOD_ELASTIC_TIMEOUT",
    ),
)


def _launch_value(environ: Mapping[str, str], *keys: str) -> str | None:
    for key in keys:
        if environ.get(key, "") != "":
            return environ[key]
    return None


def _launch_int(environ: Mapping[str, str], *keys: str) -> int | None:
    for key in keys:
        if environ.get(key, "") != "":
            try:
                return int(environ[key])
            except ValueError:
                raise ValueError(
                    f"environment variable {key}={environ[key]!r} is invalid: expected an integer"
                ) from None
    return None


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"bad Slurm host list {text!r}: nested or unbalanced brackets")
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"bad Slurm host list {text!r}: unbalanced brackets")
    return parts + [text[start:]]


def _expand_range(token: str, text: str) -> list[str]:
    low, _, high = token.partition("-")
    if not low.isdigit() or not (high.isdigit() or not high):
        raise ValueError(f"bad Slurm host list {text!r}: {token!r} is not a number or a range like 01-04")
    if not high:
        return [low]
    if int(high) < int(low):
        raise ValueError(f"bad Slurm host list {text!r}: range {token!r} runs backwards")
    return [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]


def _expand_host(pattern: str, text: str) -> list[str]:
    if "[" not in pattern:
        return [pattern]
    head, _, rest = pattern.partition("[")
    inside, _, tail = rest.partition("]")
    values = [v for token in inside.split(",") for v in _expand_range(token, text)]
    return [head + value + host for value in values for host in _expand_host(tail, text)]


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm host list such as 'node[01-04,07],gpu1' into host names, in order."""
    hosts = [host for part in _split_top_level(text.strip()) for host in _expand_host(part.strip(), text)]
    if not hosts or "" in hosts:
        raise ValueError(f"bad Slurm host list {text!r}: empty host name")
    return hosts


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port every task of one srun step computes alike (10000-31999, below ephemeral ports)."""
    return 10000 + (job_id * 64 + step_id) % 22000


@dataclass(frozen=True)
class LaunchEnv:
    """How this process was started: rank variables set by hvdplusrun, mpirun or Slurm."""

    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    hostname: str | None = None
    rendezvous_addr: str | None = None
    rendezvous_port: int | None = None
    rendezvous_file: str | None = None
    secret_key: str | None = None
    under_mpi: bool = False
    slurm_nodelist: str | None = None
    slurm_tasks_per_node: str | None = None
    srun_secret_file: str | None = None  # under plain srun: where rank 0 publishes the rendezvous secret
    agent_store: bool = False  # torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT
    elastic_worker: str | None = None  # hvdplusrun's elastic mode: this worker's lasting id, "host/slot"
    elastic_generation: int = 0  # elastic mode: the first generation of the job this worker belongs to
    store_prefix: str = ""  # elastic mode: the generation's namespace in the rendezvous store

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> LaunchEnv:
        """Read the launcher's variables (HVDPLUS_*, HOROVOD_*, then torchrun's, SLURM_*, then mpirun's). torchrun's
        RANK, WORLD_SIZE and LOCAL_RANK count only where torchrun set them (TORCHELASTIC_RUN_ID): under
        `srun torchrun`, SLURM_PROCID numbers the agents, not the ranks."""
        torchrun = "TORCHELASTIC_RUN_ID" in environ
        env = cls(
            rank=_launch_int(
                environ,
                "HVDPLUS_RANK",
                "HOROVOD_RANK",
                *(["RANK"] if torchrun else []),
                "SLURM_PROCID",
                "OMPI_COMM_WORLD_RANK",
                "PMI_RANK",
            ),
            size=_launch_int(
                environ,
                "HVDPLUS_SIZE",
                "HOROVOD_SIZE",
                *(["WORLD_SIZE"] if torchrun else []),
                "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE",
            ),
            local_rank=_launch_int(
                environ,
                "HVDPLUS_LOCAL_RANK",
                "HOROVOD_LOCAL_RANK",
                *(["LOCAL_RANK"] if torchrun else []),
                "SLURM_LOCALID",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID",
            ),
            agent_store=torchrun and environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            hostname=_launch_value(environ, "HVDPLUS_HOSTNAME", "HOROVOD_HOSTNAME"),
            rendezvous_addr=_launch_value(
                environ, "HVDPLUS_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "MASTER_ADDR"
            ),
            rendezvous_port=_launch_int(
                environ, "HVDPLUS_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT", "MASTER_PORT"
            ),
            rendezvous_file=_launch_value(environ, "HVDPLUS_RENDEZVOUS_FILE"),
            secret_key=_launch_value(environ, "HVDPLUS_SECRET_KEY"),
            under_mpi=_launch_value(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
            is not None,
            slurm_nodelist=_launch_value(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
            slurm_tasks_per_node=_launch_value(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
            elastic_worker=_launch_value(environ, "HVDPLUS_ELASTIC_WORKER"),
            elastic_generation=_launch_int(environ, "HVDPLUS_ELASTIC_GENERATION") or 0,
        )
        return env._with_srun_rendezvous(environ)

    def _with_srun_rendezvous(self, environ: Mapping[str, str]) -> LaunchEnv:
        """Under plain srun (a job step, no launcher): rank 0's authenticated store on the step's first node, its
        secret published in a 0600 file under HVDPLUS_SECRET_DIR (default ~/.hvdplus), which the nodes share."""
        job, step = _launch_int(environ, "SLURM_JOB_ID"), _launch_int(environ, "SLURM_STEP_ID")
        if self.rendezvous_file or self.rendezvous_addr or job is None or step is None or not self.slurm_nodelist:
            return self
        home = environ.get("HOME") or os.path.expanduser("~")
        secret_dir = environ.get("HVDPLUS_SECRET_DIR") or os.path.join(home, ".hvdplus")
        return dataclasses.replace(
            self,
            rendezvous_addr=expand_nodelist(self.slurm_nodelist)[0],
            rendezvous_port=self.rendezvous_port or slurm_port(job, step),
            srun_secret_file=os.path.join(secret_dir, f"srun-{job}.{step}.secret"),
        )


@dataclass(frozen=True)
class Settings:
    """All hvdplus configuration, read once from the environment at init."""

    fusion_threshold: int = 128 * 1024 * 1024
    bucket_bytes: int | None = None  # None: the engine's (Engine.bucket_bytes)
    first_bucket_bytes: int = 1 << 20
    planned_path: bool = True
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    negotiation_doubling_ranks: int = 16
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    cross_algorithm: str = "auto"
    hierarchical_chunk_bytes: int = 4 * 1024 * 1024
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    timeline: str = ""
    timeline_mark_cycles: bool = False
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    log_level: str = "warning"
    cpu_operations: str = ""
    gpu_operations: str = "nccl"
    device_path_on_cpu: bool = False
    staged_path_on_cpu: bool = False
    dynamic_process_sets: bool = False
    timeout_seconds: float = 60.0
    elastic_timeout: float = 600.0
    launch: LaunchEnv = field(default_factory=LaunchEnv)
    explicit: frozenset[str] = frozenset()  # fields the user set (environment or override): autotune leaves them

    def __post_init__(self) -> None:
        if self.fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be >= 0 bytes, got {self.fusion_threshold}")
        if self.bucket_bytes is not None and self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 bytes, got {self.bucket_bytes}")
        if self.first_bucket_bytes < 0:
            raise ValueError(f"first_bucket_bytes must be >= 0 bytes, got {self.first_bucket_bytes}")
        if self.cycle_time_ms <= 0:
            raise ValueError(f"cycle_time_ms must be > 0, got {self.cycle_time_ms}")
        if self.hierarchical_chunk_bytes < 0:
            raise ValueError(f"hierarchical_chunk_bytes must be >= 0, got {self.hierarchical_chunk_bytes}")
        if self.cross_algorithm not in CROSS_ALGORITHMS:
            raise ValueError(f"cross_algorithm must be one of {CROSS_ALGORITHMS}, got {self.cross_algorithm!r}")
        if self.autotune_warmup_samples < 0:
            raise ValueError(f"autotune_warmup_samples must be >= 0, got {self.autotune_warmup_samples}")
        if self.autotune_steps_per_sample < 1:
            raise ValueError(f"autotune_steps_per_sample must be >= 1, got {self.autotune_steps_per_sample}")
        if self.autotune_bayes_opt_max_samples < 1:
            raise ValueError(f"autotune_bayes_opt_max_samples must be >= 1, got {self.autotune_bayes_opt_max_samples}")
        if self.cpu_operations not in ("", "mpi", "gloo"):
            raise ValueError(f"cpu_operations must be 'mpi' or 'gloo', got {self.cpu_operations!r}")
        if self.gpu_operations not in ("nccl", "gloo", "mpi"):
            raise ValueError(f"gpu_operations must be 'nccl', 'gloo' or 'mpi', got {self.gpu_operations!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from `environ` (default: os.environ); keyword overrides win. `explicit` names the
        settings given by either environment name or by an override."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {setting.field: setting.read(environ) for setting in SETTINGS}
        values["launch"] = LaunchEnv.from_env(environ)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown setting(s): {sorted(unknown)}")
        given = {s.field for s in SETTINGS if s.is_set(environ)} | set(overrides) - {"launch", "explicit"}
        values["explicit"] = frozenset(given)
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as exc:
            names = ["/".join(filter(None, (s.env, s.alias))) for s in SETTINGS if str(exc).startswith(f"{s.field} ")]
            raise ValueError(f"{exc} (set by environment variable {', '.join(names)})") from None


def describe_settings() -> str:
    """Return a table of every setting, its environment names, default and meaning."""
    rows = [f"{s.env:38} {s.alias or '':38} {s.default!r:>12}  {s.doc}" for s in SETTINGS]
    return "\n".join(rows)
