"""Checkpoints of a model sharded by `hvd.shard_parameters` (and its ZeroOptimizer), streamed unit by unit.

- `full_state_dict(model, to=0)`: the plain `model.state_dict()` of the unsharded model, on rank `to`.
- `load_full_state_dict(model, state_dict)`: any rank count; each rank copies only its own slices.
- `save_full_checkpoint(path, model, optimizer)`: one `torch.save` file {"model": plain state dict, "optimizer":
  the plain optimizer's state dict}, written by rank `to` one unit (and one flat sequence of optimizer state)
  at a time, so that no rank ever holds the whole model; `torch.load` of it feeds a plain, unsharded model and
  optimizer, and `load_full_checkpoint` a sharded one at any number of ranks.
- `save_sharded_checkpoint(directory, model, optimizer)`: one file per rank with its shards (1/N each);
  `load_sharded_checkpoint` reads it back at any number of ranks, each rank memory-mapping the old files and
  copying only the ranges it now owns.

Parameters are saved from the fp32 (or original dtype) shards the optimizer steps, not from the compute dtype
gathered for forward. Every state dict and file holds CPU tensors, whatever device the model trains on, and every
load maps the files to the CPU and copies into the shards where they live: a GPU run's checkpoint loads on a
CPU-only machine, and the other way round."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from hvdplus.common import collectives as core
from hvdplus.common.basics import runtime
from hvdplus.torch.buffers import as_numpy, collective_input, dtype_name
from hvdplus.torch.zero.streamed_save import StreamedSave
from hvdplus.torch.zero.zero3 import ShardedModel
from hvdplus.torch.zero.zero3_units import Unit
from hvdplus.torch.zero.zero_state import ZeroStateDicts

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "save_full_checkpoint",
    "load_full_checkpoint",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
]

_SHARDED_FORMAT = "hvdplus-zero3-sharded-1"


def _sharded(model: torch.nn.Module) -> ShardedModel:
    sharded: ShardedModel | None = getattr(model, "_hvdplus_zero3", None)
    if sharded is None:
        raise ValueError("this function takes a model sharded by hvd.shard_parameters")
    return sharded


def _unsharded_entries(model: torch.nn.Module, sharded: ShardedModel) -> dict[str, torch.Tensor]:
    """The model's state-dict entries that no unit shards (its buffers), by key."""
    return {key: value for key, value in model.state_dict(keep_vars=True).items() if id(value) not in sharded.unit_of}


def _on_host(tree: Any) -> Any:
    """`tree` with its tensors in host memory (the CPU ones as they are)."""
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, tree)


def _whole_shards(sharded: ShardedModel, unit: Unit) -> list[torch.Tensor]:
    """Every rank's shards of `unit` allgathered in their own dtype (not the compute dtype), on the CPU: over the
    shards' device plane when they have one, else through host memory. Collective."""
    wholes = []
    for k, part in enumerate(unit.plan):
        send, device = collective_input(unit.shards[k])
        on_plane = isinstance(send, torch.Tensor)
        whole = torch.empty(part.total, dtype=unit.shards[k].dtype, device=unit.shards[k].device if on_plane else "cpu")
        output: Any = whole if on_plane else as_numpy(whole)
        core.submit_allgather(
            send,
            dtype_name(whole),
            sharded.next_name(),
            process_set=sharded.process_set,
            counts=part.counts,
            output=output,
            device=device,
            tag=f"state of unit {unit.name!r}",
        ).wait()
        wholes.append(whole.cpu())
    return wholes


def _model_state(model: torch.nn.Module, to: int, store: Callable[[torch.Tensor], Any]) -> dict[str, Any] | None:
    """The plain state dict on global rank `to`, each parameter handed to `store` one unit at a time."""
    sharded = _sharded(model)
    to = core.check_root(to, sharded.process_set)
    keep = runtime().rank == to
    values: dict[int, Any] = {}
    for unit in sharded.units:
        wholes = _whole_shards(sharded, unit)
        if keep:
            for k, part in enumerate(unit.plan):
                for i, offset, numel in zip(part.params, part.offsets, part.numels):
                    values[id(unit.params[i])] = store(wholes[k][offset : offset + numel].view(unit.shapes[i]))
        del wholes
    if not keep:
        return None
    return {
        key: values[id(value)] if id(value) in values else store(value.detach().cpu())
        for key, value in model.state_dict(keep_vars=True).items()
    }


