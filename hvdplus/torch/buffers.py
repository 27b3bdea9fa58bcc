"""Torch tensors as the buffers the core moves: the one tensor-to-buffer layer every torch feature uses.

A tensor travels one of two ways. On a device plane (CUDA tensors on NCCL, or CPU tensors under
HVDPLUS_DEVICE_PATH_ON_CPU=1) the core takes the tensor itself, and its result is a tensor on the same device.
Otherwise it takes a zero-copy numpy view of a contiguous host tensor (CUDA tensors without a plane are staged
through host copies, and so are CPU tensors under HVDPLUS_STAGED_PATH_ON_CPU=1), and its result is turned back
into a tensor on the input's device, or copied back into it (`copy_back`). The collectives (mpi_ops), the
reducer, the planned steps, ZeRO 1-3 and the pipeline all convert here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hvdplus.common.basics import runtime
from hvdplus.torch.device_plane import CPU_TEST_KIND

__all__ = [
    "DTYPE_NAMES",
    "dtype_name",
    "host_tensor",
    "in_host_memory",
    "copy_back",
    "plane_kind",
    "device_label",
    "as_numpy",
    "planned_buffer_of",
    "from_numpy",
    "collective_input",
    "collective_result",
    "collective_buffers",
    "one_device",
]

# The torch dtypes the core moves, by the core's dtype names.
DTYPE_NAMES = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
}

_CPU = torch.device("cpu")


def dtype_name(tensor: torch.Tensor) -> str:
    """The core's name of `tensor`'s dtype; TypeError naming the supported ones for any other."""
    try:
        return DTYPE_NAMES[tensor.dtype]
    except KeyError:
        raise TypeError(
            f"hvdplus collectives do not support {tensor.dtype}; supported: {', '.join(str(d) for d in DTYPE_NAMES)}"
        ) from None


def in_host_memory(tensor: torch.Tensor) -> bool:
    """Whether the host engine may take `tensor`'s own memory: a CPU tensor, except under
    HVDPLUS_STAGED_PATH_ON_CPU=1, where CPU tensors stand for device tensors that no plane takes and travel
    through host copies, as CUDA tensors do under HOROVOD_GPU_OPERATIONS=mpi."""
    return tensor.is_cpu and not runtime().settings.staged_path_on_cpu


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same values (the tensor itself when it already is one in host memory)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_cpu and tensor.is_contiguous():  # the common case, with no dispatcher calls (device.type: 6x)
        if not runtime().settings.staged_path_on_cpu:
            return tensor.detach() if tensor.requires_grad else tensor
        return tensor.detach().clone()  # a host copy, as a device tensor's
    return tensor.detach().cpu().contiguous()


def plane_kind(tensor: torch.Tensor) -> str | None:
    """The device kind under which `tensor` travels on one of the job's device planes; None: host memory."""
    kinds = runtime().coordinator.device_kinds
    if not kinds:  # the common case on CPU jobs: no device plane at all
        return None
    kind = CPU_TEST_KIND if tensor.is_cpu else tensor.device.type
    return kind if kind in kinds else None


def device_label(tensor: torch.Tensor, kind: str | None) -> str:
    """The device a request names: 'cpu', 'cuda:N' (on NCCL or staged), or the CPU test plane's kind."""
    if tensor.is_cpu:
        return "cpu" if kind is None else kind
    return str(tensor.device)


def as_numpy(host: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor (bfloat16 as its uint16 bits)."""
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(np.uint16)
    return host.numpy()


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def planned_buffer_of(host: bool) -> Callable[[torch.Tensor], Any]:
    """What a frozen plan's group reduces (common/planned_steps.py): a numpy view of a CPU tensor for the host
    engine's group (`host`), else the tensor itself, for a device plane's."""
    return as_numpy if host else _as_is


def from_numpy(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `dtype` on `device` with `array`'s values (zero-copy on the CPU; bfloat16 from its bits)."""
    tensor = torch.from_numpy(array)
    if dtype is torch.bfloat16:  # dtypes are singletons
        tensor = tensor.view(torch.bfloat16)
    return tensor if device is _CPU or device.type == "cpu" else tensor.to(device)  # device.type: 0.28 us


def collective_input(tensor: torch.Tensor) -> tuple[Any, str]:
    """(buffer, device label) of a collective's input: the tensor itself on a device plane, else a host view."""
    kind = plane_kind(tensor)
    if kind is None:
        return as_numpy(host_tensor(tensor)), device_label(tensor, None)
    return tensor.detach().contiguous(), device_label(tensor, kind)


def collective_result(buffer: Any, like: torch.Tensor) -> torch.Tensor:
    """A core result as a tensor of `like`'s dtype on `like`'s device (device-plane results already are)."""
    return buffer if isinstance(buffer, torch.Tensor) else from_numpy(buffer, like.dtype, like.device)


def copy_back(buffer: Any, tensor: torch.Tensor) -> None:
    """Copy a collective's result `buffer` (from `collective_input(tensor)`, or a slice of it) into `tensor`,
    unless it is `tensor`'s own memory: how a device tensor staged through a host copy gets its result."""
    if isinstance(buffer, torch.Tensor):
        if buffer.data_ptr() != tensor.data_ptr():
            tensor.copy_(buffer)
    elif buffer.size and buffer.ctypes.data != tensor.data_ptr():
        tensor.copy_(from_numpy(buffer, tensor.dtype, _CPU).view(tensor.shape))


def collective_buffers(tensor: torch.Tensor, inplace: bool, kind: str | None) -> tuple[torch.Tensor, Any, Any, str]:
    """(output tensor, input buffer, output buffer, device label) of a collective whose result has `tensor`'s
    shape, on the device plane of `kind` (None: host memory).

    In place on a contiguous tensor, all three share `tensor`'s memory. Otherwise the output is a new tensor on
    the device plane, or on the host an array allocated by numpy (no dispatcher call, which would hand the GIL
    to the background thread)."""
    if kind is not None:
        source = tensor.detach().contiguous()
        if inplace and source.data_ptr() == tensor.data_ptr():
            return source, source, source, device_label(tensor, kind)
        output = torch.empty_like(source)
        return output, source, output, device_label(tensor, kind)
    host = host_tensor(tensor)
    in_array = as_numpy(host)
    if inplace and (host is tensor or host.data_ptr() == tensor.data_ptr()):
        return host, in_array, in_array, "cpu"
    out_array = np.empty(in_array.shape, dtype=in_array.dtype)
    return from_numpy(out_array, tensor.dtype, _CPU), in_array, out_array, device_label(tensor, None)


def one_device(tensors: Sequence[torch.Tensor], name_of: Callable[[torch.Tensor], str], what: str) -> torch.device:
    """The one device `tensors` are on (the CPU when there are none); ValueError naming a tensor on each device
    when they are on several (a sharded flat buffer lives on one device)."""
    seen: dict[torch.device, torch.Tensor] = {}
    for tensor in tensors:
        seen.setdefault(tensor.device, tensor)
    if len(seen) > 1:
        found = ", ".join(f"{name_of(t)!r} on {device}" for device, t in seen.items())
        raise ValueError(f"{what} takes parameters on one device; found {found} (move the model with .to() first)")
    return next(iter(seen), _CPU)
