"""torch's float16/bfloat16 arithmetic for the core's reductions and scaling (numpy's is ~70x slower)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hvdplus.common.data.halfops import register_half_kernels
from hvdplus.common.ops import ReduceOp

_COMBINE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.PRODUCT: torch.mul,
}


def _view(storage: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The storage array (float16, or bfloat16 bits as uint16) as a torch tensor of `dtype`, no copy."""
    return torch.from_numpy(storage).view(dtype)


def _combiner(function: Callable[..., torch.Tensor], dtype: torch.dtype) -> Callable[[np.ndarray, np.ndarray], None]:
    def combine(incoming: np.ndarray, inout: np.ndarray) -> None:
        target = _view(inout, dtype)
        function(target, _view(incoming, dtype), out=target)

    return combine


def _scaler(dtype: torch.dtype) -> Callable[[np.ndarray, float], None]:
    def scale(buf: np.ndarray, factor: float) -> None:
        _view(buf.reshape(-1), dtype).mul_(factor)

    return scale


def register() -> None:
    """Hand torch's kernels to the core; idempotent."""
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        register_half_kernels(name, {op: _combiner(fn, dtype) for op, fn in _COMBINE.items()}, _scaler(dtype))
