"""Wrappers that stay instances of the user's class: a dynamic subclass that presents itself as its base."""

from __future__ import annotations

import functools
from typing import TypeVar

__all__ = ["disguised_subclass"]

_Mixin = TypeVar("_Mixin")


def disguised_subclass(mixin: type[_Mixin], base: type) -> type[_Mixin]:
    """`mixin` placed before `base`, under base's name, module and qualified name, so that isinstance checks,
    reprs and serialization by class name (a saved Keras model) all see the user's class."""
    # Classes are hashable; mypy checks a class object against Hashable with its instances' __hash__ method.
    subclass: type[_Mixin] = _subclass(mixin, base)  # type: ignore[arg-type]
    return subclass  # a subclass of both: mypy has no intersection types, so its type says the mixin's half


@functools.cache
def _subclass(mixin: type, base: type) -> type:
    return type(base.__name__, (mixin, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})
