"""One NaN rule for Min and Max on every engine: IEEE-propagating, as torch.maximum and numpy.maximum are.

MPI's MAX drops a NaN and Gloo's keeps it only when it comes first, so the result depended on the engine and
the rank order. The executor sends each rank's NaN positions with a second, byte-sized Max and writes NaN
wherever any rank had one (Min and Max of floating types only; the cost is a quarter of a float32 reduction).
"""

from __future__ import annotations

import numpy as np

from hvdplus.common.ops import ReduceOp

__all__ = ["nan_positions", "restore_nan", "propagates_nan"]

_BFLOAT16_NAN = np.uint16(0x7FC0)


def propagates_nan(dtype: str, op: ReduceOp) -> bool:
    """Whether a reduction of `dtype` with `op` needs the NaN pass."""
    return op in (ReduceOp.MIN, ReduceOp.MAX) and dtype in ("float16", "bfloat16", "float32", "float64")


def nan_positions(array: np.ndarray, dtype: str) -> np.ndarray:
    """1 where `array` (flat storage of `dtype`) holds a NaN, else 0, as uint8."""
    if dtype == "bfloat16":  # uint16 storage: exponent all ones and a non-zero mantissa
        return ((array & 0x7FFF) > 0x7F80).view(np.uint8)
    nans: np.ndarray = np.isnan(array)
    return nans.view(np.uint8)


def restore_nan(array: np.ndarray, dtype: str, positions: np.ndarray) -> None:
    """Write NaN into `array` wherever `positions` (reduced across ranks) is non-zero."""
    mask = positions.view(bool)
    if mask.any():
        array[mask] = _BFLOAT16_NAN if dtype == "bfloat16" else np.nan
