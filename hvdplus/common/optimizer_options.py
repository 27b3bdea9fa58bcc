"""Checks and derived values for DistributedOptimizer arguments that every adapter shares."""

from __future__ import annotations

import warnings
from typing import Any

from hvdplus.common.ops import ReduceOp

__all__ = ["check_passes", "check_compression", "check_predivide", "predivide_scales", "merge_num_groups"]


def check_passes(passes: Any) -> None:
    """backward_passes_per_step must be a positive integer."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")


def check_compression(compression: Any) -> None:
    """compression must have Horovod's compress/decompress interface."""
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must be a Compressor such as hvd.Compression.fp16, got {compression!r}")


def check_predivide(factor: float, op: ReduceOp) -> None:
    """gradient_predivide_factor only makes sense with op=Average (Horovod's rule)."""
    if factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


def predivide_scales(factor: float, op: ReduceOp) -> tuple[float, float]:
    """(prescale, postscale) for gradient_predivide_factor f: divide by f before the sum and by size/f after
    (the core's Average divides by size, so the postscale is f)."""
    predivide = factor if op == ReduceOp.AVERAGE else 1.0
    return 1.0 / predivide, predivide


def merge_num_groups(num_groups: int, groups: int | list[Any] | None) -> int | list[Any] | None:
    """Horovod's deprecated `num_groups` becomes `groups` (with its deprecation warning)."""
    if num_groups == 0:
        return groups
    warnings.warn(
        "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
        DeprecationWarning,
        stacklevel=3,
    )
    return num_groups if groups is None else groups
