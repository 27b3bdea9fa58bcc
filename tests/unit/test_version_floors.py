"""The framework versions pyproject.toml declares as minimums are the ones this suite runs (issue 57): a floor below
the installed release would promise versions nobody ran. When the test environment moves to a newer release, run
the suite on the old floor or raise it."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
FRAMEWORKS = ["torch", "tensorflow-cpu", "ray", "pyspark"]


def _floor(package: str) -> str:
    found = re.search(rf'"{package}(?:\[[^\]]*\])?>=([\d.]+)', PYPROJECT.read_text())  # tomllib: Python 3.11+
    assert found is not None, f"pyproject.toml declares no {package}>= floor"
    return found.group(1)


@pytest.mark.parametrize("package", FRAMEWORKS)
def test_the_declared_floor_is_the_installed_release(package):
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed here")
    floor = _floor(package)
    assert installed.split("+")[0].split(".")[: len(floor.split("."))] == floor.split("."), (
        f"pyproject.toml says {package}>={floor}, the suite runs {installed}"
    )
