"""TorchState: the model, the optimizer, ElasticSamplers and plain attributes of an elastic PyTorch job."""

from __future__ import annotations

from typing import Any

import torch

from hvdplus.common.basics import global_process_set, rank
from hvdplus.common.collectives import broadcast_object
from hvdplus.common.elastic.state import HandledState, OptimizerHandler, StateHandler
from hvdplus.torch.elastic.sampler import ElasticSampler
from hvdplus.torch.elastic.snapshot import Snapshot
from hvdplus.torch.functions import broadcast_parameters, broadcast_state

__all__ = ["TorchState"]


class _ModelHandler(StateHandler):
    """A module's state dict, committed into a Snapshot (an optimizer's too: see _OptimizerHandler)."""

    def __init__(self, model: torch.nn.Module | torch.optim.Optimizer) -> None:
        super().__init__(model)
        self._snapshot = Snapshot(model.state_dict())

    def save(self) -> None:
        self._snapshot.save(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._snapshot.tree)  # copies into the live parameters

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(OptimizerHandler, _ModelHandler):
    """An optimizer's state dict, committed into a Snapshot."""

    def restore(self) -> None:
        self.reset()
        self.value.load_state_dict(self._snapshot.fresh())  # the optimizer keeps these tensors: not our buffers

    def sync(self) -> None:
        broadcast_state(self.value, 0, None, global_process_set, initialize_everywhere=False)


class _SamplerHandler(StateHandler):
    """An ElasticSampler's progress through its epoch."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self.save()

    def save(self) -> None:
        self._saved = dict(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def reset(self) -> None:
        self.value.reset()  # the new size: re-partition what is left of the epoch, even when no sync follows


def _handler(value: Any) -> StateHandler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        if getattr(value, "_zero", None) is not None:
            raise TypeError(
                "TorchState cannot keep a ZeroOptimizer yet: its state is sharded over the ranks of one "
                "generation of the job and is not resharded at an elastic reset. Use "
                "hvd.DistributedOptimizer in elastic jobs."
            )
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(HandledState):
    """State of a PyTorch job: `model`, `optimizer`, and keyword attributes; modules, optimizers and
    ElasticSamplers among them are committed as tensors (preallocated host copies), the rest as Python objects."""

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ) -> None:
        super().__init__(
            _handler, bcast_object=broadcast_object, get_rank=rank, model=model, optimizer=optimizer, **kwargs
        )
