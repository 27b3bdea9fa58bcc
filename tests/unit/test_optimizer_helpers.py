"""Pure helpers every adapter's DistributedOptimizer shares: names, argument checks, groups by position."""

import warnings

import pytest

from hvdplus.common.naming import member_names, normalize_name
from hvdplus.common.ops import ReduceOp
from hvdplus.common.optimizer_options import (
    check_compression,
    check_passes,
    check_predivide,
    merge_num_groups,
    predivide_scales,
)
from hvdplus.common.plans.grouping import group_indices


class Unhashable:
    """Stands for a TensorFlow variable: no hash, matched by identity."""

    __hash__ = None


def test_member_names():
    assert member_names("g", 3) == ["g.0", "g.1", "g.2"]
    assert member_names("g", 1) == ["g"]
    assert member_names(None, 2) == [None, None]


def test_normalize_name_is_horovods():
    assert normalize_name("dense/kernel:0") == "dense_kernel_0"
    assert normalize_name("ok_Name9") == "ok_Name9"


def test_passes_and_compression_checks():
    check_passes(3)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="backward_passes_per_step"):
            check_passes(bad)
    with pytest.raises(TypeError, match="Compressor"):
        check_compression("fp16")


def test_predivide_scales_split_the_average():
    assert predivide_scales(4.0, ReduceOp.AVERAGE) == (0.25, 4.0)
    assert predivide_scales(4.0, ReduceOp.SUM) == (1.0, 1.0)
    check_predivide(1.0, ReduceOp.SUM)
    with pytest.raises(ValueError, match="op != Average"):
        check_predivide(2.0, ReduceOp.SUM)


def test_num_groups_becomes_groups_with_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert merge_num_groups(0, [1]) == [1]
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert merge_num_groups(3, None) == 3


def test_group_indices_by_position_for_unhashable_parameters():
    params = [Unhashable() for _ in range(5)]
    assert group_indices(params, None) == []
    assert group_indices(params, 2) == [(0, 1, 2), (3, 4)]
    assert group_indices(params, [[params[3], params[1]], [object()]]) == [(1, 3), (0,), (2,), (4,)]
    with pytest.raises(ValueError, match="only appear once"):
        group_indices(params, [[params[0]], [params[0]]])
