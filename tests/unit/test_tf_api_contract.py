"""Horovod compatibility is a tested contract: horovod.tensorflow(.keras) names and parameter order."""

import importlib
import inspect

import pytest

from tests.unit.horovod_contract import TF_OBJECTS, contract

pytest.importorskip("tensorflow")
pytest.importorskip("keras", minversion="3")
ENTRIES, _ = contract("tensorflow")


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{entry.module}.{entry.name}" for entry in ENTRIES])
def test_signature_starts_with_horovods(entry):
    function = getattr(importlib.import_module(entry.module), entry.name)
    assert tuple(inspect.signature(function).parameters)[: len(entry.params)] == entry.params


def test_keras_aliases_and_objects():
    import hvdplus.keras
    import hvdplus.tensorflow as hvd
    import hvdplus.tensorflow.keras

    assert hvdplus.tensorflow.keras is hvdplus.keras
    for module in (hvd, hvdplus.keras):
        for attr in TF_OBJECTS:
            assert hasattr(module, attr), (module.__name__, attr)
    assert hvd.Compression.none and hvd.Compression.fp16 and hvd.Compression.bf16
