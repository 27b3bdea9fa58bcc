"""Buffer operations of the data plane, per device: host buffers are numpy arrays; an adapter registers its own
operations (and an engine) for device tensors, so the core moves CUDA tensors without importing a framework.

The executor packs, copies, scales and allocates only through a `BufferOps`, and every buffer of one engine call
comes from one `DataPlane`: the host plane (numpy buffers, the job's engine), or a device plane that an adapter
registered with `register_device_plane` (for torch: torch tensors on NCCL, or on Gloo for the CPU test path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hvdplus.common.data import halfops, nan
from hvdplus.common.ops import storage_dtype

__all__ = [
    "BufferOps",
    "NumpyBufferOps",
    "NUMPY_OPS",
    "DataPlane",
    "DeviceKind",
    "ReadyEvent",
    "SubmitEvent",
    "register_device_plane",
    "agreed_device_kinds",
]

log = logging.getLogger("hvdplus")


class ReadyEvent(Protocol):
    """Marks a point in a device's work queue (a CUDA event): `wait()` makes the caller's current stream wait
    for it, without blocking the host."""

    def wait(self) -> None: ...


class SubmitEvent(ReadyEvent, Protocol):
    """The event recorded when a device tensor is submitted, on the submitter's stream."""

    def used_here(self, buf: Any) -> None:
        """`buf` (the submitted tensor) is read on the waiting thread's stream: keep its memory until that is done."""

    def hand_back(self, buf: Any) -> None:
        """`buf` (a result) goes back to the submitter's stream: keep its memory until that stream is done with it."""


class BufferOps(Protocol):
    """What the executor does to buffers of one kind. Buffers are contiguous; `flat` views them as 1-D."""

    def numel(self, buf: Any) -> int:
        """The number of elements of `buf`."""

    def flat(self, buf: Any) -> Any:
        """A 1-D view of `buf` (no copy)."""

    def empty(self, shape: tuple[int, ...], like: Any) -> Any:
        """A new uninitialised buffer of `shape` with `like`'s storage type, on `like`'s device."""

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A new zero buffer of the logical `dtype` on this plane's device (a joined rank's contribution)."""

    def copy(self, dst: Any, src: Any) -> None:
        """dst[...] = src (same shape)."""

    def pack(self, sources: Sequence[Any], dst: Any) -> None:
        """Flat `sources` end to end into the flat `dst`, in one call where the framework has one."""

    def unpack(self, src: Any, destinations: Sequence[Any]) -> None:
        """The inverse of `pack`."""

    def scale(self, buf: Any, dtype: str, factor: float) -> None:
        """buf *= factor, rounded once to `dtype` (integers are scaled in float64 and truncated)."""

    def nan_positions(self, buf: Any, dtype: str) -> Any:
        """1 where `buf` holds a NaN, else 0, as a uint8 buffer (the Min/Max NaN rule, nan.py)."""

    def restore_nan(self, buf: Any, dtype: str, positions: Any) -> None:
        """Write NaN into `buf` wherever the reduced `positions` is non-zero."""

    def same_start(self, a: Any, b: Any) -> bool:
        """Whether `a` and `b` begin at the same address."""

    def overlaps(self, a: Any, b: Any) -> bool:
        """Whether `a` and `b` share memory."""

    def ready(self, buf: Any) -> SubmitEvent | None:
        """An event that fires once the work queued so far for `buf`'s device has run (None: host memory, where
        every write has happened by the time the call returns)."""


class NumpyBufferOps:
    """Host buffers: numpy arrays (bfloat16 as uint16 storage), with the registered half kernels for scaling."""

    def numel(self, buf: np.ndarray) -> int:
        return buf.size

    def flat(self, buf: np.ndarray) -> np.ndarray:
        return buf.reshape(-1)

    def empty(self, shape: tuple[int, ...], like: np.ndarray) -> np.ndarray:
        return np.empty(shape, dtype=like.dtype)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=storage_dtype(dtype))

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def pack(self, sources: Sequence[np.ndarray], dst: np.ndarray) -> None:
        np.concatenate(sources, out=dst)

    def unpack(self, src: np.ndarray, destinations: Sequence[np.ndarray]) -> None:
        offset = 0
        for dst in destinations:
            dst[...] = src[offset : offset + dst.size]
            offset += dst.size

    def scale(self, buf: np.ndarray, dtype: str, factor: float) -> None:
        halfops.scale_inplace(buf, dtype, factor)

    def nan_positions(self, buf: np.ndarray, dtype: str) -> np.ndarray:
        return nan.nan_positions(buf, dtype)

    def restore_nan(self, buf: np.ndarray, dtype: str, positions: np.ndarray) -> None:
        nan.restore_nan(buf, dtype, positions)

    def same_start(self, a: np.ndarray, b: np.ndarray) -> bool:
        return a.ctypes.data == b.ctypes.data

    def overlaps(self, a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.shares_memory(a, b))

    def ready(self, buf: np.ndarray) -> None:
        return None


NUMPY_OPS = NumpyBufferOps()


@dataclass
class DataPlane:
    """Where one kind of buffer is reduced: its engine (the data collectives of `engines.base.DataEngine`) and
    its buffer operations. `host`: the job's own engine, which also owns the groups of every process set."""

    name: str
    engine: Any
    ops: BufferOps
    host: bool


@dataclass
class DeviceKind:
    """A device kind an adapter can reduce on a plane of its own: its buffer operations, the plane's usual name
    (for messages; a built plane takes its engine's name), whether this process can use it (`available(settings)`,
    local and cheap), and how to build the plane's engine (`build_engine(host_engine, settings, topology)`,
    collective over all ranks)."""

    ops: BufferOps
    plane: str
    available: Callable[[Any], bool]
    build_engine: Callable[[Any, Any, Any], Any]

    def build(self, host_engine: Any, settings: Any, topology: Any) -> DataPlane:
        """The plane, named after its engine (the settings may pick the engine: NCCL or Gloo for CUDA tensors)."""
        engine = self.build_engine(host_engine, settings, topology)
        return DataPlane(engine.name, engine, self.ops, host=False)


_device_kinds: dict[str, DeviceKind] = {}


def register_device_plane(kind: str, entry: DeviceKind) -> None:
    """Let an adapter run collectives on buffers whose requests name device kind `kind` (`Request.device` up to
    the colon) on a plane of its own (the adapter stages such tensors through host memory where the job has none)."""
    _device_kinds[kind] = entry


def agreed_device_kinds(host_engine: Any, settings: Any) -> dict[str, DeviceKind]:
    """The registered device kinds available on every rank (collective: one small allgather). A kind some ranks
    lack is used by none, so that no rank waits for a peer that stages instead; rank 0 logs which ranks lack it."""
    kinds = list(_device_kinds)
    if not kinds:
        return {}
    mine = bytes(int(bool(_device_kinds[kind].available(settings))) for kind in kinds)
    everyone = host_engine.allgather_bytes(mine, host_engine.world)
    agreed = {}
    for index, kind in enumerate(kinds):
        lacking = [rank for rank, flags in enumerate(everyone) if not flags[index]]
        if not lacking:
            agreed[kind] = _device_kinds[kind]
        elif len(lacking) < len(everyone) and host_engine.rank == 0:
            log.warning(
                "%s tensors are staged through host memory on every rank: ranks %s cannot use the %s plane",
                kind,
                lacking,
                _device_kinds[kind].plane,
            )
    return agreed
