"""`hvd.Compression` for PyTorch tensors (none, fp16, and bf16 beyond Horovod)."""

from __future__ import annotations

import torch

from hvdplus.common.compression import Compressor, make_compression

__all__ = ["Compression", "Compressor"]

Compression = make_compression(
    torch.float16, torch.bfloat16, lambda t: t.is_floating_point(), lambda t: t.dtype, lambda t, dtype: t.to(dtype)
)
