"""DistributedOptimizer's `groups`/`num_groups`: which gradients are allreduced together (Horovod's rules).

Pure functions over an optimizer's parameter list; parameters are matched by identity, so they need not
be hashable (TensorFlow and Keras variables are not)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["split_list", "check_groups", "group_indices", "build_groups", "bucket_indices"]


def split_list(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """Split `items` into `parts` contiguous lists whose lengths differ by at most one (Horovod's split)."""
    quotient, remainder = divmod(len(items), parts)
    return [
        list(items[i * quotient + min(i, remainder) : (i + 1) * quotient + min(i + 1, remainder)]) for i in range(parts)
    ]


def check_groups(groups: object) -> None:
    """`groups` must be None, a positive int or a list (of lists of parameters)."""
    if groups is None:
        return
    if isinstance(groups, bool) or not isinstance(groups, (int, list)) or (isinstance(groups, int) and groups <= 0):
        raise ValueError(f"groups should be a positive integer or a list of lists of parameters, got {groups!r}")


def group_indices(params: Sequence[Any], groups: int | list[Any] | None) -> list[tuple[int, ...]]:
    """The groups as tuples of positions in `params`, in optimizer order ([] when `groups` is None).

    `groups` is None (no grouping), a positive int (that many contiguous groups of about equal size) or a
    list of lists of parameters (each parameter at most once; the parameters not listed form groups of
    their own). Every rank must build its optimizer over the same parameters in the same order."""
    check_groups(groups)
    if groups is None:
        return []
    if isinstance(groups, int):
        return [tuple(part) for part in split_list(range(len(params)), min(groups, len(params))) if part]
    return [tuple(part) for part in _listed_groups(params, groups)]


def build_groups(params: Sequence[Any], groups: int | list[Any] | None) -> dict[Any, tuple[Any, ...]]:
    """Map each of `params` (hashable ones, e.g. torch tensors) to the tuple of its group (see group_indices)."""
    plan = [tuple(params[i] for i in indices) for indices in group_indices(params, groups)]
    return {p: group for group in plan for p in group}


def bucket_indices(
    nbytes: Sequence[int],
    kinds: Sequence[Any],
    bucket_bytes: int,
    alone_bytes: int | None,
    first_bucket_bytes: int = 0,
) -> list[tuple[int, ...]]:
    """DDP's gradient buckets, as positions: the parameters in reverse order (backward produces the last layers'
    gradients first) cut into contiguous runs of one kind (dtype) and at most `bucket_bytes`. The first bucket closes
    once it holds `first_bucket_bytes` (DDP's first-bucket rule: the gradient that reaches the limit is in it, within
    `bucket_bytes`; 0: no separate limit), so that its reduction starts early in the backward pass, with the last
    layers' large gradients in it rather than behind every earlier layer's. A parameter of `alone_bytes` or more (None:
    no limit) is in no bucket: it is reduced alone and in place, where packing it would cost more than the engine call
    it saves. No buckets when `bucket_bytes` is 0. Every rank computes the same buckets."""
    if bucket_bytes <= 0:
        return []
    buckets: list[list[int]] = []
    current: list[int] | None = None
    filled = 0
    for i in reversed(range(len(nbytes))):
        if alone_bytes is not None and nbytes[i] >= alone_bytes:
            current = None  # buckets stay contiguous: a large parameter closes the open one
            continue
        if current is None or kinds[current[-1]] != kinds[i] or filled + nbytes[i] > bucket_bytes:
            current, filled = [], 0
            buckets.append(current)
        current.append(i)
        filled += nbytes[i]
        if first_bucket_bytes and len(buckets) == 1 and filled >= first_bucket_bytes:
            current = None  # the first bucket is full: the next gradient opens the second
    return [tuple(sorted(bucket)) for bucket in buckets]


def _listed_groups(params: Sequence[Any], groups: list[Any]) -> list[list[int]]:
    """The listed groups in optimizer order (objects that are not parameters are left out, as Horovod does
    for frozen ones), then every unlisted parameter on its own."""
    position = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    lists = []
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError(
                f"groups must be a list of lists of parameters; got an element of type {type(group).__name__}"
            )
        ids = {id(p) for p in group}
        if len(ids) != len(group) or ids & seen:
            raise ValueError("A parameter can only appear once in groups; remove the duplicate")
        seen |= ids
        lists.append(sorted(position[i] for i in ids if i in position))
    return [part for part in lists if part] + [[i] for i, p in enumerate(params) if id(p) not in seen]
