"""Reduction operators, collective kinds and the dtypes the core can move and reduce."""

from __future__ import annotations

import enum

import numpy as np

__all__ = [
    "ReduceOp",
    "OpKind",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "DTYPES",
    "REDUCIBLE_DTYPES",
    "storage_dtype",
    "check_reducible",
    "reducescatter_grad_scale",
]


class ReduceOp(enum.IntEnum):
    """How allreduce and reducescatter combine values (Horovod's numbering)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
"""Sum over the ranks divided by their number (the default for allreduce and DistributedOptimizer)."""
Sum = ReduceOp.SUM
"""Elementwise sum over the ranks."""
Adasum = ReduceOp.ADASUM
"""Horovod's Adasum: a pairwise combination that keeps the step size of each rank's update (power-of-two sets)."""
Min = ReduceOp.MIN
"""Elementwise minimum over the ranks."""
Max = ReduceOp.MAX
"""Elementwise maximum over the ranks."""
Product = ReduceOp.PRODUCT
"""Elementwise product over the ranks."""


class OpKind(enum.IntEnum):
    """The collective a request asks for."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8
    OPEN_CHANNEL = 9


# Logical dtype name -> numpy dtype used to hold the bytes in host memory.
DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "uint16": np.dtype(np.uint16),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bool": np.dtype(np.bool_),
}

REDUCIBLE_DTYPES = frozenset(DTYPES) - {"bool"}


def storage_dtype(dtype: str) -> np.dtype:
    """Return the numpy dtype that stores `dtype`, or raise TypeError naming the supported ones."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype!r} is not supported by hvdplus collectives; supported: {', '.join(DTYPES)}"
        ) from None


def check_reducible(dtype: str, op: ReduceOp, what: str) -> None:
    """Raise TypeError when `op` cannot reduce values of `dtype`."""
    storage_dtype(dtype)
    if dtype not in REDUCIBLE_DTYPES:
        raise TypeError(
            f"{what} cannot reduce dtype {dtype!r}; convert the tensor to a numeric dtype (e.g. uint8) first"
        )
    if op == ReduceOp.ADASUM and dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"{what}: Adasum needs a floating-point tensor, got dtype {dtype!r}")


def reducescatter_grad_scale(op: ReduceOp, prescale: float, postscale: float, set_size: int) -> float:
    """Horovod's factor for the gradient of reducescatter (then allgathered): the set's size for Sum, 1 for
    Average, times both scale factors. That is `size` times the exact gradient of the ranks' summed loss;
    scripts written for Horovod rely on it, so it is kept. Min, Max and Product: NotImplementedError."""
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"the gradient of reducescatter is defined for Average and Sum, not {op!r}")
    return prescale * postscale * (set_size if op == ReduceOp.SUM else 1)
