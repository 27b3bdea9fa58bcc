"""The Ray actor that hosts one rank (Horovod's BaseHorovodWorker): it runs the user's functions in the
environment the executor hands it with each call, and never leaves a failed rank's runtime running."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import ray

from hvdplus.ray.ranks import WorkerNode

__all__ = ["BaseHorovodWorker", "LEFT_OUT", "stop_runtime"]

LEFT_OUT = "hvdplus.ray: left out of the elastic job's latest generation"


def stop_runtime() -> None:
    """Shut this process's hvdplus runtime down if it has one: its peers' collectives then fail within a second
    (a shutdown stops every rank) instead of waiting for a rank that will not come."""
    basics = sys.modules.get("hvdplus.common.basics")
    if basics is None:
        return
    try:
        basics.runtime()
    except Exception:  # NotInitializedError: nothing to stop
        return
    basics.shutdown()


def _raised_on_rank(exc: BaseException) -> None:
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(f"hvdplus.ray: raised on rank {os.environ.get('HOROVOD_RANK', '?')} ({socket.gethostname()})")


class BaseHorovodWorker:
    """One rank's actor. `execute(fn, env)` sets `env` (the rank's variables and the call's rendezvous, secret
    included) in this process's environment and returns `fn(executable)`; if `fn` raises, this rank's hvdplus
    runtime is shut down before the error goes back to the driver."""

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list[str]:
        """The CUDA device ids Ray gave this actor."""
        return [str(i) for i in ray.get_gpu_ids()]

    def where(self) -> WorkerNode:
        """This actor's Ray node (id and IP) and GPUs."""
        return WorkerNode(self.node_id(), ray.util.get_node_ip_address(), tuple(self.get_gpu_ids()))

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set variables in this actor's environment."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: type | None = None,
        executable_args: list[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """Create `executable_cls(*args, **kwargs)` in this actor (None: no executable)."""
        if executable_cls is not None:
            self.executable = self.execute(
                lambda _: executable_cls(*(executable_args or []), **(executable_kwargs or {})), env
            )

    def execute(self, func: Callable[[Any], Any], env: dict[str, str] | None = None) -> Any:
        """`func(executable)` with `env` set; a failure shuts this rank's runtime down and names the rank."""
        self.update_env_vars(env or {})
        try:
            return func(self.executable)
        except BaseException as exc:
            _raised_on_rank(exc)
            stop_runtime()
            raise

    def execute_elastic(self, func: Callable[[], Any], env: dict[str, str]) -> Any:
        """An elastic worker's whole life: `func()` with `env` set. A worker the latest plan leaves out exits
        with status 0 (SystemExit(0)): it returns LEFT_OUT instead. The driver ends the actor after the call."""
        self.update_env_vars(env)
        try:
            value = func()
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(f"elastic worker exited with status {exc.code}") from exc
            value = LEFT_OUT
        stop_runtime()  # what a worker process's exit does (atexit) before the driver ends the actor
        return value

    def live_rendezvous_port(self) -> int | None:
        """The rendezvous port of this process's running hvdplus runtime, or None when it has none."""
        basics = sys.modules.get("hvdplus.common.basics")
        if basics is None or not basics.is_initialized():
            return None
        port: int | None = basics.runtime().settings.launch.rendezvous_port
        return port
