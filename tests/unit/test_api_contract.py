"""Horovod compatibility is a tested contract: names and parameter order match horovod.torch."""

import functools
import inspect

import pytest

from tests.unit.horovod_contract import TORCH_OBJECTS, contract

hvd = pytest.importorskip("hvdplus.torch")
ENTRIES, _ = contract("torch")


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry.name for entry in ENTRIES])
def test_function_matches_horovod_signature(entry):
    function = functools.reduce(getattr, entry.name.split("."), hvd)  # elastic.run: hvd.elastic.run
    assert tuple(inspect.signature(function).parameters) == entry.params


def test_ops_classes_and_objects():
    for attr in TORCH_OBJECTS:
        assert hasattr(hvd, attr), attr
    assert hvd.Compression.none and hvd.Compression.fp16 and hvd.Compression.bf16
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_rank_before_init_says_how_to_fix():
    if hvd.is_initialized():
        pytest.skip("initialized by another test")
    with pytest.raises(ValueError, match=r"call hvd.init\(\)"):
        hvd.rank()
