"""horovod.tensorflow.util: the helpers Horovod's own modules, scripts and tests call as `hvd.util.<name>`.

The names keep Horovod's leading underscores: they are private in Horovod's code but used from outside it
(`hvd.util._executing_eagerly()`), so they are this module's public surface, with Horovod's behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf

# The underscored helpers are imported by name (as Horovod's tests do); `__all__` lists the names a star import and
# the API reference take, which leave underscored names out.
__all__ = ["vars_to_refs", "refs_to_vars"]

_Result = TypeVar("_Result")


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (False while building a tf.function or a tf.compat.v1 graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable[..., Any]) -> Any:
    """`f` as a tf.function (Horovod runs a group of eager collectives as one graph this way)."""
    return tf.function(f)


def _cache(f: Callable[..., _Result]) -> Callable[..., _Result]:
    """`f` memoized on its (hashable) positional arguments and on whether it runs eagerly, as Horovod caches the
    functions it builds once per mode (a graph function must not be reused eagerly, nor the reverse)."""
    cache: dict[Any, _Result] = {}

    def wrapper(*args: Any) -> _Result:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(vars: Any) -> Any:
    """A variable as its hashable `ref()`, lists (nested) as tuples: a key for `_cache`."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs: Any) -> Any:
    """Inverse of `vars_to_refs`: tuples back to lists, refs back to their variables."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
