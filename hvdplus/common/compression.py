"""Gradient compression as a codec at the edge: cast down before the collective, back after.

The core moves whatever dtype it is given; each adapter supplies how to cast its tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

__all__ = ["Compressor", "NoneCompressor", "CastCompressor", "CompressionNamespace", "make_compression"]


class Compressor(Protocol):
    """Horovod's compressor interface."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and the context `decompress` needs."""

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Undo `compress` on the received tensor."""


class NoneCompressor:
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class CastCompressor:
    """Send floating-point tensors in a narrower dtype (fp16 or bf16); leave others untouched."""

    def __init__(
        self,
        wire_dtype: Any,
        is_floating: Callable[[Any], bool],
        dtype_of: Callable[[Any], Any],
        cast: Callable[[Any, Any], Any],
    ) -> None:
        self._wire, self._is_floating, self._dtype_of, self._cast = wire_dtype, is_floating, dtype_of, cast

    @property
    def wire_dtype(self) -> Any:
        """The dtype floating-point tensors travel in."""
        return self._wire

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        if not self._is_floating(tensor):
            return tensor, None
        original = self._dtype_of(tensor)
        return (self._cast(tensor, self._wire) if original != self._wire else tensor), original

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None or ctx == self._dtype_of(tensor) else self._cast(tensor, ctx)


class CompressionNamespace:
    """What an adapter's `Compression` holds: the compressors, as class attributes."""

    none: ClassVar[type[NoneCompressor]]
    fp16: ClassVar[CastCompressor]
    bf16: ClassVar[CastCompressor]


def make_compression(
    float16: Any,
    bfloat16: Any,
    is_floating: Callable[[Any], bool],
    dtype_of: Callable[[Any], Any],
    cast: Callable[[Any, Any], Any],
) -> type[CompressionNamespace]:
    """Build an adapter's `Compression` namespace (none, fp16, bf16) from its dtype and cast functions."""

    half = CastCompressor(float16, is_floating, dtype_of, cast)
    brain = CastCompressor(bfloat16, is_floating, dtype_of, cast)

    class Compression(CompressionNamespace):
        """Optional gradient compression used by allreduce and DistributedOptimizer."""

        none = NoneCompressor
        fp16 = half
        bf16 = brain

    return Compression
