"""Wrappers that stay instances of the user's class: a dynamic subclass that presents itself as its base."""

from __future__ import annotations

import functools

__all__ = ["disguised_subclass"]


@functools.cache
def disguised_subclass(mixin: type, base: type) -> type:
    """`mixin` placed before `base`, under base's name, module and qualified name, so that isinstance checks,
    reprs and serialization by class name (a saved Keras model) all see the user's class."""
    return type(base.__name__, (mixin, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})
