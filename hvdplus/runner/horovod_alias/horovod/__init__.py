"""`horovod` for unmodified Horovod scripts under hvdplusrun: `horovod.X` is `hvdplus.X`, loaded on first use.

hvdplusrun puts this package first on the workers' PYTHONPATH when Horovod itself is not installed
(opt out with --no-horovod-alias). `import horovod.torch as hvd` then gives the very module object
`hvdplus.torch`; horovod.tensorflow, horovod.tensorflow.keras and horovod.keras map the same way, and
importing one of those also turns on hvdplus.tensorflow.keras2_compat (Keras 2 idioms such as
`SGD(lr=...)` and `optimizer.variables()` on Keras 3), which `import hvdplus...` never does.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

_KERAS2_SCRIPTS = frozenset({"horovod.tensorflow", "horovod.keras", "horovod.tensorflow.keras"})


class _AliasLoader(importlib.abc.Loader):
    """Loads `horovod.X` by importing `hvdplus.X` and handing back that same module."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        try:
            module = importlib.import_module(self.target)
        except ModuleNotFoundError as exc:
            if exc.name and self.target.startswith(exc.name):
                raise ModuleNotFoundError(
                    f"{spec.name} is served by {self.target} under hvdplusrun, and this install has no {exc.name}",
                    name=spec.name,
                ) from None
            raise
        self._own = {name: getattr(module, name) for name in ("__spec__", "__path__") if hasattr(module, name)}
        if spec.name in _KERAS2_SCRIPTS:
            importlib.import_module("hvdplus.tensorflow.keras2_compat").enable()
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Undo what the import system wrote onto the hvdplus module: it keeps its own spec and path."""
        for name in ("__spec__", "__path__"):
            if name in self._own:
                setattr(module, name, self._own[name])
            elif hasattr(module, name):
                delattr(module, name)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps every `horovod.<name>` import onto `hvdplus.<name>`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        alias = "hvdplus" + fullname[len(__name__) :]
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(alias), is_package=True)


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
