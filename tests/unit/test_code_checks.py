"""The checks engineers expect, run by the test command: ruff's lint and format, mypy on hvdplus/, and a valid
pre-commit configuration that runs the same tools (pyproject.toml holds their settings)."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)


def _require(module: str) -> None:
    """Skip without the lint extra, except in CI, where scripts/setup.sh installs it and a skip would hide it."""
    if shutil.which(module, path=str(Path(sys.executable).parent)) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed beside {sys.executable}: scripts/setup.sh installs the dev extra")
        pytest.skip(f"{module} is not installed (pip install -e '.[lint]')")


def test_ruff_check_passes():
    _require("ruff")
    result = _run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    _require("ruff")
    result = _run(sys.executable, "-m", "ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_passes_on_the_package():
    _require("mypy")
    result = _run(sys.executable, "-m", "mypy")  # files and strictness from [tool.mypy] in pyproject.toml
    assert result.returncode == 0 and "Success" in result.stdout, result.stdout + result.stderr


def test_pre_commit_runs_the_same_checks():
    _require("pre-commit")
    result = _run(sys.executable, "-m", "pre_commit", "validate-config", ".pre-commit-config.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    for hook in ("ruff check", "ruff format", "python -m mypy"):
        assert f"entry: {hook}" in config, hook
    hook_versions = set(re.findall(r'"ruff==([^"]+)"', config))
    extra_versions = set(re.findall(r'"ruff==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    assert len(hook_versions) == 1 and hook_versions == extra_versions, "the hooks' ruff must be the lint extra's"


def test_torch_modules_convert_tensors_through_one_layer():
    """One tensor-to-buffer layer (hvdplus/torch/buffers.py) for every torch feature: no module reaches into the
    collectives' private helpers (mpi_ops' `_numpy` and the like), where a host-only copy could hide."""
    offenders = []
    for path in sorted((ROOT / "hvdplus" / "torch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hvdplus.torch.mpi_ops":
                offenders += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders
