"""DistributedOptimizer's `groups`/`num_groups`: which gradients are allreduced together (Horovod's rules).

Pure functions over the optimizer's parameter list; parameters are matched by identity."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["split_list", "build_groups"]


def split_list(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Split `items` into `parts` contiguous lists whose lengths differ by at most one (Horovod's split)."""
    quotient, remainder = divmod(len(items), parts)
    return [list(items[i * quotient + min(i, remainder):(i + 1) * quotient + min(i + 1, remainder)])
            for i in range(parts)]


def build_groups(params: Sequence[Any], groups: Any) -> dict[Any, tuple[Any, ...]]:
    """Map each of `params` (those with hooks, in optimizer order) to the tuple of its group.

    `groups` is None (no grouping), a positive int (that many contiguous groups of about equal size) or a
    list of lists of parameters (each parameter at most once; the parameters not listed form groups of
    their own). Every rank must build its optimizer over the same parameters in the same order."""
    if groups is None:
        return {}
    if isinstance(groups, bool) or not isinstance(groups, (int, list)) or (isinstance(groups, int) and groups <= 0):
        raise ValueError(f"groups should be a positive integer or a list of lists of parameters, got {groups!r}")
    if isinstance(groups, int):
        lists = [part for part in split_list(list(params), min(groups, len(params))) if part]
    else:
        lists = _listed_groups(params, groups)
    return {p: group for group in map(tuple, lists) for p in group}


def _listed_groups(params: Sequence[Any], groups: list[Any]) -> list[list[Any]]:
    """The listed groups in optimizer order (tensors that are not hooked parameters are left out, as
    Horovod does for frozen ones), then every unlisted parameter on its own."""
    seen: set[int] = set()
    lists = []
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"groups must be a list of lists of parameters; got an element of type "
                             f"{type(group).__name__}")
        ids = {id(p) for p in group}
        if len(ids) != len(group) or ids & seen:
            raise ValueError("A parameter can only appear once in groups; remove the duplicate")
        seen |= ids
        lists.append([p for p in params if id(p) in ids])
    return [part for part in lists if part] + [[p] for p in params if id(p) not in seen]
