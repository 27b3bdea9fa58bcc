"""How a Pipeline cuts its model into chunks (by parameter count, measured time or given layer counts) and a batch
into micro-batches: the arithmetic of construction and of a step's inputs, apart from running the schedule."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.plans.pipeline_schedules import balanced_split, check_sizes

__all__ = ["as_tuple", "chunk_sizes", "layer_costs", "split_batch"]


def as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    """A module's input or output as a tuple of tensors (one tensor becomes a tuple of one)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def split_batch(value: Any, micro_batches: int, what: str) -> list[Any]:
    """Cut a tensor (or each tensor of a tuple) into `micro_batches` parts along its first dimension."""
    tensors = as_tuple(value)
    rows = {int(t.shape[0]) for t in tensors}
    if len(rows) != 1:
        raise ValueError(f"the tensors of {what} have different batch sizes {sorted(rows)}")
    if rows.pop() < micro_batches:
        raise ValueError(f"{what} has {tensors[0].shape[0]} rows, fewer than micro_batches={micro_batches}")
    parts = [torch.tensor_split(t, micro_batches) for t in tensors]
    return [
        tuple(p[m] for p in parts) if isinstance(value, (tuple, list)) else parts[0][m] for m in range(micro_batches)
    ]


def layer_costs(layers: Sequence[torch.nn.Module], sample: Any, repeats: int = 3) -> list[float]:
    """Each layer's median forward+backward time on `sample` (fed through the layers before it)."""
    costs = []
    x = sample
    for layer in layers:
        times = []
        for _ in range(repeats):
            inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in as_tuple(x))
            started = time.perf_counter()
            out = layer(inputs if isinstance(x, tuple) else inputs[0])
            roots = [o for o in as_tuple(out) if o.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
            times.append(time.perf_counter() - started)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        with torch.no_grad():
            x = layer(x)
    return costs


def chunk_sizes(layers: list, chunks: int, balance: str | Sequence[int], sample_input: Any) -> list[int]:
    """How many layers each chunk gets: `balance` layer counts as given, or balanced by parameter count, or by
    time measured on `sample_input` (averaged over the ranks: collective over the job)."""
    if not isinstance(balance, str):
        check_sizes(list(balance), len(layers), chunks)
        return list(balance)
    if balance == "parameters":
        return balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], chunks)
    if balance == "time":
        if sample_input is None:
            raise ValueError("balance='time' measures each layer on a sample batch: pass sample_input=")
        measured = core.allgather_object(layer_costs(layers, sample_input), name="Pipeline.layer_costs")
        return balanced_split([sum(costs) / len(measured) for costs in zip(*measured)], chunks)
    raise ValueError(f"balance must be 'parameters', 'time' or a list of layer counts, got {balance!r}")
