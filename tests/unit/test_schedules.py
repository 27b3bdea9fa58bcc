"""Learning-rate schedule arithmetic of the Keras callbacks (Horovod's formulas)."""

import pytest

from hvdplus.common.plans.lr_schedules import fractional_epoch, in_epoch_range, warmup_multiplier


def test_epoch_range_is_half_open():
    assert in_epoch_range(0, 0, 2) and in_epoch_range(1.5, 0, 2) and not in_epoch_range(2, 0, 2)
    assert in_epoch_range(100, 3, None) and not in_epoch_range(2.9, 3, None)


def test_fractional_epoch():
    assert fractional_epoch(2, 5, 10) == 2.5
    with pytest.raises(ValueError, match="steps_per_epoch"):
        fractional_epoch(0, 0, 0)


def test_warmup_goes_from_about_one_over_size_to_one():
    size, steps, epochs = 4, 10, 2
    first = warmup_multiplier(0.0, epochs, size, steps)
    last = warmup_multiplier(fractional_epoch(epochs - 1, steps - 1, steps), epochs, size, steps)
    assert first == pytest.approx(1 / size * (0.1 * (size - 1) / epochs + 1))
    assert last == pytest.approx(1.0)
    assert warmup_multiplier(0.5, 1, 1, steps) == 1.0  # one rank: no warmup
    with pytest.raises(ValueError, match="warmup_epochs"):
        warmup_multiplier(0.0, 0, size, steps)
