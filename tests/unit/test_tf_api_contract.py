"""Horovod compatibility is a tested contract: horovod.tensorflow(.keras) names and parameter order."""

import importlib
import inspect
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras", minversion="3")
CONTRACT = Path(__file__).with_name("horovod_tensorflow_api.txt")


def _contract() -> list[tuple[str, str, list[str]]]:
    entries = []
    for line in CONTRACT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            module, call = line.split(" ", 1)
            name, params = call.rstrip(")").split("(")
            entries.append((module, name, [p.strip() for p in params.split(",") if p.strip()]))
    return entries


@pytest.mark.parametrize("module,name,params", _contract(), ids=[f"{m}.{n}" for m, n, _ in _contract()])
def test_signature_starts_with_horovods(module, name, params):
    function = getattr(importlib.import_module(module), name)
    assert list(inspect.signature(function).parameters)[: len(params)] == params


def test_keras_aliases_and_objects():
    import hvdplus.keras
    import hvdplus.tensorflow as hvd
    import hvdplus.tensorflow.keras

    assert hvdplus.tensorflow.keras is hvdplus.keras
    for module in (hvd, hvdplus.keras):
        for attr in (
            "Average",
            "Sum",
            "Adasum",
            "Compression",
            "ProcessSet",
            "global_process_set",
            "HorovodInternalError",
        ):
            assert hasattr(module, attr), (module.__name__, attr)
    assert hvd.Compression.none and hvd.Compression.fp16 and hvd.Compression.bf16
