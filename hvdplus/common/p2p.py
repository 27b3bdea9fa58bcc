"""Point-to-point messages of several arrays over an engine's `Channel`, with no negotiation.

A message is a fixed-size int64 header (each array's dtype and shape, so shapes may change from message to
message) followed by one transfer per non-empty array, each on its own tag. A sender that failed sends an
error header instead (its text follows), so a receiver raises `PeerError` rather than wait forever.
`alive()`, called by engines whose waits poll, may raise to give up (when hvdplus itself stopped)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvdplus.common.ops import DTYPES, storage_dtype

__all__ = ["PeerError", "TAGS_PER_MESSAGE", "send_arrays", "send_error", "recv_arrays", "wait_for"]

TAGS_PER_MESSAGE = 64  # the header's tag, then one per array: a message holds at most 63 arrays
_HEADER_WORDS = 240  # under 2 KiB: sent eagerly by MPI's shared-memory transports
_DATA, _ERROR = 1, 2
_DTYPE_NAMES = sorted(DTYPES)


class PeerError(RuntimeError):
    """The peer sent an error instead of the expected message (it failed, or heard of a failure)."""


def _header(arrays: Sequence[tuple[np.ndarray, str]]) -> np.ndarray:
    if len(arrays) >= TAGS_PER_MESSAGE:
        raise ValueError(f"a message holds at most {TAGS_PER_MESSAGE - 1} tensors, got {len(arrays)}")
    words = [_DATA, len(arrays)]
    for array, dtype in arrays:
        words += [_DTYPE_NAMES.index(dtype), array.ndim, *array.shape]
    if len(words) > _HEADER_WORDS:
        raise ValueError(f"the shapes of {len(arrays)} tensors do not fit a {_HEADER_WORDS}-word message header")
    header = np.zeros(_HEADER_WORDS, dtype=np.int64)
    header[: len(words)] = words
    return header


def send_arrays(channel: Any, peer: int, tag: int, arrays: Sequence[tuple[np.ndarray, str]]) -> list[Any]:
    """Start sending (array, dtype name) pairs to `peer`; returns the transfers (with their buffers) to test."""
    transfers = [channel.isend(_header(arrays), peer, tag)]
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


def recv_arrays(channel: Any, peer: int, tag: int, alive: Callable[[], None]) -> list[tuple[np.ndarray, str]]:
    """Receive the message `peer` sends on `tag`: its (array, dtype name) pairs. PeerError if it sent an error.
    `alive()` is called while waiting and may raise to give up."""
    header = np.empty(_HEADER_WORDS, dtype=np.int64)
    wait_for(channel.irecv(header, peer, tag), alive)
    if header[0] == _ERROR:
        text = np.empty(int(header[1]), dtype=np.uint8)
        wait_for(channel.irecv(text, peer, tag + 1), alive)
        raise PeerError(text.tobytes().decode(errors="replace"))
    arrays, position, pending = [], 2, []
    for j in range(int(header[1])):
        dtype, ndim = _DTYPE_NAMES[int(header[position])], int(header[position + 1])
        shape = tuple(int(d) for d in header[position + 2 : position + 2 + ndim])
        position += 2 + ndim
        array = np.empty(shape, dtype=storage_dtype(dtype))
        if array.size:
            pending.append(channel.irecv(array, peer, tag + 1 + j))
        arrays.append((array, dtype))
    for transfer in pending:
        wait_for(transfer, alive)
    return arrays


def wait_for(transfer: Any, alive: Callable[[], None]) -> None:
    """Wait for a transfer of this module's messages until it completes (see `Transfer.wait`)."""
    transfer.wait(alive)
