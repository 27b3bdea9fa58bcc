"""How a pipeline stage's tensors reach a peer stage: on the lane's device-plane channel when there is one and the
tensors are of its kind, else staged through (pinned) host memory. The header (shapes, dtypes, where the sender's
tensors were) always goes on the host channel, so a failure sent in its place reaches the peer either way. Which
lanes exist is the Pipeline's to decide (pipeline.py); this module only moves one message."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvdplus.common.data.p2p import ROUTE_PLANE, recv_data, recv_header, send_arrays, send_header
from hvdplus.torch.buffers import DTYPE_NAMES, as_numpy, dtype_name, plane_kind
from hvdplus.torch.device_plane import CPU_TEST_KIND
from hvdplus.torch.streams import host_copy, host_empty

__all__ = ["CPU", "kind_of", "plane_device", "receive_tensors", "send_tensors", "tensor_of"]

CPU = torch.device("cpu")
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_FROM_HOST, _FROM_CUDA = 0, 1  # a message's origin word: where the sender's tensors were


def send_tensors(
    channel: Any, lane: Any | None, plane: str | None, peer: int, tag: int, tensors: Sequence[torch.Tensor]
) -> list[Any]:
    """Start sending `tensors` to `peer`; returns the transfers, whose buffers must live until they complete."""
    tensors = [t.detach().contiguous() for t in tensors]
    specs = [(tuple(t.shape), dtype_name(t)) for t in tensors]
    origin = _FROM_CUDA if any(t.is_cuda for t in tensors) else _FROM_HOST
    if lane is not None and all(plane_kind(t) == plane for t in tensors):  # the data first, then the header
        transfers = [lane.isend(t, peer, tag + 1 + j) for j, t in enumerate(tensors) if t.numel()]
        return transfers + send_header(channel, peer, tag, specs, ROUTE_PLANE, origin)
    arrays = [(as_numpy(host_copy(t)), name) for t, (_, name) in zip(tensors, specs)]
    return send_arrays(channel, peer, tag, arrays, origin)


def receive_tensors(
    channel: Any,
    lane: Any | None,
    plane: str | None,
    peer: int,
    tag: int,
    device: torch.device | None,
    alive: Callable[[], None],
) -> tuple[torch.Tensor, ...]:
    """The tensors of a message, created on `device` (where the sender's were, for a stage without parameters or
    buffers: `device` None), whichever way they travel."""
    header = recv_header(channel, peer, tag, alive)
    if device is None:  # no parameters or buffers: where the sender's tensors were
        device = plane_device("cuda") if header.origin == _FROM_CUDA and torch.cuda.is_available() else CPU
    if header.route == ROUTE_PLANE:
        if lane is None or plane is None:
            raise RuntimeError(f"rank {peer} sent on a device plane this stage has no channel for")
        where = device if kind_of(device) == plane else plane_device(plane)
        tensors = [torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=where) for shape, dtype in header.specs]
        for transfer in [lane.irecv(t, peer, tag + 1 + j) for j, t in enumerate(tensors) if t.numel()]:
            transfer.wait(alive)
        return tuple(t.to(device) for t in tensors)
    if device.type == "cpu":
        arrays = recv_data(channel, peer, tag, header.specs, alive)
        return tuple(tensor_of(array, dtype) for array, dtype in arrays)
    staged: list[torch.Tensor] = []  # pinned host buffers, copied to the device without waiting

    def pinned(shape: tuple[int, ...], dtype: str) -> Any:
        staged.append(host_empty(_numel(shape), TORCH_DTYPES[dtype], device).view(shape))
        return as_numpy(staged[-1])

    recv_data(channel, peer, tag, header.specs, alive, pinned)
    return tuple(host.to(device, non_blocking=True) for host in staged)


def kind_of(device: torch.device) -> str | None:
    """The device-plane kind of tensors on `device` (None: they go through host memory)."""
    return plane_kind(torch.empty(0, device=device))


def plane_device(kind: str) -> torch.device:
    """Where a rank without a device of its own puts tensors of plane `kind`: the current GPU for CUDA."""
    if kind == CPU_TEST_KIND:
        return CPU
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def tensor_of(array: Any, dtype: str) -> torch.Tensor:
    """A received host array as a tensor of its dtype (bfloat16 travels as 16-bit words)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
