"""horovod.torch's sparse allreduce: allgather every rank's indices and values, then coalesce."""

from __future__ import annotations

from typing import Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.handles import Completion
from hvdplus.common.ops import ReduceOp
from hvdplus.torch.buffers import collective_input, collective_result, dtype_name
from hvdplus.torch.mpi_ops import synchronize

__all__ = ["sparse_allreduce_async"]


class SparseHandle(Completion[torch.Tensor]):
    """A handle for `hvd.synchronize`, also callable as Horovod's sparse handle is (`handle()`)."""

    __slots__ = ()

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None, op: ReduceOp, process_set: ProcessSet = global_process_set
) -> SparseHandle:
    """Start reducing a sparse COO tensor: allgather of indices and values, coalesced (duplicates summed).

    Average divides the values by the process set's size; only Average and Sum are defined for sparse
    tensors. `synchronize(handle)` (or `handle()`) returns the coalesced sparse sum (or average).
    Collective: every rank in the process set must call this, in the same order."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError(
            f"sparse_allreduce_async expects a sparse COO tensor, got "
            f"{tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
        )
    op = core.resolve_op(None, op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"sparse allreduce supports op=Average and op=Sum, got {op!r}")
    # Allgather concatenates along dimension 0, so indices travel transposed: one row per non-zero.
    indices, values = tensor._indices().t().contiguous(), tensor._values().contiguous()
    names = (None, None) if name is None else (f"{name}.indices", f"{name}.values")
    handles = []
    for part, part_name in zip((indices, values), names):
        buffer, label = collective_input(part)
        handles.append(core.submit_allgather(buffer, dtype_name(part), part_name, process_set, label))

    def finish(results: list[Any]) -> torch.Tensor:
        all_indices, all_values = collective_result(results[0], indices).t(), collective_result(results[1], values)
        if op == ReduceOp.AVERAGE:
            all_values = all_values / process_set.size()
        summed = torch.sparse_coo_tensor(all_indices, all_values, tensor.shape, check_invariants=True).coalesce()
        return summed.to(tensor.device)

    return SparseHandle(handles, finish)
