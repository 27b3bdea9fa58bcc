"""TorchState: the model, the optimizer, ElasticSamplers and plain attributes of an elastic PyTorch job."""

from __future__ import annotations

from typing import Any

import torch

from hvdplus.common.basics import rank
from hvdplus.common.collectives import broadcast_object
from hvdplus.common.elastic import ObjectState
from hvdplus.torch.elastic.sampler import ElasticSampler
from hvdplus.torch.elastic.snapshot import Snapshot
from hvdplus.torch.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState"]


class _Handler:
    """How one kind of tracked object is saved, restored, synced and reset."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def reset(self) -> None:
        """After a reset, before the sync."""


class _ModelHandler(_Handler):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.save()

    def save(self) -> None:
        if hasattr(self, "_snapshot"):
            self._snapshot.save(self.value.state_dict())
        else:
            self._snapshot = Snapshot(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._snapshot.tree)  # copies into the live parameters

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_ModelHandler):
    def restore(self) -> None:
        self.reset()
        self.value.load_state_dict(self._snapshot.fresh())  # the optimizer keeps these tensors: not our buffers

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)

    def reset(self) -> None:
        discard = getattr(self.value, "discard_pending", None)  # DistributedOptimizer: the old job's handles
        if discard is not None:
            discard()


class _SamplerHandler(_Handler):
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


def _handler(value: Any) -> _Handler | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        if getattr(value, "_zero", None) is not None:
            raise TypeError("TorchState cannot keep a ZeroOptimizer yet: its state is sharded over the ranks of one "
                            "generation of the job and is not resharded at an elastic reset. Use "
                            "hvd.DistributedOptimizer in elastic jobs.")
        return _OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return _SamplerHandler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch job: `model`, `optimizer`, and keyword attributes; modules, optimizers and
    ElasticSamplers among them are committed as tensors (preallocated host copies), the rest as Python objects."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers: dict[str, _Handler] = {}
        plain = {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is None:
                plain[name] = value
            else:
                self._handlers[name] = handler
                setattr(self, name, value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
