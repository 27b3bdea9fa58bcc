"""Row splits of reducescatter and alltoall."""

import pytest

from hvdplus.common.data.executor import even_splits
from hvdplus.common.data.layout import balanced_counts


@pytest.mark.parametrize(
    "dim0,size,expected",
    [
        (8, 4, [2, 2, 2, 2]),
        (10, 4, [3, 3, 2, 2]),
        (5, 3, [2, 2, 1]),
        (2, 4, [1, 1, 0, 0]),
        (0, 3, [0, 0, 0]),
        (7, 1, [7]),
    ],
)
def test_reducescatter_rows_are_balanced_counts(dim0, size, expected):
    assert balanced_counts(dim0, size) == expected
    assert sum(expected) == dim0


def test_even_splits():
    assert even_splits(12, 3) == (4, 4, 4)
    assert even_splits(0, 2) == (0, 0)


def test_even_splits_rejects_uneven():
    with pytest.raises(ValueError, match="divisible"):
        even_splits(10, 3)
