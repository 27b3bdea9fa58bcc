"""What `RayExecutor.create_settings` returns: Horovod's MiniSettings, and the environment it asks for."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RaySettings", "ElasticRaySettings", "settings_env"]


@dataclass
class RaySettings:
    """Horovod's settings for Ray jobs. `timeout_s` bounds the rendezvous and each engine call (HVDPLUS_TIMEOUT);
    `nics` names the interfaces Gloo and NCCL use. `ssh_identity_file` and `ssh_port` are kept for Horovod's
    callers and unused: Ray starts the workers, nothing goes over ssh."""

    nics: set[str] | None = None
    verbose: int = 1
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    elastic: bool = False


@dataclass
class ElasticRaySettings(RaySettings):
    """Horovod's ElasticSettings for `ElasticRayExecutor`: bounds on the workers, resets and waits. `discovery`
    is set by the executor (Ray's live nodes) unless the executor is told not to override it."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    cooldown_range: tuple[float, float] | None = None
    discovery: Any = None
    elastic: bool = field(default=True)

    @property
    def num_proc(self) -> int:
        """The workers the job waits for before it starts (Horovod: min_num_proc)."""
        return self.min_num_proc


def settings_env(settings: RaySettings) -> dict[str, str]:
    """The worker environment the settings ask for: the rendezvous/engine timeout and the network interfaces."""
    env = {"HVDPLUS_TIMEOUT": str(settings.timeout_s)}
    nics = _listed(settings.nics)
    if nics:
        env["GLOO_SOCKET_IFNAME"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    return env


def _listed(nics: Iterable[str] | str | None) -> list[str]:
    if not nics:
        return []
    if isinstance(nics, str):
        return [n for n in nics.split(",") if n]
    return sorted(nics)
