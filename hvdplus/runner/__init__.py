"""hvdplusrun, the horovodrun-compatible launcher, and `run(fn, np=...)`, which starts ranks from Python.

The launcher is the `hvdplusrun` command (`hvdplus.runner.launch:main`); it needs the standard library only.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy attribute below gives, for type checkers
    from hvdplus.runner.api import run

__all__ = ["run"]


def __getattr__(name: str) -> Any:
    # Lazy, so that workers importing the rendezvous client do not load the whole launcher.
    if name == "run":
        from hvdplus.runner.api import run

        return run
    raise AttributeError(f"module 'hvdplus.runner' has no attribute {name!r}")
