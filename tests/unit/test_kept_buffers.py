"""The kept buffers of blocking grouped allreduces (hvdplus/torch/packing.py): lent to one call at a time, kept
only for the layout they were made for, at most `limit` bytes (in whole pages) and _MAX_GROUPS groups in all, the
least recently used dropped first, and dropped when another runtime asks."""

import mmap

import pytest

torch = pytest.importorskip("torch")

from hvdplus.torch import packing  # noqa: E402
from hvdplus.torch.packing import KeptBuffers  # noqa: E402


class _Runtime:
    """Stands for an init()'s runtime: the buffers only compare it by identity."""


RUNTIME = _Runtime()


def _group(*shapes: tuple[int, ...], dtype=None):
    tensors = [torch.ones(shape, dtype=dtype or torch.float32) for shape in shapes]
    return tensors, tuple(tuple(t.shape) for t in tensors)


def test_a_buffer_given_back_is_borrowed_again_with_views_in_the_groups_shapes():
    kept = KeptBuffers()
    tensors, parts = _group((2, 3), (4,))
    assert kept.borrow(("g", 0), tensors, parts, RUNTIME) is None
    entry = kept.make(("g", 0), tensors, parts)
    assert entry.flat.numel() == 10 and [tuple(v.shape) for v in entry.views] == [(2, 3), (4,)]
    entry.views[1].fill_(7.0)
    assert entry.flat[6:].tolist() == [7.0] * 4  # the views are the buffer's memory
    kept.give_back(entry, 1 << 20, RUNTIME)
    assert kept.borrow(("g", 0), tensors, parts, RUNTIME) is entry and kept.reuses == 1
    assert kept.borrow(("g", 0), tensors, parts, RUNTIME) is None  # lent: the next call packs into its own


def test_another_layout_process_set_or_dtype_gets_a_new_buffer():
    kept = KeptBuffers()
    tensors, parts = _group((2, 3), (4,))
    kept.give_back(kept.make(("g", 0), tensors, parts), 1 << 20, RUNTIME)
    assert kept.borrow(("g", 1), tensors, parts, RUNTIME) is None
    other, other_parts = _group((3, 2), (4,))
    assert kept.borrow(("g", 0), other, other_parts, RUNTIME) is None  # dropped: the name now has another layout
    assert len(kept) == 0
    kept.give_back(kept.make(("g", 0), tensors, parts), 1 << 20, RUNTIME)
    halves, half_parts = _group((2, 3), (4,), dtype=torch.float16)
    assert kept.borrow(("g", 0), halves, half_parts, RUNTIME) is None
    assert kept.reuses == 0


def test_at_most_limit_bytes_in_whole_pages_are_kept_least_recently_used_first():
    kept = KeptBuffers()
    tensors, parts = _group((4,))  # 16 bytes, one page
    limit = 2 * mmap.PAGESIZE + 100
    for name in "abc":
        kept.give_back(kept.make((name, 0), tensors, parts), limit, RUNTIME)
    assert len(kept) == 2
    assert kept.borrow(("a", 0), tensors, parts, RUNTIME) is None  # dropped for c
    assert kept.borrow(("b", 0), tensors, parts, RUNTIME) is not None
    big, big_parts = _group((mmap.PAGESIZE,))
    kept.give_back(kept.make(("big", 0), big, big_parts), limit, RUNTIME)  # 4 pages: more than the limit
    assert kept.borrow(("big", 0), big, big_parts, RUNTIME) is None


def test_at_most_max_groups_are_kept():
    kept = KeptBuffers()
    tensors, parts = _group((4,))
    for number in range(packing._MAX_GROUPS + 10):
        kept.give_back(kept.make((f"step.{number}", 0), tensors, parts), 1 << 30, RUNTIME)
    assert len(kept) == packing._MAX_GROUPS
    assert kept.borrow(("step.0", 0), tensors, parts, RUNTIME) is None


def test_another_runtime_drops_every_kept_buffer():
    kept = KeptBuffers()
    tensors, parts = _group((4,))
    kept.give_back(kept.make(("g", 0), tensors, parts), 1 << 20, RUNTIME)
    assert kept.borrow(("g", 0), tensors, parts, _Runtime()) is None and len(kept) == 0


def test_buffers_are_private_maps_and_empty_groups_empty():
    kept = KeptBuffers()
    tensors, parts = _group((3,), (5,), dtype=torch.bfloat16)
    entry = kept.make(("g", 0), tensors, parts)
    address = entry.flat.data_ptr()
    with open("/proc/self/maps") as maps:
        (line,) = [
            line for line in maps if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)
        ]
    assert line.split()[1] == "rw-p", line  # private: a fork()ed child does not share it
    empty, empty_parts = _group((0,), (0, 3))
    assert kept.make(("e", 0), empty, empty_parts).flat.numel() == 0
