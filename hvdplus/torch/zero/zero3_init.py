"""Building a ZeRO-3 model's shards: materialising a meta-device model one unit at a time, and checking that every
rank starts from the same parameters (zero3.py's `shard_parameters` calls these).

A model built on the meta device is materialised unit by unit, directly on the device the shards live on: each
module's meta parameters get real twins (registered wherever the meta ones were, ties kept) just before the
module initialises them, and a unit's are freed as soon as it has kept its shards, so the whole model never
exists at once, in host or in device memory. Modules are initialised children first (their
`reset_parameters()`, or the `init` given), the order in which a normally built model drew them from the random
generator, so each rank keeps exactly its slice of the values a normal build with the same seed makes. A
parameter tied after construction (an output layer sharing the embedding's weight) gets a scratch stand-in while
the second module initialises, so that its draws are made and dropped as in a normal build. A buffer built on the
meta device must be set when its module initialises (by `init`, `reset_parameters()` or `reset_running_stats()`,
in place, through `.data` or by assignment): anything else raises, naming it, instead of leaving uninitialised
memory."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, runtime
from hvdplus.common.control.negotiation import disagreement
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.plans.sharding import parameter_mismatch
from hvdplus.torch.buffers import as_numpy, host_tensor
from hvdplus.torch.zero.zero3_units import Unit

__all__ = ["meta_parameters", "default_init", "materialize", "check_same_everywhere"]

Places = dict[int, list[tuple[torch.nn.Module, str]]]


def meta_parameters(model: torch.nn.Module) -> Places:
    """{id(meta parameter): every (module, name) it is registered at}; empty for a model with none."""
    places: Places = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                places.setdefault(id(p), []).append((module, name))
    return places


def default_init(module: torch.nn.Module) -> None:
    """Initialise a meta-built module's own parameters with its `reset_parameters()` (or `_reset_parameters()`);
    its meta-built buffers must be set there too, or by `reset_running_stats()` (materialize checks)."""
    for method in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, method, None)):
            getattr(module, method)()
            return
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"module {type(module).__name__} was built on the meta device but has no "
            f"reset_parameters(): pass init= to hvd.shard_parameters to initialise its parameters"
        )


def _with_marker(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A meta buffer's real twin, filled with a value no initialisation writes (NaN; an integer dtype's least), so
    that a write through `.data`, which bumps no version counter, still shows (a bool buffer: its version only)."""
    if buffer.dtype.is_floating_point or buffer.dtype.is_complex:
        return torch.full_like(buffer, float("nan"), device=device)
    if buffer.dtype == torch.bool:
        return torch.zeros_like(buffer, device=device)
    return torch.full_like(buffer, torch.iinfo(buffer.dtype).min, device=device)


def _holds_marker(buffer: torch.Tensor) -> bool:
    if buffer.dtype.is_floating_point or buffer.dtype.is_complex:
        return bool(buffer.isnan().all())
    if buffer.dtype == torch.bool:
        return True
    return bool((buffer == torch.iinfo(buffer.dtype).min).all())


def _unset(module: torch.nn.Module, fresh: dict[str, torch.Tensor]) -> list[str]:
    """The names of `fresh` buffers (from `_with_marker`) that nothing wrote or replaced yet."""
    return [
        name
        for name, buffer in fresh.items()
        if module._buffers.get(name) is buffer and buffer._version == 0 and buffer.numel() and _holds_marker(buffer)
    ]


def _check_buffers_set(module: torch.nn.Module, fresh: dict[str, torch.Tensor], path: str) -> None:
    """After `module` initialised: its meta-built buffers hold values, else ValueError naming them. Running
    statistics are set by `reset_running_stats()` where the initialisation left them."""
    unset = _unset(module, fresh)
    reset_running_stats = getattr(module, "reset_running_stats", None)
    if unset and callable(reset_running_stats):
        reset_running_stats()
        unset = _unset(module, fresh)
    if unset:
        names = ", ".join(repr(f"{path}.{name}" if path else name) for name in unset)
        raise ValueError(
            f"buffer {names} of {type(module).__name__} was built on the meta device, and neither init= nor its "
            f"reset_parameters() or reset_running_stats() set it: it would hold uninitialised memory. Set it in "
            f"the init= function given to hvd.shard_parameters (in place, through .data, or by assignment, e.g. "
            f"computing a rotary inv_freq there), or build that module outside the meta device."
        )


def _digest(p: torch.Tensor) -> bytes:
    """16 bytes of the parameter's values (a device parameter's through a host copy of it alone)."""
    return hashlib.blake2b(as_numpy(host_tensor(p.detach().contiguous().reshape(-1))).data, digest_size=16).digest()


