"""ZeroOptimizer's checkpoints: the whole state in the wrapped optimizer's own format, or each rank's shard.

- `consolidated_state_dict(to=r)` (collective) returns, on rank r, exactly what the unwrapped optimizer's
  `state_dict()` would: per-parameter state indexed over the original param groups, so the file also loads into
  a plain `torch.optim.AdamW`. `load_state_dict` takes that format on any number of ranks: each rank keeps its
  slice (2 ranks -> 3 ranks works).
- `sharded_state_dict()` / `load_sharded_state_dict()`: this rank's shard only; loading takes this rank's own
  (same number of ranks) or every rank's (any number: each rank cuts the ranges it now owns).
- `consolidated_state(to, store)`: the consolidated state built one flat sequence at a time, each tensor handed
  to `store` at once (zero3_checkpoint.py streams it into a file, so that no rank holds the whole state).
- `state_dict()` raises: on one rank it could only return a shard, which would silently lose the rest.

A state value is per element when it is a tensor of the shard parameter's shape (Adam's moments); anything else
(Adam's `step`) is taken as one value for the whole shard, equal on every rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import runtime
from hvdplus.torch.buffers import as_numpy, dtype_name, host_tensor

__all__ = ["ZeroStateDicts"]

if TYPE_CHECKING:  # a mixin placed before the user's optimizer class: it uses the optimizer's attributes and methods
    from hvdplus.torch.zero.shards import Shards

    _OptimizerMixin = torch.optim.Optimizer
else:
    _OptimizerMixin = object


def _on_host(value: Any) -> Any:
    """A state value as a checkpoint holds it: tensors on the CPU (a GPU run's checkpoint loads anywhere)."""
    return value.cpu() if torch.is_tensor(value) else value


def _per_element(value: Any, shard: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == shard.shape


class ZeroStateDicts(_OptimizerMixin):
    """Checkpoint methods of ZeroOptimizer (a mixin: `self._zero` is its `Shards`)."""

    _zero: Shards
    _zero_original_groups: list[list[torch.Tensor]]

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "a ZeroOptimizer holds 1/N of the state on each rank: call "
            "optimizer.consolidated_state_dict(to=0) on every rank (the whole state in the wrapped "
            "optimizer's format, on rank 0), or optimizer.sharded_state_dict() for this rank's shard"
        )

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (no parameters), for `load_sharded_state_dict` at any N:
        per flat sequence, this rank's range of each per-element state and each piece's scalars. Tensors are
        on the CPU, so a GPU run's state loads on a machine without one (loading moves them to the shards')."""
        z = self._zero
        flats: list[dict[str, Any]] = [
            {"bounds": list(part.bounds), "per_element": {}, "scalars": []} for part in z.plan
        ]
        for (k, _, start, end), param in zip(z.shards, z.shard_params):
            state = self.state.get(param, {})
            scalars = {key: _on_host(v) for key, v in state.items() if not _per_element(v, param)}
            flats[k]["scalars"].append((start, end, scalars))
            for key, value in state.items():
                if _per_element(value, param):
                    flats[k]["per_element"].setdefault(key, []).append(value.reshape(-1))
        for flat in flats:
            flat["per_element"] = {key: torch.cat(parts).cpu() for key, parts in flat["per_element"].items()}
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        return {
            "zero": {"size": z.size, "rank": z.index, "totals": [part.total for part in z.plan]},
            "flats": flats,
            "param_groups": groups,
        }

    def load_sharded_state_dict(self, state_dicts: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Load `sharded_state_dict()` results: this rank's own (same number of ranks), or every rank's, in rank
        order, saved with any number of ranks (each rank reads only the ranges it now owns; load them with
        `torch.load(..., mmap=True)` so that only those are read)."""
        z = self._zero
        saved = [state_dicts] if isinstance(state_dicts, dict) else list(state_dicts)
        meta = [s.get("zero", {}) if isinstance(s, dict) else {} for s in saved]
        totals = [part.total for part in z.plan]
        whole = len(saved) == meta[0].get("size") and [m.get("rank") for m in meta] == list(range(len(saved)))
        mine = len(saved) == 1 and meta[0].get("size") == z.size and meta[0].get("rank") == z.index
        if any(m.get("totals") != totals for m in meta) or not (whole or mine) or "flats" not in saved[0]:
            found = [{key: m.get(key) for key in ("size", "rank", "totals")} for m in meta]
            raise ValueError(
                f"these sharded states ({found}) do not fit this optimizer (size {z.size}, rank "
                f"{z.index}, totals {totals}): pass this rank's own state saved at the same size, or "
                f"every rank's state in rank order"
            )

        def entry_for(k: int, start: int, end: int, shape: torch.Size) -> dict[str, Any]:
            owners = [s["flats"][k] for s in saved]
            first = next(f for f in owners for lo, hi, _ in f["scalars"] if lo <= start < hi)
            entry = dict(next(v for lo, hi, v in first["scalars"] if lo <= start < hi))
            for key in owners[0]["per_element"]:
                pieces = []
                for f, m in zip(owners, meta):
                    lo, hi = f["bounds"][m["rank"]], f["bounds"][m["rank"] + 1]
                    a, b = max(lo, start), min(hi, end)
                    if a < b:
                        pieces.append(f["per_element"][key][a - lo : b - lo])
                entry[key] = torch.cat(pieces).view(shape).clone()
            return entry

        self._load_entries(entry_for, saved[0]["param_groups"])

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state, in the wrapped optimizer's own `state_dict` format, on global rank `to`
        (None on the other ranks).

        Collective: every rank in the process set must call this."""
        return self.consolidated_state(to, lambda tensor: tensor.clone())

    def consolidated_state(self, to: int, store: Callable[[torch.Tensor], Any]) -> dict[str, Any] | None:
        """consolidated_state_dict, with each whole state tensor passed through `store` as soon as it is cut
        out (a streamed save writes it and keeps a placeholder), one flat sequence at a time."""
        z = self._zero
        to = core.check_root(to, z.process_set)
        shards = [
            (k, group, start, end, self.state.get(param, {}))
            for (k, group, start, end), param in zip(z.shards, z.shard_params)
        ]
        described = [
            (
                k,
                start,
                end,
                {key: (str(v.dtype) if _per_element(v, param) else _on_host(v)) for key, v in state.items()},
            )
            for (k, _, start, end, state), param in zip(shards, z.shard_params)
        ]
        everyone = core.allgather_object(described, name=f"ZeroOptimizer.state.{z.names[0]}", process_set=z.process_set)
        entries = {(k, start, end): listed for k, start, end, listed in (e for shard in everyone for e in shard)}
        keep = runtime().rank == to
        consolidated: dict[int, dict[str, Any]] = {}
        for k, full in self._gather_flat_state(shards, everyone):  # one flat sequence at a time
            if keep:
                for i in z.plan[k].params:
                    consolidated[i] = self._consolidated_entry(i, full, entries, store)
        if not keep:
            return None
        state, index = {}, 0
        groups = []
        position = {id(p): i for i, p in enumerate(z.params)}
        for options, originals in zip(self.param_groups, self._zero_original_groups):
            indices = []
            for param in originals:
                entry = consolidated.get(position.get(id(param), -1))
                if entry:
                    state[index] = entry
                indices.append(index)
                index += 1
            groups.append(dict({k: v for k, v in options.items() if k != "params"}, params=indices))
        return {"state": state, "param_groups": groups}

    def _gather_flat_state(self, shards: list, everyone: list) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(flat index, {key: the whole flat per-element state}) for each flat sequence in turn, allgathered
        with its counts: no rank holds more than one sequence's gathered state at a time."""
        z = self._zero
        kinds: dict[int, dict[str, str]] = {}
        for k, _, _, entries in (entry for listed in everyone for entry in listed):
            kinds.setdefault(k, {}).update({key: v for key, v in entries.items() if isinstance(v, str)})
        for k in range(len(z.plan)):
            full = {}
            for key, dtype in sorted(kinds.get(k, {}).items()):
                dtype = getattr(torch, dtype.replace("torch.", ""))
                parts = [
                    state[key].reshape(-1) if key in state else torch.zeros(end - start, dtype=dtype)
                    for kk, _, start, end, state in shards
                    if kk == k
                ]
                mine = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)
                out = torch.empty(z.plan[k].total, dtype=dtype)
                core.submit_allgather(
                    as_numpy(host_tensor(mine)),
                    dtype_name(out),
                    f"ZeroOptimizer.state.{k}.{key}",
                    process_set=z.process_set,
                    counts=z.plan[k].counts,
                    output=as_numpy(out),
                ).wait()
                full[key] = out
            yield k, full

    def _consolidated_entry(
        self, i: int, full: dict, entries: dict, store: Callable[[torch.Tensor], Any]
    ) -> dict[str, Any]:
        """Parameter i's state, cut out of its flat sequence's state; scalars from the shard holding its first
        element (empty if that shard has no state yet)."""
        z = self._zero
        k, offset = z.where[i]
        shape = z.shapes[i]
        numel = math.prod(shape)
        owner: dict[str, Any] = next(
            (listed for (kk, start, end), listed in entries.items() if kk == k and start <= offset < end), {}
        )
        entry = {key: v for key, v in owner.items() if not isinstance(v, str)}
        for key in (key for key, v in owner.items() if isinstance(v, str)):
            entry[key] = store(full[key][offset : offset + numel].view(shape))
        return entry

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (`consolidated_state_dict`, or a plain optimizer's `state_dict()` over the
        same parameters) saved with any number of ranks; each rank keeps its slice. Checked before anything
        changes: ValueError if the groups, parameter counts or state shapes do not match."""
        z = self._zero
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or "state" not in state_dict:
            raise ValueError(
                "load_state_dict takes a consolidated state dict ({'state': ..., 'param_groups': ...}); "
                "use load_sharded_state_dict() for what sharded_state_dict() returned"
            )
        originals = self._zero_original_groups
        if [len(g["params"]) for g in saved_groups] != [len(g) for g in originals]:
            raise ValueError(
                f"the state dict has param groups of {[len(g['params']) for g in saved_groups]} "
                f"parameters, but this optimizer's are {[len(g) for g in originals]}"
            )
        by_param = {}
        for saved, params in zip(saved_groups, originals):
            for index, param in zip(saved["params"], params):
                by_param[param] = state_dict["state"].get(index, {})
        for i, param in enumerate(z.params):
            for key, value in by_param[param].items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != z.shapes[i]:
                    raise ValueError(
                        f"state {key!r} of parameter {z.names[i]!r} has shape {tuple(value.shape)}, "
                        f"but the parameter's is {tuple(z.shapes[i])}"
                    )

        def entry_for(k: int, start: int, end: int, shape: torch.Size) -> dict[str, Any]:
            pieces = z.plan[k].pieces(start, end)
            first = by_param[z.params[pieces[0].param]]
            entry = {key: v for key, v in first.items() if not (torch.is_tensor(v) and v.dim() > 0)}
            for key in (key for key, v in first.items() if torch.is_tensor(v) and v.dim() > 0):
                entry[key] = torch.cat(
                    [by_param[z.params[p.param]][key].reshape(-1)[p.start : p.start + p.length] for p in pieces]
                ).view(shape)
            return entry

        self._load_entries(entry_for, saved_groups)

    def _load_entries(
        self, entry_for: Callable[[int, int, int, torch.Size], dict[str, Any]], saved_groups: list[dict[str, Any]]
    ) -> None:
        """Give the wrapped optimizer the state `entry_for(flat, start, end, shape)` of each shard parameter and
        the saved groups' hyper-parameters."""
        z = self._zero
        position = {p: n for n, p in enumerate(p for g in self.param_groups for p in g["params"])}
        sharded = {}
        for shard, (k, _, start, end) in zip(z.shard_params, z.shards):
            entry = entry_for(k, start, end, shard.shape)
            if entry:
                sharded[position[shard]] = entry
        groups = [
            dict({k: v for k, v in saved.items() if k != "params"}, params=[position[p] for p in current["params"]])
            for saved, current in zip(saved_groups, self.param_groups)
        ]
        super().load_state_dict({"state": sharded, "param_groups": groups})
