"""Adasum (Horovod's adaptive summation): pairwise combination by recursive doubling, per tensor.

Two vectors a and b combine as a' = (1 - dot/(2|a|^2)) a + (1 - dot/(2|b|^2)) b: orthogonal gradients add,
parallel ones average. Ranks pair up level by level with partner = rank ^ distance (distance 1, 2, 4, ...),
so on 4 ranks the result is combine(combine(g0, g1), combine(g2, g3)). Every tensor of a fused buffer
keeps its own dot product and norms. Dots and norms accumulate in float64; fp16 and bf16 are widened.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdplus.common.data import halfops
from hvdplus.common.engines.waited import Waited

__all__ = ["check_adasum_size", "partners", "combine", "adasum_allreduce", "adasum_tensors"]

# Horovod (ops/adasum/adasum.h) leaves a coefficient at 1 when the squared norm is below sqrt(DBL_MIN): a zero
# vector contributes nothing, while a tiny but nonzero one (fp32 or fp16 values near their smallest normal) still
# averages with a parallel partner; its float64 squared norm is far above this bound.
_TINY_NORM = sys.float_info.min**0.5


def check_adasum_size(set_size: int) -> None:
    """Raise ValueError unless the process set has a power-of-two number of ranks."""
    if set_size < 1 or set_size & (set_size - 1):
        raise ValueError(
            f"op=Adasum needs a power-of-two number of ranks in the process set, got {set_size}; "
            f"use op=Average, or run on 1, 2, 4, 8, ... ranks"
        )


def partners(rank: int, set_size: int) -> list[int]:
    """The ranks `rank` exchanges with, level by level (rank ^ 1, rank ^ 2, rank ^ 4, ...)."""
    check_adasum_size(set_size)
    return [rank ^ distance for distance in (1 << level for level in range(set_size.bit_length() - 1))]


def _widen(buf: np.ndarray, dtype: str) -> np.ndarray:
    return halfops.bfloat16_to_float32(buf).astype(np.float64) if dtype == "bfloat16" else buf.astype(np.float64)


def _narrow(values: np.ndarray, dtype: str, out: np.ndarray) -> None:
    if dtype == "bfloat16":
        halfops.float32_to_bfloat16(values.astype(np.float32), out=out)
    else:
        out[...] = values


def combine(a: np.ndarray, b: np.ndarray, counts: Sequence[int], dtype: str, out: np.ndarray) -> None:
    """Write the Adasum combination of flat buffers `a` and `b` into `out`, tensor by tensor.

    `counts` are the element counts of the tensors packed one after another in the buffers."""
    wide_a, wide_b = _widen(a, dtype), _widen(b, dtype)
    result = np.empty_like(wide_a)
    offset = 0
    for count in counts:
        x, y = wide_a[offset : offset + count], wide_b[offset : offset + count]
        dot, norm_a, norm_b = float(np.dot(x, y)), float(np.dot(x, x)), float(np.dot(y, y))
        coeff_a = 1.0 - dot / (2.0 * norm_a) if norm_a >= _TINY_NORM else 1.0
        coeff_b = 1.0 - dot / (2.0 * norm_b) if norm_b >= _TINY_NORM else 1.0
        np.add(coeff_a * x, coeff_b * y, out=result[offset : offset + count])
        offset += count
    _narrow(result, dtype, out)


def adasum_allreduce(
    engine: Waited, group: Any, set_rank: int, set_size: int, buffer: np.ndarray, counts: Sequence[int], dtype: str
) -> None:
    """Replace `buffer` (tensors of `counts` elements, packed) by the Adasum of every rank's buffer.

    Collective: every rank of `group` calls this with buffers of the same layout. The lower rank of each
    pair is always `a`, so both partners compute bit-identical results."""
    received = np.empty_like(buffer)
    for peer in partners(set_rank, set_size):
        engine.sendrecv(buffer, received, peer, group)
        first, second = (buffer, received) if set_rank < peer else (received, buffer)
        combine(first, second, counts, dtype, out=buffer)


def adasum_tensors(
    engine: Waited,
    group: Any,
    set_rank: int,
    set_size: int,
    inputs: Sequence[np.ndarray],
    outputs: Sequence[np.ndarray],
    dtype: str,
    prescale: float,
    postscale: float,
) -> None:
    """Adasum of several tensors in one exchange per level: pack, scale, reduce, scale, unpack into `outputs`."""
    counts = [array.size for array in inputs]
    buffer = np.concatenate([array.reshape(-1) for array in inputs])
    halfops.scale_inplace(buffer, dtype, prescale)
    adasum_allreduce(engine, group, set_rank, set_size, buffer, counts, dtype)
    halfops.scale_inplace(buffer, dtype, postscale)
    offset = 0
    for output, count in zip(outputs, counts):
        output.reshape(-1)[...] = buffer[offset : offset + count]
        offset += count
