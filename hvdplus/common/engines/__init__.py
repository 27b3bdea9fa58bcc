"""Engine registry: how a job's ranks talk, chosen once at init from how the job was launched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvdplus.common.engines.base import Engine
from hvdplus.common.settings import Settings

__all__ = ["Engine", "create_engine", "choose_engine_name", "ENGINE_FACTORIES"]


def _mpi(settings: Settings, comm: Any) -> Engine:
    from hvdplus.common.engines.mpi import MPIEngine

    return MPIEngine(comm)


def _gloo(settings: Settings, comm: Any) -> Engine:
    from hvdplus.common.engines.torch_dist import TorchDistEngine

    return TorchDistEngine(settings.launch, settings.timeout_seconds, settings.stall_shutdown_time_seconds or None)


def _local(settings: Settings, comm: Any) -> Engine:
    from hvdplus.common.engines.local import LocalEngine

    return LocalEngine()


ENGINE_FACTORIES: dict[str, Callable[[Settings, Any], Engine]] = {"mpi": _mpi, "gloo": _gloo, "local": _local}


def choose_engine_name(settings: Settings, comm: Any = None) -> str:
    """MPI when asked for or launched by mpirun; Gloo when a launcher set ranks; else one local rank."""
    if settings.cpu_operations:
        return settings.cpu_operations
    if comm is not None or settings.launch.under_mpi:
        return "mpi"
    if settings.launch.size is not None and settings.launch.size > 1:
        return "gloo"
    return "local"


def create_engine(settings: Settings, comm: Any = None) -> Engine:
    """Build the engine `choose_engine_name` picks."""
    return ENGINE_FACTORIES[choose_engine_name(settings, comm)](settings, comm)
