"""The wheel pip builds from this checkout: the license as an SPDX expression with its file (PEP 639), and a build
that prints no deprecation (setuptools stops building a `project.license` table after 2027-02-18)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.integration.conftest import ROOT


def test_the_wheel_declares_its_license_as_spdx_and_builds_without_deprecations(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = built.stdout + built.stderr
    assert built.returncode == 0, output
    assert "deprecat" not in output.lower(), output
    [wheel] = tmp_path.glob("hvdplus-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        info = next(name.split("/")[0] for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode().splitlines()
        shipped = archive.read(f"{info}/licenses/LICENSE").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert not any(line.startswith("License: ") for line in metadata)  # the old free-text field is gone
    assert shipped == (ROOT / "LICENSE").read_text() and "Apache License" in shipped
