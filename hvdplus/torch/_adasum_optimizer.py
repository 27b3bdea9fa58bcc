"""DistributedOptimizer with op=Adasum: Horovod's delta optimizer.

When p's gradient is ready, the wrapped optimizer steps p alone on this rank's gradient; the change of p
(the delta) is Adasum-reduced across ranks, and step() sets p = start + Adasum(deltas). Nothing is averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from hvdplus.common.ops import Adasum
from hvdplus.torch._optimizer import _DistributedOptimizer
from hvdplus.torch.mpi_ops import allreduce_async_

__all__: list[str] = []


class _DistributedAdasumOptimizer(_DistributedOptimizer):
    """Methods that replace _DistributedOptimizer's in the dynamic class when op=Adasum; never instantiated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _DistributedOptimizer.__init__(self, *args, **kwargs)
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for p in self._requires_update}

    def _allreduce_grad_async(self, p: torch.Tensor) -> tuple[Any, Any]:
        """Step p alone with the local gradient, turn p into its delta and start the delta's Adasum."""
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [q for q in group["params"] if q is p]
        try:
            with torch.no_grad():
                start.copy_(p)
                self._base_step()
                p.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        return allreduce_async_(compressed, name=self._parameter_names[p], op=Adasum, process_set=self.process_set), ctx

    def synchronize(self) -> None:
        """Nothing to do before step(): with Adasum, step() completes the reductions and applies them."""

    def skip_synchronize(self) -> NoReturn:
        """Not available with Adasum: step() itself finishes the reductions and applies them."""
        raise RuntimeError(
            "Skipping synchronization is not supported when using Adasum optimizer; "
            "call optimizer.step() without optimizer.skip_synchronize()"
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish every delta's Adasum (starting those whose hook did not fire) and apply it."""
        loss = closure() if closure is not None else None
        try:
            for p in self._requires_update:
                if self._handles.get(p, (None, None))[0] is None:
                    self._handles[p] = self._allreduce_grad_async(p)
            for p, (handle, ctx) in self._handles.items():
                start = self._starting_models[p]
                start.add_(self._compression.decompress(handle.wait(), ctx))
                with torch.no_grad():
                    p.copy_(start)
        finally:
            self._handles.clear()
            for p in self._allreduce_delay:
                self._allreduce_delay[p] = self.backward_passes_per_step
        return loss
