"""Horovod compatibility is a tested contract: names and parameter order match horovod.torch."""

import functools
import inspect
from pathlib import Path

import pytest

hvd = pytest.importorskip("hvdplus.torch")
CONTRACT = Path(__file__).with_name("horovod_torch_api.txt")


def _contract() -> list[tuple[str, list[str]]]:
    entries = []
    for line in CONTRACT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, params = line.rstrip(")").split("(")
            entries.append((name, [p.strip() for p in params.split(",") if p.strip()]))
    return entries


@pytest.mark.parametrize("name,params", _contract(), ids=[name for name, _ in _contract()])
def test_function_matches_horovod_signature(name, params):
    function = functools.reduce(getattr, name.split("."), hvd)  # elastic.run: hvd.elastic.run
    assert list(inspect.signature(function).parameters) == params


def test_ops_classes_and_objects():
    for attr in (
        "Average",
        "Sum",
        "Min",
        "Max",
        "Product",
        "Adasum",
        "Compression",
        "ProcessSet",
        "global_process_set",
        "HorovodInternalError",
        "HostsUpdatedInterrupt",
    ):
        assert hasattr(hvd, attr), attr
    assert hvd.Compression.none and hvd.Compression.fp16 and hvd.Compression.bf16
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_rank_before_init_says_how_to_fix():
    if hvd.is_initialized():
        pytest.skip("initialized by another test")
    with pytest.raises(ValueError, match=r"call hvd.init\(\)"):
        hvd.rank()
