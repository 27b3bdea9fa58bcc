"""Learning-rate schedule arithmetic of Horovod's Keras callbacks (pure functions of epoch and size)."""

from __future__ import annotations

__all__ = ["in_epoch_range", "fractional_epoch", "warmup_multiplier"]


def in_epoch_range(epoch: float, start_epoch: int, end_epoch: int | None) -> bool:
    """True while a schedule applies: start_epoch <= epoch < end_epoch (no end when end_epoch is None)."""
    return epoch >= start_epoch and (end_epoch is None or epoch < end_epoch)


def fractional_epoch(epoch: int, batch: int, steps_per_epoch: int) -> float:
    """The position of `batch` within `epoch` as a fractional epoch (Horovod's per-batch schedules)."""
    if steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch!r}")
    return epoch + batch / steps_per_epoch


def warmup_multiplier(epoch: float, warmup_epochs: float, size: int, steps_per_epoch: int) -> float:
    """Goyal et al.'s gradual warmup as Horovod applies it: from ~1/size of the initial lr to 1x at the end.

    `epoch` is fractional; it is advanced by one batch so that the last batch of the warmup reaches exactly 1."""
    if warmup_epochs <= 0:
        raise ValueError(f"warmup_epochs must be positive, got {warmup_epochs!r}")
    epoch += 1.0 / steps_per_epoch
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
