"""The core and the launcher (hvdplus.runner) must import with neither torch nor tensorflow available."""

import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

BLOCKED = ("torch", "tensorflow")

SCRIPT = textwrap.dedent("""
    import sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    for mod in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
        del sys.modules[mod]

    IMPORTS

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("blocker did not work")
    leaked = [m for m in sys.modules if m.split(".")[0] in BLOCKED]
    assert not leaked, leaked

    print("OK")
""")


CORE = [
    "hvdplus.common",
    "hvdplus.common.control.coordinator",
    "hvdplus.common.engines",
    "hvdplus.common.engines.local",
    "hvdplus.common.plans.grouping",
    "hvdplus.common.naming",
    "hvdplus.common.optimizer_options",
    "hvdplus.common.plans.lr_schedules",
]
RUNNER = [
    "hvdplus.runner",
    "hvdplus.runner.launch",
    "hvdplus.runner.api",
    "hvdplus.runner.task",
    "hvdplus.runner.agent",
    "hvdplus.runner.horovod_alias.horovod",
    "hvdplus.runner.alias",
]


def _import_with_blocked(modules: list[str], blocked: tuple[str, ...]) -> subprocess.CompletedProcess:
    script = SCRIPT.replace("BLOCKED", repr(blocked)).replace("IMPORTS", "; ".join(f"import {m}" for m in modules))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_core_imports_without_torch_or_tensorflow():
    result = _import_with_blocked(CORE, BLOCKED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


def test_launcher_imports_with_the_standard_library_only():
    result = _import_with_blocked(RUNNER, (*BLOCKED, "numpy"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"
