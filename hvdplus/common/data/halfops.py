"""bfloat16 arithmetic on uint16 storage, for engines and scaling code that only know numpy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hvdplus.common.ops import ReduceOp

__all__ = [
    "bfloat16_to_float32",
    "float32_to_bfloat16",
    "bfloat16_reducer",
    "half_reducer",
    "scale_inplace",
    "register_half_kernels",
    "has_fast_kernels",
    "combine_into",
]

HALF_DTYPES = ("float16", "bfloat16")
# Fast float16/bfloat16 arithmetic supplied by an adapter (numpy's float16 add is ~70x slower than torch's).
_fast_combine: dict[tuple[str, ReduceOp], Callable[[np.ndarray, np.ndarray], None]] = {}
_fast_scale: dict[str, Callable[[np.ndarray, float], None]] = {}

_COMBINE: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values held as uint16 to float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bfloat16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even; NaN stays NaN) as uint16 bits."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    if out is None:
        return rounded
    out[...] = rounded
    return out


def register_half_kernels(
    dtype: str,
    combine: dict[ReduceOp, Callable[[np.ndarray, np.ndarray], None]],
    scale: Callable[[np.ndarray, float], None],
) -> None:
    """Let an adapter supply fast in-place kernels on storage arrays: `combine[op](incoming, inout)` and
    `scale(buf, factor)`. Both must round once to `dtype`, as the numpy fallbacks do."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half kernels are for {HALF_DTYPES}, not {dtype!r}")
    for op, kernel in combine.items():
        _fast_combine[(dtype, op)] = kernel
    _fast_scale[dtype] = scale


def has_fast_kernels(dtype: str, op: ReduceOp) -> bool:
    return (dtype, op) in _fast_combine


def half_reducer(dtype: str, op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    """An mpi4py user-op body reducing float16/bfloat16 buffers: the registered kernel, else (bfloat16
    only) numpy through float32."""
    fast = _fast_combine.get((dtype, op))
    if fast is None:
        if dtype != "bfloat16":
            raise ValueError(f"no {dtype} kernel for {op.name} is registered; MPI reduces {dtype} itself")
        return bfloat16_reducer(op)
    storage = np.uint16 if dtype == "bfloat16" else np.float16

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        fast(np.frombuffer(inbuf, dtype=storage), np.frombuffer(inoutbuf, dtype=storage))

    return reduce


def bfloat16_reducer(op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    """An mpi4py user-op body that reduces bfloat16 buffers through float32."""

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        _bfloat16_combine(op, np.frombuffer(inbuf, dtype=np.uint16), np.frombuffer(inoutbuf, dtype=np.uint16))

    return reduce


def _bfloat16_combine(op: ReduceOp, incoming: np.ndarray, inout: np.ndarray) -> None:
    float32_to_bfloat16(_COMBINE[op](bfloat16_to_float32(incoming), bfloat16_to_float32(inout)), out=inout)


def combine_into(dtype: str, op: ReduceOp, incoming: np.ndarray, inout: np.ndarray) -> None:
    """inout = op(incoming, inout) elementwise on storage arrays: the registered half kernel, bfloat16 through
    float32, or numpy's own ufunc (for Python-driven reductions such as the hierarchical cross-host step)."""
    fast = _fast_combine.get((dtype, op))
    if fast is not None:
        fast(incoming, inout)
    elif dtype == "bfloat16":
        _bfloat16_combine(op, incoming, inout)
    else:
        _COMBINE[op](incoming, inout, out=inout)


def scale_inplace(buf: np.ndarray, dtype: str, factor: float) -> None:
    """Multiply a host buffer by `factor` in place (integers are scaled in float64 and truncated)."""
    if factor == 1.0:
        return
    fast = _fast_scale.get(dtype)
    if fast is not None:
        fast(buf, factor)
    elif dtype == "bfloat16":
        float32_to_bfloat16(bfloat16_to_float32(buf) * np.float32(factor), out=buf)
    elif buf.dtype == np.float16:  # scale in float32 so the factor itself cannot overflow or lose bits
        buf[...] = buf.astype(np.float32) * np.float32(factor)
    elif buf.dtype.kind == "f":
        np.multiply(buf, buf.dtype.type(factor), out=buf)
    else:
        buf[...] = (buf.astype(np.float64) * factor).astype(buf.dtype)
