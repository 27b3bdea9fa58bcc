"""Collective names that every rank derives the same way: members of grouped ops, framework op names."""

from __future__ import annotations

import re

__all__ = ["member_names", "group_size", "grouped_call", "normalize_name"]

_INVALID = re.compile(r"[^a-zA-Z0-9_]")
_MEMBER = re.compile(r"^(.+)\.(\d+)$")


def member_names(name: str | None, count: int) -> list[str | None]:
    """Names of the `count` members of a grouped collective named `name` (None leaves each to the core)."""
    return [None if name is None else f"{name}.{i}" for i in range(count)] if count > 1 else [name]


def group_size(count: int) -> int:
    """What members of a grouped call of `count` tensors announce as their group (0 for a lone tensor, named
    like a plain call), so that ranks grouping different numbers of tensors get a mismatch error."""
    return count if count > 1 else 0


def grouped_call(name: str, group: int) -> str:
    """The name of the grouped call of `group` tensors whose member `member_names` named `name`, or '' (a name
    of another form: an unnamed call's members are named by the core one by one)."""
    match = _MEMBER.match(name)
    return match.group(1) if match is not None and int(match.group(2)) < group else ""


def normalize_name(name: str) -> str:
    """Horovod's normalization of framework names: every character outside [a-zA-Z0-9_] becomes '_'."""
    return _INVALID.sub("_", name)
