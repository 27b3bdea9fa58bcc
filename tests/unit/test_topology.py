"""Local and cross ranks derived from per-rank hostnames."""

import pytest

from hvdplus.common.topology import Topology


def _all(hostnames):
    return [Topology(r, tuple(hostnames)) for r in range(len(hostnames))]


def test_blocked_layout():
    tops = _all(("a", "a", "b", "b"))
    assert [t.local_rank for t in tops] == [0, 1, 0, 1]
    assert [t.local_size for t in tops] == [2, 2, 2, 2]
    assert [t.cross_rank for t in tops] == [0, 0, 1, 1]
    assert [t.cross_size for t in tops] == [2, 2, 2, 2]
    assert tops[1].cross_peers == (1, 3)
    assert all(t.is_homogeneous for t in tops)
    assert tops[0].hosts == ("a", "b")


def test_interleaved_layout():
    tops = _all(("a", "b", "a", "b"))
    assert [t.local_rank for t in tops] == [0, 0, 1, 1]
    assert tops[0].local_peers == (0, 2)
    assert [t.cross_rank for t in tops] == [0, 1, 0, 1]
    assert tops[2].cross_peers == (2, 3)
    assert all(t.is_homogeneous for t in tops)


def test_inhomogeneous_layout():
    tops = _all(("a", "a", "b"))
    assert [t.local_rank for t in tops] == [0, 1, 0]
    assert [t.local_size for t in tops] == [2, 2, 1]
    assert tops[0].cross_peers == (0, 2) and tops[2].cross_peers == (0, 2)
    assert [t.cross_rank for t in tops] == [0, 0, 1]
    assert tops[1].cross_peers == (1,)
    assert [t.cross_size for t in tops] == [2, 1, 2]
    assert not any(t.is_homogeneous for t in tops)


@pytest.mark.parametrize("hostnames", [("solo",), ("h",) * 4])
def test_single_host(hostnames):
    for t in _all(hostnames):
        assert t.size == len(hostnames)
        assert t.local_rank == t.rank and t.local_size == t.size
        assert t.cross_rank == 0 and t.cross_size == 1
        assert t.is_homogeneous
