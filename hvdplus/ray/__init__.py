"""Horovod's Ray API (horovod.ray): RayExecutor and ElasticRayExecutor start ranks as Ray actors.

Ray only starts the ranks and hands them an authenticated rendezvous; everything after hvd.init() is hvdplus's
runtime, as under hvdplusrun. Needs Ray: pip install 'hvdplus[ray]'."""

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("hvdplus.ray needs Ray: pip install 'hvdplus[ray]'") from exc

from hvdplus.ray.elastic import ElasticRayExecutor
from hvdplus.ray.runner import RayExecutor
from hvdplus.ray.settings import ElasticRaySettings, RaySettings
from hvdplus.ray.worker import BaseHorovodWorker

__all__ = ["RayExecutor", "ElasticRayExecutor", "BaseHorovodWorker", "RaySettings", "ElasticRaySettings"]
