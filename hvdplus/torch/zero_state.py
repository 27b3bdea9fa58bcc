"""ZeroOptimizer's checkpoints: the whole state in the wrapped optimizer's own format, or each rank's shard.

- `consolidated_state_dict(to=r)` (collective) returns, on rank r, exactly what the unwrapped optimizer's
  `state_dict()` would: per-parameter state indexed over the original param groups, so the file also loads into
  a plain `torch.optim.AdamW`. `load_state_dict` takes that format on any number of ranks: each rank keeps its
  slice (2 ranks -> 3 ranks works).
- `sharded_state_dict()` / `load_sharded_state_dict()`: this rank's shard only, for the same number of ranks.
- `state_dict()` raises: on one rank it could only return a shard, which would silently lose the rest.

A state value is per element when it is a tensor of the shard parameter's shape (Adam's moments); anything else
(Adam's `step`) is taken as one value for the whole shard, equal on every rank."""

from __future__ import annotations

from typing import Any

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import runtime
from hvdplus.torch.mpi_ops import _dtype_name, _numpy

__all__ = ["ZeroStateDicts"]


def _per_element(value: Any, shard: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == shard.shape


class ZeroStateDicts:
    """Checkpoint methods of ZeroOptimizer (a mixin: `self._zero` is its `_Shards`)."""

    _zero: Any
    _zero_original_groups: list[list[torch.Tensor]]

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("a ZeroOptimizer holds 1/N of the state on each rank: call "
                           "optimizer.consolidated_state_dict(to=0) on every rank (the whole state in the wrapped "
                           "optimizer's format, on rank 0), or optimizer.sharded_state_dict() for this rank's shard")

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (no parameters), for `load_sharded_state_dict` at the same N."""
        z = self._zero
        return {"optimizer": super().state_dict(),  # type: ignore[misc]
                "zero": {"size": z.size, "rank": z.index, "totals": [part.total for part in z.plan]}}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `sharded_state_dict()` returned on this rank, with the same number of ranks and parameters."""
        z = self._zero
        expected = {"size": z.size, "rank": z.index, "totals": [part.total for part in z.plan]}
        if not isinstance(state_dict, dict) or state_dict.get("zero") != expected:
            found = state_dict.get("zero") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"this sharded state was saved for {found}, but this optimizer is {expected}; use "
                             f"consolidated_state_dict()/load_state_dict() to change the number of ranks")
        super().load_state_dict(state_dict["optimizer"])  # type: ignore[misc]

    def consolidated_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state, in the wrapped optimizer's own `state_dict` format, on global rank `to`
        (None on the other ranks).

        Collective: every rank in the process set must call this."""
        z = self._zero
        to = core.check_root(to, z.process_set)
        shards = [(k, group, start, end, self.state.get(param, {}))  # type: ignore[attr-defined]
                  for (k, group, start, end), param in zip(z.shards, z.shard_params)]
        described = [(k, start, end, {key: (str(v.dtype) if _per_element(v, param) else v)
                                      for key, v in state.items()})
                     for (k, _, start, end, state), param in zip(shards, z.shard_params)]
        everyone = core.allgather_object(described, name=f"ZeroOptimizer.state.{z.names[0]}",
                                         process_set=z.process_set)
        full = self._gather_flat_state(shards, everyone)
        if runtime().rank != to:
            return None
        entries = {(k, start, end): listed for k, start, end, listed in (e for shard in everyone for e in shard)}
        state, index = {}, 0
        groups = []
        for options, originals in zip(self.param_groups, self._zero_original_groups):  # type: ignore[attr-defined]
            indices = []
            for param in originals:
                i = next((j for j, p in enumerate(z.params) if p is param), None)
                if i is not None:
                    entry = self._consolidated_entry(i, full, entries)
                    if entry:
                        state[index] = entry
                indices.append(index)
                index += 1
            groups.append(dict({k: v for k, v in options.items() if k != "params"}, params=indices))
        return {"state": state, "param_groups": groups}

    def _gather_flat_state(self, shards: list, everyone: list) -> dict[tuple[int, str], torch.Tensor]:
        """{(partition, key): the whole flat per-element state}, allgathered with the partition's counts."""
        z = self._zero
        kinds: dict[tuple[int, str], str] = {}
        for k, _, _, entries in (entry for listed in everyone for entry in listed):
            kinds.update({(k, key): v for key, v in entries.items() if isinstance(v, str)})
        full = {}
        for (k, key), dtype in sorted(kinds.items()):
            dtype = getattr(torch, dtype.replace("torch.", ""))
            parts = [state[key].reshape(-1) if key in state else torch.zeros(end - start, dtype=dtype)
                     for kk, _, start, end, state in shards if kk == k]
            mine = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)
            out = torch.empty(z.plan[k].total, dtype=dtype)
            core.submit_allgather(_numpy(mine.contiguous()), _dtype_name(out), f"ZeroOptimizer.state.{k}.{key}",
                                  process_set=z.process_set, counts=z.plan[k].counts, output=_numpy(out)).wait()
            full[(k, key)] = out
        return full

    def _consolidated_entry(self, i: int, full: dict, entries: dict) -> dict[str, Any]:
        """Parameter i's state, cut out of the flat state; scalars from the shard holding its first element
        (empty if that shard has no state yet)."""
        z = self._zero
        k, offset = z.where[i]
        param = z.params[i]
        owner = next((listed for (kk, start, end), listed in entries.items() if kk == k and start <= offset < end), {})
        entry = {key: v for key, v in owner.items() if not isinstance(v, str)}
        for key in (key for key, v in owner.items() if isinstance(v, str)):
            entry[key] = full[(k, key)][offset:offset + param.numel()].view_as(param).clone()
        return entry

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (`consolidated_state_dict`, or a plain optimizer's `state_dict()` over the
        same parameters) saved with any number of ranks; each rank keeps its slice. Checked before anything
        changes: ValueError if the groups, parameter counts or state shapes do not match."""
        z = self._zero
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or "state" not in state_dict:
            raise ValueError("load_state_dict takes a consolidated state dict ({'state': ..., 'param_groups': ...}); "
                             "use load_sharded_state_dict() for what sharded_state_dict() returned")
        originals = self._zero_original_groups
        if [len(g["params"]) for g in saved_groups] != [len(g) for g in originals]:
            raise ValueError(f"the state dict has param groups of {[len(g['params']) for g in saved_groups]} "
                             f"parameters, but this optimizer's are {[len(g) for g in originals]}")
        by_param = {}
        for saved, params in zip(saved_groups, originals):
            for index, param in zip(saved["params"], params):
                by_param[param] = state_dict["state"].get(index, {})
        for i, param in enumerate(z.params):
            for key, value in by_param[param].items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(f"state {key!r} of parameter {z.names[i]!r} has shape {tuple(value.shape)}, "
                                     f"but the parameter's is {tuple(param.shape)}")
        position = {p: n for n, p in enumerate(p for g in self.param_groups for p in g["params"])}  # type: ignore
        sharded = {}
        for shard, (k, _, start, end) in zip(z.shard_params, z.shards):
            pieces = z.plan[k].pieces(start, end)
            first = by_param[z.params[pieces[0].param]]
            entry = {key: v for key, v in first.items() if not (torch.is_tensor(v) and v.dim() > 0)}
            for key in (key for key, v in first.items() if torch.is_tensor(v) and v.dim() > 0):
                entry[key] = torch.cat([by_param[z.params[p.param]][key].reshape(-1)[p.start:p.start + p.length]
                                        for p in pieces]).view(shard.shape)
            if entry:
                sharded[position[shard]] = entry
        groups = [dict({k: v for k, v in saved.items() if k != "params"},
                       params=[position[p] for p in current["params"]])
                  for saved, current in zip(saved_groups, self.param_groups)]  # type: ignore[attr-defined]
        super().load_state_dict({"state": sharded, "param_groups": groups})  # type: ignore[misc]