def materialize(
    model: torch.nn.Module,
    units: list[Unit],
    unit_names: dict[torch.nn.Module, str],
    init: Callable[[torch.nn.Module], None],
    places: Places,
    device: torch.device,
) -> dict[str, list[bytes]]:
    """Cut every unit's shards out of its whole parameters and release it; returns {unit: digests of its
    parameters}. Meta parameters (at `places`) are materialised on `device` one unit at a time: modules
    initialised children first, the order in which a normal build draws them from the random generator; the
    units' parameter lists then hold the twins."""
    by_name = {u.name: u for u in units}
    by_module = {m: by_name[n] for m, n in unit_names.items() if n in by_name}
    digests: dict[str, list[bytes]] = {}
    twins: dict[int, torch.nn.Parameter] = {}

    def settle(unit: Unit) -> None:
        unit.params = [twins.get(id(p), p) for p in unit.params]
        digests[unit.name] = [_digest(p) for p in unit.params]
        unit.take_own_slices()
        if unit.persistent:
            unit.fill_from_parameters()
        else:  # empty until the first gather
            unit.empty_parameters()

    done: set[int] = set()
    paths = {id(m): path for path, m in model.named_modules()}

    def initialise(module: torch.nn.Module) -> None:
        """init(module); a parameter an earlier module already initialised (a tie made after construction)
        gets a scratch stand-in, so that the draws are made and dropped as a normal build's were."""
        fresh = {}
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = fresh[name] = _with_marker(buffer, device)
        for p in list(module._parameters.values()):
            if p is not None and p.is_meta and id(p) in places:
                twin = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                for owner, name in places.pop(id(p)):
                    owner._parameters[name] = twin
                twins[id(p)] = twin
        tied = {name: p for name, p in module._parameters.items() if p is not None and id(p) in done}
        for name, p in tied.items():
            module._parameters[name] = torch.nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
        init(module)
        module._parameters.update(tied)
        done.update(id(p) for p in module.parameters(recurse=False))
        _check_buffers_set(module, fresh, paths[id(module)])

    visited: set[int] = set()

    def walk(module: torch.nn.Module) -> None:
        if id(module) in visited:  # a module registered at two paths is initialised once
            return
        visited.add(id(module))
        unit = by_module.get(module)
        for child in module.children():
            walk(child)
        initialise(module)
        if unit is not None:
            settle(unit)

    if places:
        for child in model.children():
            walk(child)
        initialise(model)
    for unit in units:
        if unit.name not in digests:
            settle(unit)
    return digests


def check_same_everywhere(
    units: list[Unit],
    digests: dict[str, list[bytes]],
    process_set: ProcessSet,
    device: torch.device,
    buffers: list[tuple[str, torch.Tensor]],
) -> None:
    """CollectiveMismatchError on every rank if the ranks shard on different kinds of device, or if their
    parameters (or the model's `buffers`) differ in names, shapes, dtypes or values."""
    mine = [
        (name, tuple(shape), str(p.dtype), digest)
        for u in units
        for name, shape, p, digest in zip(u.names, u.shapes, u.params, digests[u.name])
    ]
    mine += [(f"buffer {name}", tuple(b.shape), str(b.dtype), _digest(b)) for name, b in buffers]
    gathered = core.allgather_object((device.type, mine), name="shard_parameters.check", process_set=process_set)
    ranks = process_set.ranks or list(range(runtime().size))
    kinds = {rank: kind for rank, (kind, _) in zip(ranks, gathered)}
    if len(set(kinds.values())) > 1:
        raise CollectiveMismatchError(
            f"hvd.shard_parameters needs the same kind of device on every rank, but {disagreement(kinds)}: "
            f"pass the same kind of device= (or move the model to it) on every rank."
        )
    everyone = [listed for _, listed in gathered]
    structure = parameter_mismatch([[entry[:3] for entry in listed] for listed in everyone], ranks)
    if structure:
        raise CollectiveMismatchError(structure)
    for position, (name, *_rest) in enumerate(mine):
        values = {rank: listed[position][3].hex()[:12] for rank, listed in zip(ranks, everyone)}
        if len(set(values.values())) > 1:
            what = f"Buffer {name.removeprefix('buffer ')!r}" if name.startswith("buffer ") else f"Parameter {name!r}"
            raise CollectiveMismatchError(
                f"{what} differs between ranks at hvd.shard_parameters (digests: "
                f"{disagreement(values)}): broadcast the parameters from one rank first "
                f"(hvd.broadcast_parameters), or build the model with the same seed on every rank."
            )
