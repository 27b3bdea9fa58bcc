"""The torch device plane: collectives on CUDA tensors run on NCCL with no trip through host memory.

`TorchBufferOps` gives the core's executor torch's kernels for packing, scaling and allocation on the tensors'
own device, and `engines/nccl.py` reduces them. With HVDPLUS_DEVICE_PATH_ON_CPU=1 the same plane takes CPU
tensors over Gloo: the GPU code path, tested on machines without one.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hvdplus.common.buffer_ops import DataPlane, register_device_plane
from hvdplus.common.engines.base import Engine
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology

__all__ = ["TorchBufferOps", "StreamEvent", "CPU_TEST_KIND", "register"]

# The device kind of CPU tensors sent through the device plane (HVDPLUS_DEVICE_PATH_ON_CPU=1).
CPU_TEST_KIND = "torchcpu"

_STORAGE = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
            "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64, "bool": torch.bool}


class TorchBufferOps:
    """Buffers are contiguous torch tensors on one device; each call runs on the current stream."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self.device: torch.device | None = None  # the last device a tensor came from (joined ranks' zeros)

    def numel(self, buf: torch.Tensor) -> int:
        return buf.numel()

    def flat(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(-1)

    def empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        device = self.device or torch.device(self._device_type)
        return torch.zeros(shape, dtype=_STORAGE[dtype], device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def pack(self, sources: Sequence[torch.Tensor], dst: torch.Tensor) -> None:
        torch.cat(list(sources), out=dst)

    def unpack(self, src: torch.Tensor, destinations: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(destinations), list(src.split([d.numel() for d in destinations])))

    def scale(self, buf: torch.Tensor, dtype: str, factor: float) -> None:
        if factor == 1.0:
            return
        if buf.is_floating_point():
            buf.mul_(factor)
        else:  # integers: scaled in float64 and truncated, as on the host
            buf.copy_((buf.to(torch.float64) * factor).to(buf.dtype))

    def nan_positions(self, buf: torch.Tensor, dtype: str) -> torch.Tensor:
        return torch.isnan(buf).to(torch.uint8)

    def restore_nan(self, buf: torch.Tensor, dtype: str, positions: torch.Tensor) -> None:
        buf.masked_fill_(positions.view(buf.shape).bool(), float("nan"))

    def same_start(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.data_ptr() == b.data_ptr()

    def overlaps(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        a_end = a.data_ptr() + a.numel() * a.element_size()
        b_end = b.data_ptr() + b.numel() * b.element_size()
        return a.data_ptr() < b_end and b.data_ptr() < a_end

    def ready(self, buf: torch.Tensor) -> "StreamEvent | None":
        """An event on the current stream of `buf`'s device (None for CPU tensors: their writes are done)."""
        self.device = buf.device
        return StreamEvent(buf.device) if buf.device.type == "cuda" else None


class StreamEvent:
    """A CUDA event recorded on the calling thread's current stream of one device; `wait()` makes the calling
    thread's current stream of that same device wait for it (the background thread's current device may be
    another one: torch.cuda.Event.wait would pick that)."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: torch.device) -> None:
        self._device, self._event = device, torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


def _engine(host: Engine, backend: str, settings: Settings, topology: Topology) -> Any:
    from hvdplus.common.engines.nccl import TorchTensorEngine

    # Rank 0 serves the rendezvous (when torch.distributed has none yet) on the launcher's address, or on
    # loopback when the whole job is on its host.
    address = settings.launch.rendezvous_addr or ("127.0.0.1" if topology.cross_size == 1 else _host_address())
    return TorchTensorEngine(host, backend, settings.timeout_seconds, address)


def _host_address() -> str:
    import socket

    return socket.gethostbyname(socket.gethostname())


def _cuda_plane(host: Engine, settings: Settings, topology: Topology) -> DataPlane | None:
    """NCCL for CUDA tensors, where torch has NCCL and this host a GPU (HOROVOD_GPU_OPERATIONS=mpi: none)."""
    import torch.distributed as dist

    if settings.gpu_operations != "nccl" or not (dist.is_available() and dist.is_nccl_available()) \
            or not torch.cuda.is_available():
        return None
    return DataPlane("nccl", _engine(host, "nccl", settings, topology), TorchBufferOps("cuda"), host=False)


def _cpu_test_plane(host: Engine, settings: Settings, topology: Topology) -> DataPlane | None:
    """Gloo on CPU torch tensors through the device plane's code (HVDPLUS_DEVICE_PATH_ON_CPU=1)."""
    if not settings.device_path_on_cpu:
        return None
    return DataPlane("torchgloo", _engine(host, "gloo", settings, topology), TorchBufferOps("cpu"), host=False)


def register() -> None:
    """Offer the torch planes to the core; idempotent."""
    register_device_plane("cuda", _cuda_plane)
    register_device_plane(CPU_TEST_KIND, _cpu_test_plane)
