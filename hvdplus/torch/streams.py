"""Side streams and host staging for ZeRO, offload and pipelines on CUDA tensors, ordered against the compute
stream by events (as FSDP2 orders its all-gather and reduce-scatter streams). On CPU tensors (the CPU simulation of
the device plane, or a CPU job) every call runs in order where it is made and the events are None, so the same
code serves both.

Collectives need no stream of their own here: the core records an event on the submitter's current stream, the
device engine (NCCL) runs them on its own streams after that event, and `handle.wait()` makes the waiter's current
stream wait for them (common/handles.py). The side streams below carry the copies between device and host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hvdplus.torch.buffers import in_host_memory

__all__ = ["SideStream", "wait_for", "host_empty", "host_copy"]


class SideStream:
    """One CUDA stream beside the compute stream of `device` (None on a CPU device: work runs where it is)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def after_current(self) -> Iterator[None]:
        """Run the block's work on the side stream, after what the compute stream queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def reads(self, tensor: torch.Tensor) -> None:
        """`tensor`, made on the compute stream, is read on the side stream: the caching allocator keeps its
        memory until the side stream's work queued so far is done."""
        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(self.stream)

    def record(self) -> torch.cuda.Event | None:
        """An event after the work queued on the side stream so far (None on CPU: it is done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def wait_for(event: torch.cuda.Event | None, device: torch.device | None = None) -> None:
    """The current stream (of `device`) waits for `event` on the GPU, without blocking the host."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer that copies to and from `device` asynchronously: pinned when `device` is a GPU."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor (the tensor itself when it is in host memory already)."""
    if in_host_memory(tensor):
        return tensor
    host = host_empty(tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape)
    host.copy_(tensor)
    return host
