"""hvd.elastic for PyTorch (horovod.torch.elastic): run, State, ObjectState, TorchState, ElasticSampler.

State and ObjectState are exported here too: Horovod's docs tell torch users to subclass them, but its
horovod.torch.elastic does not export them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from hvdplus.common.elastic.state import ObjectState, State, run_fn
from hvdplus.torch.elastic.sampler import ElasticSampler
from hvdplus.torch.elastic.state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]

_StateT = TypeVar("_StateT", bound=State)
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def run(
    func: Callable[Concatenate[_StateT, _Params], _Result],
) -> Callable[Concatenate[_StateT, _Params], _Result]:
    """Decorate the training function `func(state, ...)`: it runs until it returns, across failures and host
    changes (see hvdplus.common.elastic.state). Collectives must not run outside it, or new workers would deadlock
    against the others' state sync."""
    return run_fn(func)
