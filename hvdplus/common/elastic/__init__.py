"""Elastic training: the run loop and state (state.py), a worker's side of the launcher's generations
(rendezvous.py) and the plan the launcher publishes (plan.py, standard library only: hvdplusrun imports it, so this
package's __init__ imports nothing at import time).

`hvdplus.common.elastic.State` and the other names of state.py still resolve here, as `horovod.common.elastic`'s
do in Horovod (and through the alias, `horovod.common.elastic` is this package): loaded on first use."""

from typing import Any

_SUBMODULES = ("plan", "rendezvous", "state")  # `from hvdplus.common.elastic import plan` imports only plan.py


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES and not name.startswith("__"):
        import importlib

        state = importlib.import_module("hvdplus.common.elastic.state")
        if name in state.__all__:
            return getattr(state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
