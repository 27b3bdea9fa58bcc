"""The documentation site builds with `mkdocs build --strict` and no warning, and its generated tables are complete.

The site needs the `docs` extra (mkdocs, mkdocs-material, mkdocstrings[python]); without it these tests skip,
except under CI=true, where they fail.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.horovod_contract import contract

ROOT = Path(__file__).resolve().parents[2]
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "griffe")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # the parent package of a dotted name is missing
        return False


def _require_docs_tools() -> None:
    missing = [name for name in DOCS_PACKAGES if not _installed(name)]
    if missing:
        message = f"the docs extra is not installed (missing {', '.join(missing)}): pip install -e '.[docs]'"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    _require_docs_tools()
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "scripts" / "docs_generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict_without_warnings(tmp_path, generator):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material 9.8's end-of-life notice
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    seconds = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    warnings = [line for line in output.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not warnings, output
    assert seconds < 120, f"mkdocs build took {seconds:.1f} s"
    # Every name a package exports has its heading (and anchor) in the API reference.
    api = generator.load_api()
    for page, package in generator.REFERENCE_PACKAGES.items():
        html = (site / "reference" / page / "index.html").read_text()
        for name in generator.package_exports(api, package).members:
            path = name if name.startswith("hvdplus.") else f"{package}.{name}"
            assert f'id="{path}"' in html, f"{path} is not documented in reference/{page}.md"


def test_settings_table_lists_every_setting(generator):
    from hvdplus.common.settings import SETTINGS

    text = generator.settings_table()
    for setting in SETTINGS:
        assert f"`{setting.env}`" in text, setting.env
        if setting.alias:
            assert f"`{setting.alias}`" in text, setting.alias
    assert len(generator.settings_rows()) == len(SETTINGS)


def test_tuning_flags_reach_their_settings(generator):
    flags = {setting: action.option_strings[0] for setting, action in generator.flags_by_setting().items()}
    assert flags["HVDPLUS_FUSION_THRESHOLD"] == "--fusion-threshold-mb"
    assert flags["HVDPLUS_TIMEOUT"] == "--start-timeout"
    assert flags["HVDPLUS_STALL_CHECK_DISABLE"] == "--stall-check"


def test_flag_table_lists_every_horovodrun_and_hvdplusrun_flag(generator):
    from hvdplus.runner.args import make_parser

    rows = generator.flag_rows()
    listed = {flag for row in rows for flag in row.flags}
    for options, _ in generator.HOROVODRUN_FLAGS:
        assert set(options) <= listed, options
    covered = {flag for row in rows for flag in row.hvdplusrun}
    for action in make_parser()._actions:
        assert set(action.option_strings) - {"-h", "--help"} <= covered, action.option_strings
    statuses = {row.flags: row.status for row in rows}
    assert statuses[("--disable-cache",)] == "accepted, has no effect"
    assert statuses[("--tcp",)].startswith("not supported")
    assert statuses[("-x",)] == "hvdplusrun only"


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_api_table_lists_every_contract_name(generator, framework):
    entries, objects = contract(framework)
    assert entries and objects
    rows = generator.api_rows(framework)
    assert len(rows) == len(entries) + len(objects)
    wanted = [f"{e.module}.{e.name}" for e in entries] + [f"{module}.{name}" for module, name in objects]
    for row, path in zip(rows, wanted):
        assert row[0] == "`" + path.replace("hvdplus", "horovod", 1) + "`"
        assert not row[2].startswith("missing"), (path, row[2])  # the contract lists names hvdplus covers


def test_pages_include_the_generated_tables():
    pages = {
        "migrating.md": ["horovodrun_flags.md", "api_torch.md", "api_tensorflow.md"],
        "configuration.md": ["settings.md"],
        "reference/torch.md": ["reference/torch.md"],
        "reference/tensorflow.md": ["reference/tensorflow.md"],
        "reference/keras.md": ["reference/keras.md"],
        "reference/runner.md": ["reference/runner.md", "hvdplusrun_help.md"],
    }
    for page, fragments in pages.items():
        text = (ROOT / "docs" / page).read_text()
        for fragment in fragments:
            assert f'--8<-- "docs_generated/{fragment}"' in text, (page, fragment)
