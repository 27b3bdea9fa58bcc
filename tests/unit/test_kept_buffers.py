"""The kept buffers of blocking grouped allreduces (hvdplus/torch/packing.py): lent to one call at a time, kept
only for the layout they were made for, and at most `limit` bytes in all, the least recently used dropped first."""

import pytest

torch = pytest.importorskip("torch")

from hvdplus.torch.packing import KeptBuffers  # noqa: E402


def _group(*shapes: tuple[int, ...], dtype=None):
    tensors = [torch.ones(shape, dtype=dtype or torch.float32) for shape in shapes]
    return tensors, tuple(tuple(t.shape) for t in tensors)


def test_a_buffer_given_back_is_borrowed_again_with_views_in_the_groups_shapes():
    kept = KeptBuffers()
    tensors, parts = _group((2, 3), (4,))
    assert kept.borrow(("g", 0), tensors, parts) is None
    entry = kept.make(tensors, parts)
    assert entry.flat.numel() == 10 and [tuple(v.shape) for v in entry.views] == [(2, 3), (4,)]
    entry.views[1].fill_(7.0)
    assert entry.flat[6:].tolist() == [7.0] * 4  # the views are the buffer's memory
    kept.give_back(("g", 0), entry, limit=1 << 20)
    assert kept.borrow(("g", 0), tensors, parts) is entry and kept.reuses == 1
    assert kept.borrow(("g", 0), tensors, parts) is None  # lent: the next call packs into its own


def test_another_layout_process_set_or_dtype_gets_a_new_buffer():
    kept = KeptBuffers()
    tensors, parts = _group((2, 3), (4,))
    kept.give_back(("g", 0), kept.make(tensors, parts), limit=1 << 20)
    assert kept.borrow(("g", 1), tensors, parts) is None
    other, other_parts = _group((3, 2), (4,))
    assert kept.borrow(("g", 0), other, other_parts) is None  # dropped: the name now has another layout
    kept.give_back(("g", 0), kept.make(tensors, parts), limit=1 << 20)
    halves, half_parts = _group((2, 3), (4,), dtype=torch.float16)
    assert kept.borrow(("g", 0), halves, half_parts) is None
    assert kept.reuses == 0


def test_at_most_limit_bytes_are_kept_least_recently_used_first():
    kept = KeptBuffers()
    tensors, parts = _group((256,), (256,))  # 2 KiB of float32
    for name in "abc":
        kept.give_back((name, 0), kept.make(tensors, parts), limit=5000)
    assert kept.borrow(("a", 0), tensors, parts) is None  # dropped for c
    assert kept.borrow(("b", 0), tensors, parts) is not None
    assert kept.borrow(("c", 0), tensors, parts) is not None
    big, big_parts = _group((4096,))
    kept.give_back(("big", 0), kept.make(big, big_parts), limit=5000)  # larger than the limit: not kept
    assert kept.borrow(("big", 0), big, big_parts) is None


def test_an_empty_group_has_an_empty_buffer():
    kept = KeptBuffers()
    tensors, parts = _group((0,), (0, 3))
    entry = kept.make(tensors, parts)
    assert entry.flat.numel() == 0 and [tuple(v.shape) for v in entry.views] == [(0,), (0, 3)]
