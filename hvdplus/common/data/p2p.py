"""Point-to-point messages of several arrays over an engine's `Channel`, with no negotiation.

A message is a fixed-size int64 header (its route, an origin word the sender chooses, and each array's dtype and
shape, so shapes may change from message to message) followed by one transfer per non-empty array, each on its
own tag. On `ROUTE_HOST` the arrays follow on the same channel; on `ROUTE_PLANE` they travel on another channel
(a device plane's, which moves device tensors: see `send_header` and `recv_header`), on the same tags. A sender
that failed sends an error header instead (its text follows), so a receiver raises `PeerError` rather than wait
forever. `alive()`, called by engines whose waits poll, may raise to give up (when hvdplus itself stopped)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdplus.common.ops import DTYPES, storage_dtype

__all__ = [
    "PeerError",
    "TAGS_PER_MESSAGE",
    "ROUTE_HOST",
    "ROUTE_PLANE",
    "Header",
    "send_arrays",
    "send_header",
    "send_error",
    "recv_arrays",
    "recv_header",
    "recv_data",
    "wait_for",
]

TAGS_PER_MESSAGE = 64  # the header's tag, then one per array: a message holds at most 63 arrays
ROUTE_HOST, ROUTE_PLANE = 0, 1  # where a message's arrays travel: after its header, or on a device plane
_HEADER_WORDS = 240  # under 2 KiB: sent eagerly by MPI's shared-memory transports
_FIXED_WORDS = 4  # kind, number of arrays, route, origin
_DATA, _ERROR = 1, 2
_DTYPE_NAMES = sorted(DTYPES)

Spec = tuple[tuple[int, ...], str]  # an array's shape and dtype name


class PeerError(RuntimeError):
    """The peer sent an error instead of the expected message (it failed, or heard of a failure)."""


@dataclass(frozen=True)
class Header:
    """A received message's header: where its arrays travel, the sender's origin word, and their specs."""

    route: int
    origin: int
    specs: list[Spec]


def _header(specs: Sequence[Spec], route: int, origin: int) -> np.ndarray:
    if len(specs) >= TAGS_PER_MESSAGE:
        raise ValueError(f"a message holds at most {TAGS_PER_MESSAGE - 1} tensors, got {len(specs)}")
    words = [_DATA, len(specs), route, origin]
    for shape, dtype in specs:
        words += [_DTYPE_NAMES.index(dtype), len(shape), *shape]
    if len(words) > _HEADER_WORDS:
        raise ValueError(f"the shapes of {len(specs)} tensors do not fit a {_HEADER_WORDS}-word message header")
    header = np.zeros(_HEADER_WORDS, dtype=np.int64)
    header[: len(words)] = words
    return header


def send_header(
    channel: Any, peer: int, tag: int, specs: Sequence[Spec], route: int = ROUTE_PLANE, origin: int = 0
) -> list[Any]:
    """Start sending only the header of a message whose arrays (of these specs) travel by `route`: the caller
    sends them, on tags `tag + 1 + j` for the j-th non-empty one. Returns the transfers to wait for."""
    return [channel.isend(_header(specs, route, origin), peer, tag)]


def send_arrays(
    channel: Any, peer: int, tag: int, arrays: Sequence[tuple[np.ndarray, str]], origin: int = 0
) -> list[Any]:
    """Start sending (array, dtype name) pairs to `peer`; returns the transfers (with their buffers) to test."""
    specs = [(tuple(array.shape), dtype) for array, dtype in arrays]
    transfers = send_header(channel, peer, tag, specs, ROUTE_HOST, origin)
    transfers += [
        channel.isend(np.ascontiguousarray(array), peer, tag + 1 + j)
        for j, (array, _) in enumerate(arrays)
        if array.size
    ]
    return transfers


def send_error(channel: Any, peer: int, tag: int, text: str) -> list[Any]:
    """Start sending an error in place of the message `peer` expects on `tag`."""
    data = np.frombuffer(text.encode(errors="replace"), dtype=np.uint8).copy()
    header = np.zeros(_HEADER_WORDS, dtype=np.int64)
    header[:2] = [_ERROR, data.size]
    return [channel.isend(header, peer, tag), channel.isend(data, peer, tag + 1)]


def recv_header(channel: Any, peer: int, tag: int, alive: Callable[[], None]) -> Header:
    """Receive the header of the message `peer` sends on `tag`. PeerError if it sent an error. `alive()` is
    called while waiting and may raise to give up."""
    header = np.empty(_HEADER_WORDS, dtype=np.int64)
    wait_for(channel.irecv(header, peer, tag), alive)
    if header[0] == _ERROR:
        text = np.empty(int(header[1]), dtype=np.uint8)
        wait_for(channel.irecv(text, peer, tag + 1), alive)
        raise PeerError(text.tobytes().decode(errors="replace"))
    specs, position = [], _FIXED_WORDS
    for _ in range(int(header[1])):
        dtype, ndim = _DTYPE_NAMES[int(header[position])], int(header[position + 1])
        specs.append((tuple(int(d) for d in header[position + 2 : position + 2 + ndim]), dtype))
        position += 2 + ndim
    return Header(int(header[2]), int(header[3]), specs)


def recv_data(
    channel: Any,
    peer: int,
    tag: int,
    specs: Sequence[Spec],
    alive: Callable[[], None],
    empty: Callable[[tuple[int, ...], str], np.ndarray] | None = None,
) -> list[tuple[np.ndarray, str]]:
    """Receive the arrays of a `ROUTE_HOST` message whose header said `specs`, into arrays from `empty(shape,
    dtype name)` (numpy's by default: pass one to receive into pinned memory, say)."""
    arrays, pending = [], []
    for j, (shape, dtype) in enumerate(specs):
        array = np.empty(shape, dtype=storage_dtype(dtype)) if empty is None else empty(shape, dtype)
        if array.size:
            pending.append(channel.irecv(array, peer, tag + 1 + j))
        arrays.append((array, dtype))
    for transfer in pending:
        wait_for(transfer, alive)
    return arrays


def recv_arrays(channel: Any, peer: int, tag: int, alive: Callable[[], None]) -> list[tuple[np.ndarray, str]]:
    """Receive the message `peer` sends on `tag` (on `ROUTE_HOST`): its (array, dtype name) pairs. PeerError if
    it sent an error. `alive()` is called while waiting and may raise to give up."""
    header = recv_header(channel, peer, tag, alive)
    if header.route != ROUTE_HOST:
        raise RuntimeError(f"the message on tag {tag} from rank {peer} travels on a device plane, not this channel")
    return recv_data(channel, peer, tag, header.specs, alive)


def wait_for(transfer: Any, alive: Callable[[], None]) -> None:
    """Wait for a transfer of this module's messages until it completes (see `engines.base.Work.wait`)."""
    transfer.wait(alive)
