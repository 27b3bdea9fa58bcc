"""Tensor fusion: which agreed collectives share one buffer (a pure, deterministic plan).

Allreduces, reduce-scatters and allgathers fuse (layout.py lays each kind's batch out); every other kind
runs alone."""

from __future__ import annotations

from hvdplus.common.control.messages import Response

__all__ = ["plan_batches"]


def plan_batches(responses: list[Response], threshold: int, alone_bytes: int | None) -> list[list[Response]]:
    """Group successful responses of one kind with the same set, dtype, device, op and scales (`fusion_key`), up to
    `threshold` bytes each (an allgather counts the bytes it gathers); every other response, any larger than
    `threshold`, and any of `alone_bytes` or more (the engine's policy, Engine.alone_bytes; None: no limit) runs
    alone, leaving the open batch of its kind open. Batches keep the order of their first response."""
    batches: list[list[Response]] = []
    open_batch: dict[tuple, tuple[list[Response], int]] = {}
    for response in responses:
        key = response.fusion_key
        if threshold <= 0 or key is None:
            batches.append([response])
            continue
        size = response.fused_nbytes
        if size > threshold or (alone_bytes is not None and size >= alone_bytes):
            batches.append([response])
            continue
        current = open_batch.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].append(response)
            open_batch[key] = (current[0], current[1] + size)
        else:
            batch = [response]
            batches.append(batch)
            open_batch[key] = (batch, size)
    return batches
