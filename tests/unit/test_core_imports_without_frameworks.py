"""The core must import with neither torch nor tensorflow available."""

import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "tensorflow"):
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    for mod in [m for m in sys.modules if m.split(".")[0] in ("torch", "tensorflow")]:
        del sys.modules[mod]

    import hvdplus.common
    import hvdplus.common.coordinator
    import hvdplus.common.engines
    import hvdplus.common.engines.local

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("blocker did not work")
    leaked = [m for m in sys.modules if m.split(".")[0] in ("torch", "tensorflow")]
    assert not leaked, leaked
    print("OK")
""")


def test_core_imports_without_torch_or_tensorflow():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"
