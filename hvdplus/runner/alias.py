"""`hvdplus-horovod-alias on|off|status`: unmodified Horovod scripts under any launcher (srun, mpirun, torchrun).

hvdplusrun serves `import horovod...` by putting hvdplus/runner/horovod_alias first on its workers' PYTHONPATH.
Other launchers start Python themselves, so `on` installs the same alias into this interpreter's environment: a
`hvdplus-horovod-alias.pth` in its site-packages whose one line appends a finder to the *end* of `sys.meta_path`.
That finder is asked about `horovod` only after every other finder has searched the whole `sys.path` and found
nothing, so a real Horovod, wherever it is installed, is always the one imported. When pip installed hvdplus into
this same site-packages, the file is added to hvdplus's RECORD, so `pip uninstall hvdplus` removes it too; `off`
removes it (and that RECORD line). Stdlib only: the line runs at every start of this environment's Python.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import sysconfig
import types
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ALIAS_PATH", "PTH_NAME", "install_fallback", "real_horovod", "main"]

ALIAS_PATH = str(Path(__file__).resolve().parent / "horovod_alias")
PTH_NAME = "hvdplus-horovod-alias.pth"
_PTH_LINE = "import hvdplus.runner.alias as _hvdplus_alias; _hvdplus_alias.install_fallback()\n"


class _FallbackFinder(importlib.abc.MetaPathFinder):
    """Finds `horovod` in hvdplus's alias directory; consulted last, so only where no real Horovod exists."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "horovod":
            return None  # horovod.X: the alias package's own finder maps it once `horovod` is ours
        return importlib.machinery.PathFinder.find_spec(fullname, [ALIAS_PATH])


def install_fallback() -> None:
    """Append the fallback finder to sys.meta_path once (what the .pth line calls at interpreter start)."""
    if not any(isinstance(finder, _FallbackFinder) for finder in sys.meta_path):
        sys.meta_path.append(_FallbackFinder())


def real_horovod() -> str | None:
    """Where a real Horovod is installed on sys.path, if anywhere (the alias itself is not counted)."""
    spec = importlib.machinery.PathFinder.find_spec("horovod", [p for p in sys.path if p != ALIAS_PATH])
    return spec.origin if spec is not None else None


def _site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _record() -> Path | None:
    """hvdplus's RECORD when pip installed it into this interpreter's site-packages (else None)."""
    try:
        dist = importlib.metadata.distribution("hvdplus")
    except importlib.metadata.PackageNotFoundError:
        return None
    record = next((f for f in dist.files or () if f.name == "RECORD" and f.parent.name.endswith(".dist-info")), None)
    if record is None:
        return None
    path = Path(str(dist.locate_file(record))).resolve()  # a pathlib.Path for an installed distribution
    return path if path.parent.parent == _site_packages().resolve() else None


def _set_record_line(present: bool) -> None:
    record = _record()
    if record is None:
        return
    lines = [line for line in record.read_text().splitlines() if line.split(",", 1)[0] != PTH_NAME]
    record.write_text("\n".join(lines + ([f"{PTH_NAME},,"] if present else [])) + "\n")


def _on() -> str:
    pth = _site_packages() / PTH_NAME
    pth.write_text(_PTH_LINE)
    _set_record_line(True)
    owner = (
        "`pip uninstall hvdplus` removes it too"
        if _record() is not None
        else "hvdplus was not installed here by pip, so only `hvdplus-horovod-alias off` removes it"
    )
    shadow = real_horovod()
    note = (
        f"\nA real Horovod is installed ({shadow}): `import horovod` keeps loading it; the alias serves only "
        f"environments without one."
        if shadow
        else ""
    )
    return f"on: {pth} makes `import horovod...` load hvdplus in this environment; {owner}.{note}"


def _off() -> str:
    pth = _site_packages() / PTH_NAME
    existed = pth.exists()
    pth.unlink(missing_ok=True)
    _set_record_line(False)
    return f"off: removed {pth}" if existed else f"off: the alias was not installed ({pth} does not exist)"


def _status() -> str:
    pth = _site_packages() / PTH_NAME
    shadow = real_horovod()
    if shadow:
        serves = f"a real Horovod ({shadow})"
    elif pth.exists():
        serves = "hvdplus (the alias)"
    else:
        serves = "nothing (ModuleNotFoundError) outside hvdplusrun"
    return f"alias {'on' if pth.exists() else 'off'} ({pth}); `import horovod` loads {serves}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdplus-horovod-alias",
        description="Let unmodified Horovod scripts (import horovod.torch as hvd) run on hvdplus under any launcher "
        "(srun, mpirun, torchrun) in this Python environment. Never shadows a real Horovod.",
    )
    parser.add_argument("action", choices=["on", "off", "status"])
    args = parser.parse_args(argv)
    print({"on": _on, "off": _off, "status": _status}[args.action]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
