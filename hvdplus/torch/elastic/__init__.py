"""hvd.elastic for PyTorch (horovod.torch.elastic): run, State, ObjectState, TorchState, ElasticSampler.

State and ObjectState are exported here too: Horovod's docs tell torch users to subclass them, but its
horovod.torch.elastic does not export them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvdplus.common.elastic import ObjectState, State, run_fn
from hvdplus.torch.elastic.sampler import ElasticSampler
from hvdplus.torch.elastic.state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function `func(state, ...)`: it runs until it returns, across failures and host
    changes (see hvdplus.common.elastic). Collectives must not run outside it, or new workers would deadlock
    against the others' state sync."""
    return run_fn(func)
