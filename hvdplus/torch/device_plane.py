"""The torch device plane: collectives on CUDA tensors run on NCCL with no trip through host memory.

`TorchBufferOps` gives the core's executor torch's kernels for packing, scaling and allocation on the tensors'
own device, and `engines/nccl.py` reduces them (HOROVOD_GPU_OPERATIONS=gloo: Gloo on the GPU's tensors, for ranks
that share a GPU). With HVDPLUS_DEVICE_PATH_ON_CPU=1 the same plane takes CPU
tensors over Gloo: the GPU code path, tested on machines without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvdplus.common.data.buffer_ops import DeviceKind, register_device_plane
from hvdplus.common.engines.base import Engine
from hvdplus.common.settings import Settings
from hvdplus.common.topology import Topology

__all__ = ["TorchBufferOps", "StreamEvent", "CPU_TEST_KIND", "register", "scale_in_place"]

# The device kind of CPU tensors sent through the device plane (HVDPLUS_DEVICE_PATH_ON_CPU=1).
CPU_TEST_KIND = "torchcpu"

_STORAGE = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}


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
        """On the device this rank's tensors came from; before any came, Horovod's rule: GPU local_rank."""
        device = self.device
        if device is None and self._device_type == "cuda":
            from hvdplus.common.basics import local_rank

            # (ranks sharing GPUs over Gloo: local_rank modulo the GPUs there are)
            device = torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
        return torch.zeros(shape, dtype=_STORAGE[dtype], device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def pack(self, sources: Sequence[torch.Tensor], dst: torch.Tensor) -> None:
        torch.cat(list(sources), out=dst)

    def unpack(self, src: torch.Tensor, destinations: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(destinations), list(src.split([d.numel() for d in destinations])))

    def scale(self, buf: torch.Tensor, dtype: str, factor: float) -> None:
        scale_in_place(buf, factor)

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

    def ready(self, buf: torch.Tensor) -> StreamEvent | None:
        """An event on the current stream of `buf`'s device (None for CPU tensors: their writes are done)."""
        self.device = buf.device
        return StreamEvent(buf.device) if buf.device.type == "cuda" else None


def scale_in_place(tensor: torch.Tensor, factor: float) -> None:
    """Scale as the core scales a reduced buffer: in its own dtype; integers in float64, truncated (as on the
    host)."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.to(torch.float64) * factor).to(tensor.dtype))


class StreamEvent:
    """A CUDA event recorded on the calling thread's current stream of one device; `wait()` makes the calling
    thread's current stream of that same device wait for it (the background thread's current device may be
    another one: torch.cuda.Event.wait would pick that)."""

    __slots__ = ("_device", "_event", "_stream")

    def __init__(self, device: torch.device) -> None:
        self._device, self._event = device, torch.cuda.Event()
        self._stream = torch.cuda.current_stream(device)
        self._event.record(self._stream)

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def used_here(self, buf: torch.Tensor) -> None:
        """The caching allocator keeps `buf`'s block until the waiting thread's stream is past this point."""
        stream = torch.cuda.current_stream(self._device)
        if stream != self._stream and buf.is_cuda:
            buf.record_stream(stream)

    def hand_back(self, buf: torch.Tensor) -> None:
        """A result made on the background thread's stream, used next on the submitter's."""
        if torch.cuda.current_stream(self._device) != self._stream and buf.is_cuda:
            buf.record_stream(self._stream)


def _engine(choose: Callable[[Settings], tuple[str, str]]) -> Any:
    """A builder of the plane's engine on the (backend, plane name) `choose` picks. Rank 0 serves its rendezvous
    (when torch.distributed has none yet) under its host name (as init gathered it, HOROVOD_HOSTNAME included),
    which the other hosts resolve as they resolve it for ssh and MPI; on loopback when the whole job is on its host."""

    def build(host: Engine, settings: Settings, topology: Topology) -> Any:
        from hvdplus.common.engines.nccl import TorchTensorEngine

        backend, name = choose(settings)
        address = "127.0.0.1" if topology.cross_size == 1 else topology.hostnames[topology.rank]
        return TorchTensorEngine(host, backend, settings.timeout_seconds, address, name)

    return build


def _cuda_backend(settings: Settings) -> tuple[str, str]:
    """NCCL, or Gloo on CUDA tensors (HOROVOD_GPU_OPERATIONS=gloo: ranks sharing a GPU) as plane 'cudagloo'."""
    return ("gloo", "cudagloo") if settings.gpu_operations == "gloo" else ("nccl", "nccl")


def _cuda_available(settings: Settings) -> bool:
    """Whether this process reduces CUDA tensors on the GPU: it has one, and torch the backend
    (HOROVOD_GPU_OPERATIONS=mpi: neither; they are staged through host memory)."""
    import torch.distributed as dist

    if settings.gpu_operations == "mpi" or not (dist.is_available() and torch.cuda.is_available()):
        return False
    return settings.gpu_operations == "gloo" or dist.is_nccl_available()


def register() -> None:
    """Offer the torch device kinds to the core; idempotent. CUDA tensors: NCCL (or Gloo). CPU tensors, with
    HVDPLUS_DEVICE_PATH_ON_CPU=1 only: Gloo through the same code."""
    register_device_plane("cuda", DeviceKind(TorchBufferOps("cuda"), "nccl", _cuda_available, _engine(_cuda_backend)))
    register_device_plane(
        CPU_TEST_KIND,
        DeviceKind(
            TorchBufferOps("cpu"),
            "torchgloo",
            lambda settings: settings.device_path_on_cpu,
            _engine(lambda settings: ("gloo", "torchgloo")),
        ),
    )
