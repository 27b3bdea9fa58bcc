"""`hvd.Compression` for PyTorch tensors (none, fp16, and bf16 beyond Horovod)."""

from __future__ import annotations

import torch

from hvdplus.common.compression import Compressor, make_compression

__all__ = ["Compression", "Compressor"]

Compression = make_compression(
    torch.float16, torch.bfloat16, lambda t: t.is_floating_point(), lambda t: t.dtype, lambda t, dtype: t.to(dtype)
)
"""Gradient compression for the wire: `Compression.none`, `Compression.fp16` (float16) and `Compression.bf16`
(bfloat16). Floating tensors are cast before the collective and back after it; other dtypes pass unchanged."""