def full_state_dict(model: torch.nn.Module, to: int = 0) -> dict[str, Any] | None:
    """`model.state_dict()` as the unsharded model would return it, on global rank `to` (None elsewhere).
    Collective."""
    return _model_state(model, to, lambda tensor: tensor.clone())


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Load a plain (unsharded) state dict, saved with any number of ranks, into a sharded model: each rank
    copies its own slice of each parameter (with `torch.load(mmap=True)` only those pages are read), and the
    buffers. Not collective. KeyError/ValueError name a missing parameter or a wrong shape."""
    sharded = _sharded(model)
    names = {id(value): key for key, value in model.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        for unit in sharded.units:
            for i in range(len(unit.params)):
                key = names[id(unit.params[i])]
                if key not in state_dict:
                    raise KeyError(f"the state dict has no {key!r}")
                if tuple(state_dict[key].shape) != tuple(unit.shapes[i]):
                    raise ValueError(
                        f"{key!r} has shape {tuple(state_dict[key].shape)} in the state dict, but "
                        f"{tuple(unit.shapes[i])} in the model"
                    )
            for k, part in enumerate(unit.plan):
                start, end = part.shard(unit.index)
                for piece in part.pieces(start, end):
                    source = state_dict[names[id(unit.params[piece.param])]].reshape(-1)
                    unit.shards[k][piece.offset - start : piece.offset - start + piece.length].copy_(
                        source[piece.start : piece.start + piece.length]
                    )
                if unit.persistent:
                    for i, offset, numel in zip(part.params, part.offsets, part.numels):
                        unit.full[k][offset : offset + numel].copy_(state_dict[names[id(unit.params[i])]].reshape(-1))
        for key, value in _unsharded_entries(model, sharded).items():
            if key in state_dict:
                value.data.copy_(state_dict[key])


def save_full_checkpoint(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, to: int = 0
) -> None:
    """Write {"model": plain state dict, "optimizer": plain optimizer state dict} to `path` on global rank `to`,
    streamed (no rank holds the whole model or optimizer state). Collective."""
    zero = _check_optimizer(model, optimizer)
    writing = runtime().rank == core.check_root(to, _sharded(model).process_set)
    out = StreamedSave(path) if writing else None
    store = out.tensor if out is not None else (lambda tensor: None)
    saved = {"model": _model_state(model, to, store)}
    if zero is not None:
        saved["optimizer"] = zero.consolidated_state(to, store)
    if out is not None:
        out.finish(saved)


def load_full_checkpoint(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load what `save_full_checkpoint` (or `torch.save` of plain state dicts under "model" and "optimizer")
    wrote, at any number of ranks; memory-mapped, so each rank reads only its slices."""
    _check_optimizer(model, optimizer)
    saved = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    load_full_state_dict(model, saved["model"])
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])


def save_sharded_checkpoint(
    directory: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write this rank's shards (and its optimizer shard) to `directory`/rank-R-of-N.pt; every rank writes its
    own file. Collective (ends with a barrier, so the directory is complete when it returns)."""
    zero = _check_optimizer(model, optimizer)
    sharded = _sharded(model)
    size, rank = sharded.process_set.size(), sharded.process_set.rank()
    units = {
        unit.name: {"bounds": [list(part.bounds) for part in unit.plan], "shards": _on_host(unit.shards)}
        for unit in sharded.units
    }
    buffers = _on_host(_unsharded_entries(model, sharded))
    saved = {
        "format": _SHARDED_FORMAT,
        "size": size,
        "rank": rank,
        "units": units,
        "buffers": buffers,
        "optimizer": _on_host(zero.sharded_state_dict()) if zero is not None else None,
    }
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(saved, Path(directory) / f"rank-{rank}-of-{size}.pt")
    core.submit_barrier(sharded.process_set).wait()
    if rank == 0:  # a save at another size before would otherwise be found beside this one
        for stale in Path(directory).glob("rank-*-of-*.pt"):
            if stale.stem.rsplit("-", 1)[1] != str(size):
                stale.unlink()
    core.submit_barrier(sharded.process_set).wait()


def load_sharded_checkpoint(
    directory: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load `save_sharded_checkpoint`'s files, saved with any number of ranks: each rank memory-maps them and
    copies the ranges it now owns. ValueError if the files are missing or the units differ."""
    zero = _check_optimizer(model, optimizer)
    sharded = _sharded(model)
    found = sorted(Path(directory).glob("rank-*-of-*.pt"))
    if not found:
        raise ValueError(f"no sharded checkpoint (rank-R-of-N.pt files) in {directory}")
    sizes = sorted({int(f.stem.rsplit("-", 1)[1]) for f in found})
    if len(sizes) > 1:
        raise ValueError(f"{directory} holds sharded checkpoints of {sizes} ranks; keep one")
    old_size = sizes[0]
    files = [Path(directory) / f"rank-{r}-of-{old_size}.pt" for r in range(old_size)]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ValueError(f"the sharded checkpoint in {directory} was saved by {old_size} ranks, but lacks {missing}")
    saved = [torch.load(f, mmap=True, weights_only=True, map_location="cpu") for f in files]
    if any(s.get("format") != _SHARDED_FORMAT for s in saved):
        raise ValueError(f"{directory} does not hold an hvdplus sharded checkpoint ({_SHARDED_FORMAT})")
    with torch.no_grad():
        for unit in sharded.units:
            olds = [s["units"].get(unit.name) for s in saved]
            totals = [part.total for part in unit.plan]
            if any(o is None or [b[-1] for b in o["bounds"]] != totals for o in olds):
                raise ValueError(
                    f"unit {unit.name!r} of this model does not match the checkpoint's (saved units: "
                    f"{sorted(saved[0]['units'])})"
                )
            for k, part in enumerate(unit.plan):
                start, end = part.shard(unit.index)
                for r, old in enumerate(olds):
                    lo, hi = old["bounds"][k][r], old["bounds"][k][r + 1]
                    a, b = max(lo, start), min(hi, end)
                    if a < b:
                        unit.shards[k][a - start : b - start].copy_(old["shards"][k][a - lo : b - lo])
                if unit.persistent:
                    for r, old in enumerate(olds):
                        lo, hi = old["bounds"][k][r], old["bounds"][k][r + 1]
                        unit.full[k][lo:hi].copy_(old["shards"][k].to(unit.full[k].dtype))
        for key, value in _unsharded_entries(model, sharded).items():
            if key in saved[0]["buffers"]:
                value.data.copy_(saved[0]["buffers"][key])
    if zero is not None:
        zero.load_sharded_state_dict([s["optimizer"] for s in saved])


def _check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> ZeroStateDicts | None:
    """`optimizer` as the ZeroOptimizer over this model's parameters that it must be (None: no optimizer)."""
    if optimizer is not None and getattr(getattr(optimizer, "_zero", None), "sharded", None) is not _sharded(model):
        raise ValueError("the optimizer must be the hvd.ZeroOptimizer wrapped around this sharded model's parameters")
    assert optimizer is None or isinstance(optimizer, ZeroStateDicts)  # a ZeroOptimizer's class derives from it
    return optimizer
