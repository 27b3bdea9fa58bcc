"""Tensor fusion: which agreed allreduces share one buffer (a pure, deterministic plan)."""

from __future__ import annotations

from hvdplus.common.messages import Response
from hvdplus.common.ops import OpKind

__all__ = ["plan_batches", "ALONE_BYTES"]

# A response of at least this many bytes runs alone, reduced in place in its own engine call: copying it into
# and out of a fusion buffer costs more than the call it would save (a 4 MB gradient: ~2 ms of copies on these
# machines against ~50 us for a call).
ALONE_BYTES = 1 << 20


def plan_batches(responses: list[Response], threshold: int) -> list[list[Response]]:
    """Group successful allreduces with the same set, dtype, device, op and scales, up to `threshold`
    bytes each; every other response, and any of ALONE_BYTES or more, runs alone. Batches keep the order of
    their first response."""
    batches: list[list[Response]] = []
    open_batch: dict[tuple, tuple[list[Response], int]] = {}
    for response in responses:
        if response.error is not None or response.kind != OpKind.ALLREDUCE or threshold <= 0 \
                or response.nbytes >= ALONE_BYTES:
            batches.append([response])
            continue
        first = response.first
        key = (response.key[0], first.dtype, first.device, first.op, first.prescale, first.postscale)
        size = response.nbytes
        current = open_batch.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].append(response)
            open_batch[key] = (current[0], current[1] + size)
        else:
            batch = [response]
            batches.append(batch)
            open_batch[key] = (batch, size)
    return batches
