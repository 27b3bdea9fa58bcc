"""`hvdplus.runner.run(fn, np=...)`: run a Python function on every rank and return its results, like horovod.run.

It goes through hvdplusrun's own code path (flags, hosts, Gloo or MPI mode, supervision); the function
and its results travel through the job's authenticated rendezvous store, so no shared filesystem is needed.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from hvdplus.common.rendezvous import RendezvousServer, new_secret
from hvdplus.runner.args import parse_args
from hvdplus.runner.gloo_run import rendezvous_addresses
from hvdplus.runner.job import job_from_args
from hvdplus.runner.launch import run_job

__all__ = ["run", "FUNCTION_KEY", "result_key"]

FUNCTION_KEY = "hvdplus/run/function"

_T = TypeVar("_T")


def result_key(rank: int) -> str:
    """The store key under which `rank` leaves its pickled (ok, value) pair."""
    return f"hvdplus/run/result/{rank}"


def _dumps(value: Any) -> bytes:
    try:
        import cloudpickle  # optional: also ships lambdas and functions defined in __main__
    except ImportError:
        return pickle.dumps(value)
    data: bytes = cloudpickle.dumps(value)
    return data


def _argv(
    np: int,
    hosts: str | None,
    hostfile: str | None,
    use_gloo: bool,
    use_mpi: bool,
    env: Mapping[str, str],
    options: dict[str, Any],
) -> list[str]:
    argv = ["-np", str(np)]
    for flag, value in (("-H", hosts), ("--hostfile", hostfile), *options.items()):
        if value is not None and value is not False:
            argv += [flag] if value is True else [flag, str(value)]
    argv += ["--gloo"] if use_gloo else ["--mpi"] if use_mpi else []
    for name, value in env.items():
        argv += ["-x", f"{name}={value}"]
    return argv + ["--", sys.executable, "-m", "hvdplus.runner.task"]


def run(
    fn: Callable[..., _T],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    np: int = 1,
    hosts: str | None = None,
    hostfile: str | None = None,
    use_gloo: bool = False,
    use_mpi: bool = False,
    env: Mapping[str, str] | None = None,
    start_timeout: int | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    network_interfaces: str | None = None,
    output_filename: str | None = None,
    verbose: bool = False,
) -> list[_T]:
    """Run `fn(*args, **kwargs)` on `np` ranks (hvd.init() inside it as usual); return the results by rank.

    Raises RuntimeError naming the failed rank (with its traceback) if any rank fails."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}; pass the function itself")
    options = {
        "--start-timeout": start_timeout,
        "--ssh-port": ssh_port,
        "--ssh-identity-file": ssh_identity_file,
        "--network-interfaces": network_interfaces,
        "--output-filename": output_filename,
        "--verbose": verbose,
    }
    spec = job_from_args(parse_args(_argv(np, hosts, hostfile, use_gloo, use_mpi, env or {}, options)), os.environ)
    payload = _dumps((fn, tuple(args), dict(kwargs or {})))
    if spec.mode == "mpi":  # mpirun has no store of its own: serve one for the function and results
        addresses = rendezvous_addresses([h.name for h in spec.hosts], spec.nics)
        address, secret = next(iter(addresses.values())), new_secret()
        server = RendezvousServer([address], secret)
        spec.env.update(
            {
                "HVDPLUS_RENDEZVOUS_ADDR": address,
                "HVDPLUS_RENDEZVOUS_PORT": str(server.port(address)),
                "HVDPLUS_SECRET_KEY": secret,
            }
        )
        server.put(FUNCTION_KEY, payload)
        try:
            code, _ = run_job(spec)
        finally:
            server.close()
    else:
        code, gloo_server = run_job(spec, prepare=lambda s: s.put(FUNCTION_KEY, payload))
        assert gloo_server is not None  # run_job returns Gloo mode's server
        server = gloo_server
    results = [server.get(result_key(rank)) for rank in range(len(spec.slots))]
    outcomes = [pickle.loads(r) if r is not None else None for r in results]
    failed = [(rank, o[1]) for rank, o in enumerate(outcomes) if o is not None and not o[0]]
    if code != 0 or failed or None in outcomes:
        detail = "".join(f"\n--- rank {rank} ---\n{trace}" for rank, trace in failed)
        raise RuntimeError(f"hvdplus.runner.run: the job failed (exit status {code}){detail}")
    return [o[1] for o in outcomes if o is not None]  # none is None here: that raised above
