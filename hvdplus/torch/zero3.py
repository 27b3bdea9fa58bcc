"""ZeRO-3 in Horovod's API: `hvd.shard_parameters(model, units=...)` keeps 1/N of every parameter on each rank.

Why this API: a Horovod user wraps what they already have. `shard_parameters` shards the model in place and
returns it (as FSDP2's `fully_shard` does), so model code, parameter names, `state_dict` keys and param groups
stay the user's; `hvd.ZeroOptimizer` over its parameters then steps the shards (zero.py). It is one call for the
whole model, not one per module, because the units must be known together: which unit owns a parameter that two
modules share, the order in which prefetch gathers them, and one positional name sequence for all ranks.

A unit is a module (chosen by class, by a predicate, or listed) whose parameters, flattened per (dtype,
trainable), are split evenly over the process set (common/sharding.py). Parameters that no unit owns, or that
modules of several units share (an embedding tied to the output layer), belong to the enclosing unit, the root
(the model itself), which stays gathered from the model's forward to the end of its backward. Parameters of at
most `persist_below` elements stay whole on every rank (DeepSpeed's `param_persistence_threshold`).

Between uses a parameter's `.data` is an empty tensor. Before a unit's forward its shards are allgathered into
one flat buffer per dtype and the parameters become views of it; after the forward the buffer's storage is
released (`reshard_after_forward`), so that tensors autograd saved stay valid views that the gather before the
unit's backward (hooked on its outputs) fills again. The next units are prefetched with non-blocking gathers,
in forward order and then in reverse, at most `max_live_units` at once. Gradients are reduce-scattered as each
unit's backward completes (zero.py), after which the unit releases its buffer.

Every gather and reduce-scatter of a pass takes the next positional name ("zero3.<n>"), tagged with its unit:
ranks that run units in different orders, or skip one, meet a different unit, kind or size under one name and
fail on every rank at once (a CollectiveMismatchError naming both units) instead of waiting or mixing them.

Construction without the whole model: a model built on the `meta` device is materialised one unit at a time,
initialising modules children first (their `reset_parameters()`), the order in which a normally built model
drew them, so each rank keeps the same slice of the same values as a model built normally with the same seed.
"""

from __future__ import annotations

import ctypes
import hashlib
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set, runtime
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.negotiation import disagreement
from hvdplus.common.sharding import DtypePartition, parameter_mismatch, partition
from hvdplus.torch.mpi_ops import _dtype_name, _numpy

__all__ = ["shard_parameters", "gathered_parameters", "ShardedModel", "Unit", "sharded_model_of", "add_gradient"]

UnitChoice = Sequence[type] | Callable[[str, torch.nn.Module], bool] | Sequence[torch.nn.Module] | None


class Unit:
    """The parameters one module owns, flattened per (dtype, trainable) and split over the ranks."""

    def __init__(self, name: str, module: torch.nn.Module | None, named: list[tuple[str, torch.nn.Parameter]],
                 size: int, index: int, param_dtype: torch.dtype | None, persistent: bool) -> None:
        self.name, self.module, self.persistent = name, module, persistent
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.plan: list[DtypePartition] = partition([p.numel() for p in self.params],
                                                    [(p.dtype, p.requires_grad) for p in self.params], size)
        self.index = index
        self.shards = [torch.empty(part.counts[index], dtype=part.kind[0]) for part in self.plan]
        compute = [param_dtype if param_dtype is not None and part.kind[0].is_floating_point else part.kind[0]
                   for part in self.plan]
        self.full = [torch.empty(part.total, dtype=dtype) for part, dtype in zip(self.plan, compute)]
        for buffer in self.full:  # never touched: no page of it was resident
            buffer.untyped_storage().resize_(0)
        self.gathered = False
        self.pending: list[Any] = []  # (handle, sent) of a gather in flight
        self.expected_shape: dict[int, torch.Size] = {}

    @property
    def is_root(self) -> bool:
        return self.name == ShardedModel.ROOT

    def nbytes(self) -> int:
        """Bytes of this rank's shards."""
        return sum(s.numel() * s.element_size() for s in self.shards)

    def fill_from_parameters(self) -> None:
        """Copy the parameters' current (whole) values into `full`, and point the parameters at it."""
        for buffer in self.full:
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                for i, offset, numel in zip(part.params, part.offsets, part.numels):
                    self.full[k][offset:offset + numel].copy_(self.params[i].detach().reshape(-1))
        self.point_at_full()

    def point_at_full(self) -> None:
        """Make the parameters views of `full`, with the gradients they held when released."""
        for k, part in enumerate(self.plan):
            for i, offset, numel in zip(part.params, part.offsets, part.numels):
                p = self.params[i]
                p.data = self.full[k][offset:offset + numel].view(self.shapes[i])
                p.grad = getattr(p, "_hvdplus_released_grad", None)
                p._hvdplus_released_grad = None  # type: ignore[attr-defined]
        self.gathered = True

    def take_own_slices(self) -> None:
        """Copy this rank's range of the parameters' whole values (in their own dtype) into the shards."""
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                start, end = part.shard(self.index)
                for piece in part.pieces(start, end):
                    source = self.params[piece.param].detach().reshape(-1)[piece.start:piece.start + piece.length]
                    self.shards[k][piece.offset - start:piece.offset - start + piece.length].copy_(source)

    def keep_own_slices(self) -> None:
        """Copy this rank's range of `full` into the shards (after `full` holds the whole unit)."""
        with torch.no_grad():
            for k, part in enumerate(self.plan):
                start, end = part.shard(self.index)
                self.shards[k].copy_(self.full[k][start:end])

    def release(self) -> None:
        """Free the gathered buffer: the parameters become empty tensors, the storage is resized to 0 (views that
        autograd saved stay valid and see the next gather)."""
        if self.persistent or not self.gathered:
            return
        for p in self.params:
            p._hvdplus_released_grad, p.grad = p.grad, None  # type: ignore[attr-defined]
            p.data = _empty(p.dtype)  # the compute dtype: p.data is a view of `full` until now
        for buffer in self.full:
            buffer.untyped_storage().resize_(0)
        self.gathered = False

    def start_gather(self, positions: Callable[[], int], process_set: ProcessSet) -> None:
        """Allgather every rank's shards into `full` (non-blocking; `finish_gather` waits), each partition under
        the next positional name."""
        for k, part in enumerate(self.plan):
            buffer = self.full[k]
            buffer.untyped_storage().resize_(part.total * buffer.element_size())
            sent = self.shards[k] if self.shards[k].dtype == buffer.dtype else self.shards[k].to(buffer.dtype)
            handle = core.submit_allgather(_numpy(sent), _dtype_name(buffer), f"zero3.{positions()}",
                                           process_set=process_set, counts=part.counts,
                                           output=_unguarded_numpy(buffer),
                                           tag=f"gather of unit {self.name!r}")
            self.pending.append((handle, sent))

    def finish_gather(self) -> None:
        pending, self.pending = self.pending, []
        for handle, _ in pending:
            handle.wait()
        self.point_at_full()


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def add_gradient(p: torch.Tensor, grad: torch.Tensor) -> None:
    """p.grad += grad outside autograd (a pipeline's earlier micro-batches), also while `p` is a released ZeRO-3
    parameter: its gradient then waits beside it until the unit is gathered again."""
    with torch.no_grad():
        if getattr(p, "_hvdplus_zero3", None) is not None and p.numel() != grad.numel():
            held = getattr(p, "_hvdplus_released_grad", None)
            p._hvdplus_released_grad = grad if held is None else held.add_(grad)  # type: ignore[attr-defined]
        elif p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)


def _unguarded_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor that leaves its storage resizable (`Tensor.numpy()` pins it
    for good). Only for buffers whose storage stays put while the view is in use: a gather in flight."""
    kind = _numpy(torch.empty(0, dtype=tensor.dtype)).dtype
    raw = (ctypes.c_byte * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return np.frombuffer(raw, dtype=kind)


class ShardedModel:
    """The units of one sharded model and the hooks that gather and release them (`model._hvdplus_zero3`)."""

    ROOT, PERSISTENT = "<root>", "<persistent>"

    def __init__(self, model: torch.nn.Module, units: list[Unit], process_set: ProcessSet,
                 reshard_after_forward: bool, prefetch: int, max_live_units: int,
                 reduce_dtype: torch.dtype | None) -> None:
        self.model, self.units, self.process_set = model, units, process_set
        self.reshard_after_forward, self.prefetch, self.max_live_units = reshard_after_forward, prefetch, max_live_units
        self.reduce_dtype = reduce_dtype
        self.position = 0
        self.order: list[Unit] = []  # units in the order the last pass's forward ran them
        self.current: list[Unit] = []
        self.end_of_backward_queued = False
        self.gradients: Any = None  # the ZeroOptimizer's shards, once one is wrapped around these parameters
        self.unit_of = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}

    # ------------------------------------------------------------------ names
    def next_position(self) -> int:
        self.position += 1
        return self.position - 1

    # ------------------------------------------------------------------ forward
    def begin_pass(self) -> None:
        """The model's forward starts: finish what is in flight and restart the positional names."""
        for unit in self.units:
            if unit.pending:
                unit.finish_gather()
        if self.gradients is not None:
            self.gradients.finish_in_flight()
        self.position = 0
        if self.current:
            self.order = self.current
        self.current = []

    def gather(self, unit: Unit) -> None:
        """Make `unit`'s parameters whole (waiting for its prefetch if one is in flight). Collective."""
        if unit.gathered:
            return
        if not unit.pending:
            unit.start_gather(self.next_position, self.process_set)
        unit.finish_gather()

    def live(self) -> int:
        return sum(1 for u in self.units if (u.gathered or u.pending) and not u.persistent and not u.is_root)

    def prefetch_from(self, order: list[Unit], after: int) -> None:
        """Start gathering the next `prefetch` units of `order` after index `after`, within max_live_units."""
        for unit in order[after + 1:after + 1 + self.prefetch]:
            if unit.gathered or unit.pending or unit.persistent:
                continue
            if self.live() >= self.max_live_units:
                return
            unit.start_gather(self.next_position, self.process_set)

    def before_forward(self, unit: Unit) -> None:
        self.current.append(unit)
        self.gather(unit)
        j = len(self.current) - 1
        if j < len(self.order) and self.order[j] is unit:
            self.prefetch_from(self.order, j)

    def after_forward(self, unit: Unit | None, output: Any) -> None:
        """After a unit's forward (None: the model's, which has no root unit): hook the backward's start on the
        outputs, and release what the backward will gather again (everything, for a forward without one)."""
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        needs_backward = torch.is_grad_enabled() and bool(outputs)
        if needs_backward and unit is not None:
            for tensor in outputs:
                tensor.register_hook(lambda grad, unit=unit: self.before_backward(unit) or grad)
        if unit is None or unit.is_root:
            if not needs_backward:  # inference: nothing stays gathered
                self.begin_pass()
                self.release_all()
        elif self.reshard_after_forward or not needs_backward:
            unit.release()

    # ------------------------------------------------------------------ backward
    def before_backward(self, unit: Unit) -> None:
        """A gradient reached one of `unit`'s outputs: gather it (again) and prefetch the next in reverse order.
        Idempotent, as a unit with several outputs calls it once per output."""
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        self.gather(unit)
        backward_order = [u for u in reversed(self.current) if not u.is_root]
        if unit.is_root:
            self.prefetch_from(backward_order, -1)
        elif unit in backward_order:
            self.prefetch_from(backward_order, backward_order.index(unit))

    def gradients_sent(self, unit: Unit) -> None:
        """zero.py started the reduce-scatter of every trainable partition of `unit`: its buffer can go, unless
        it has frozen parameters, which a later part of the backward may still need (released at its end)."""
        if all(p.requires_grad for p in unit.params):
            unit.release()

    def end_of_backward(self) -> None:
        self.end_of_backward_queued = False
        self.release_all()

    def release_all(self) -> None:
        for unit in self.units:
            if unit.pending:
                unit.finish_gather()
            unit.release()


def sharded_model_of(params: Iterable[torch.Tensor]) -> ShardedModel | None:
    """The ShardedModel that owns these parameters, if `shard_parameters` sharded them."""
    found = {id(getattr(p, "_hvdplus_zero3")): getattr(p, "_hvdplus_zero3") for p in params
             if hasattr(p, "_hvdplus_zero3")}
    if len(found) > 1:
        raise ValueError("the parameters belong to several models sharded by hvd.shard_parameters; wrap one "
                         "ZeroOptimizer per sharded model")
    return next(iter(found.values()), None)


# ---------------------------------------------------------------------- choosing units
def _unit_modules(model: torch.nn.Module, units: UnitChoice) -> dict[torch.nn.Module, str]:
    """{module: its name} of the modules chosen as units (the model itself is the root, always a unit)."""
    named = list(model.named_modules())
    if units is None:
        chosen = []
    elif callable(units) and not isinstance(units, (list, tuple)):
        chosen = [m for n, m in named if n and units(n, m)]
    else:
        listed = list(units)
        if all(isinstance(u, type) for u in listed):
            chosen = [m for n, m in named if n and isinstance(m, tuple(listed))]
        elif all(isinstance(u, torch.nn.Module) for u in listed):
            mine = {id(m) for _, m in named}
            strangers = [type(u).__name__ for u in listed if id(u) not in mine]
            if strangers:
                raise ValueError(f"units must be modules of the model; {strangers} are not")
            chosen = [u for u in listed if u is not model]
        else:
            raise TypeError("units must be a list of module classes, a list of the model's modules, or a "
                            "function (name, module) -> bool")
    names = {id(m): n for n, m in named}
    return {m: names[id(m)] for m in chosen}


def _owners(model: torch.nn.Module, unit_names: dict[torch.nn.Module, str]) -> dict[int, tuple[str, str, Any]]:
    """{id(parameter): (unit name, parameter name, parameter)}: the innermost unit above the module that holds
    it, or the units' deepest common ancestor (the root at worst) when modules of several units share it."""
    chains: dict[int, list[list[str]]] = {}
    first_name: dict[int, tuple[str, Any]] = {}

    def walk(module: torch.nn.Module, prefix: str, chain: list[str]) -> None:
        if module in unit_names and module is not model:
            chain = chain + [unit_names[module]]
        for name, p in module.named_parameters(recurse=False):
            chains.setdefault(id(p), []).append(chain)
            first_name.setdefault(id(p), (f"{prefix}{name}", p))
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.", chain)

    walk(model, "", [])
    owners = {}
    for key, found in chains.items():
        common = found[0]
        for chain in found[1:]:
            n = 0
            while n < min(len(common), len(chain)) and common[n] == chain[n]:
                n += 1
            common = common[:n]
        owners[key] = (common[-1] if common else ShardedModel.ROOT, *first_name[key])
    return owners


# ---------------------------------------------------------------------- building
def shard_parameters(model: torch.nn.Module, units: UnitChoice = None, *,
                     process_set: ProcessSet = global_process_set, reshard_after_forward: bool = True,
                     prefetch: int = 1, max_live_units: int = 2, persist_below: int = 0,
                     param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                     init: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """Shard `model`'s parameters over `process_set` (ZeRO-3) in place and return it; wrap its parameters with
    `hvd.ZeroOptimizer` to train it.

    `units`: module classes (every module of those types), a list of the model's modules, or a function
    `(name, module) -> bool`; the model itself is always the root unit. `reshard_after_forward`: free a unit's
    gathered parameters after its forward (False keeps them until its backward: less traffic, more memory).
    `prefetch`: units gathered ahead; `max_live_units`: at most this many units (root and persistent ones
    aside) gathered at once. `persist_below`: parameters of at most this many elements stay whole on every rank.
    `param_dtype`: the dtype floating parameters are gathered and computed in (e.g. torch.bfloat16; the shards
    the optimizer steps keep theirs); `reduce_dtype`: the dtype gradients are reduce-scattered in (default:
    `param_dtype`'s). `init(module)`: how a module built on the meta device initialises its own parameters
    (default: its `reset_parameters()` or `_reset_parameters()`).

    Collective: every rank of the set must call this with the same model structure; parameters that differ
    between ranks raise CollectiveMismatchError on every rank, naming the parameter and the ranks."""
    if hasattr(model, "_hvdplus_zero3"):
        raise ValueError("this model is already sharded by hvd.shard_parameters")
    if not process_set.included():
        raise ValueError(f"this rank ({runtime().rank}) is not in {process_set}: only its members can shard a "
                         f"model over it")
    if prefetch < 0 or max_live_units < 1:
        raise ValueError(f"prefetch must be >= 0 and max_live_units >= 1, got {prefetch} and {max_live_units}")
    for name, p in model.named_parameters():
        if p.device.type not in ("cpu", "meta"):
            raise ValueError(f"hvd.shard_parameters shards CPU (or meta) parameters only; {name!r} is on {p.device}")
    size, index = process_set.size(), process_set.rank()
    meta = _replace_meta_parameters(model)
    unit_names = _unit_modules(model, units)
    owners = _owners(model, unit_names)
    by_unit: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for unit_name, param_name, p in owners.values():
        key = ShardedModel.PERSISTENT if p.numel() <= persist_below else unit_name
        by_unit.setdefault(key, []).append((param_name, p))
    modules = {name: module for module, name in unit_names.items()}
    modules[ShardedModel.ROOT] = model
    order = [ShardedModel.ROOT] + [n for n in modules if n != ShardedModel.ROOT] + [ShardedModel.PERSISTENT]
    built = [Unit(name, modules.get(name), by_unit[name], size, index, param_dtype, name == ShardedModel.PERSISTENT)
             for name in order if name in by_unit]
    digests = _materialize(model, built, unit_names, init or _default_init, meta)
    _check_same_everywhere(built, digests, process_set)
    sharded = ShardedModel(model, built, process_set, reshard_after_forward, prefetch, max_live_units,
                           reduce_dtype if reduce_dtype is not None else param_dtype)
    for unit in built:
        for p in unit.params:
            p._hvdplus_zero3 = sharded  # type: ignore[attr-defined]
    model._hvdplus_zero3 = sharded  # type: ignore[assignment]
    _register_hooks(sharded)
    return model


def _replace_meta_parameters(model: torch.nn.Module) -> bool:
    """Give every meta parameter an uninitialised CPU twin, registered wherever the meta one was (ties kept).
    Its memory is only reserved: no page is touched until a unit's initialisation writes it, and the unit
    frees it right after keeping its shard. Returns whether there were meta parameters."""
    twins: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in twins:
                    twins[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = twins[id(p)]
    return bool(twins)


def _default_init(module: torch.nn.Module) -> None:
    for method in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, method, None)):
            getattr(module, method)()
            return
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"module {type(module).__name__} was built on the meta device but has no "
                         f"reset_parameters(): pass init= to hvd.shard_parameters to initialise its parameters")


def _digest(p: torch.Tensor) -> bytes:
    return hashlib.blake2b(_numpy(p.detach().contiguous().reshape(-1)).tobytes(), digest_size=16).digest()


def _materialize(model: torch.nn.Module, units: list[Unit], unit_names: dict[torch.nn.Module, str],
                 init: Callable[[torch.nn.Module], None], meta: bool) -> dict[str, list[bytes]]:
    """Cut every unit's shards out of its whole parameters and release it; returns {unit: digests of its
    parameters}. Meta parameters are materialised one unit at a time: modules initialised children first, the
    order in which a normal build draws them from the random generator."""
    by_name = {u.name: u for u in units}
    by_module = {m: by_name[n] for m, n in unit_names.items() if n in by_name}
    digests: dict[str, list[bytes]] = {}

    def settle(unit: Unit) -> None:
        digests[unit.name] = [_digest(p) for p in unit.params]
        unit.take_own_slices()
        if unit.persistent:
            unit.fill_from_parameters()
        else:  # empty until the first gather, in the dtype a gather will give them
            for k, part in enumerate(unit.plan):
                for i in part.params:
                    unit.params[i].data = _empty(unit.full[k].dtype)

    done: set[int] = set()

    def initialise(module: torch.nn.Module) -> None:
        """init(module); a parameter an earlier module already initialised (a tie made after construction)
        gets a scratch stand-in, so that the draws are made and dropped as a normal build's were."""
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
        tied = {name: p for name, p in module._parameters.items() if p is not None and id(p) in done}
        for name, p in tied.items():
            module._parameters[name] = torch.nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
        init(module)
        module._parameters.update(tied)
        done.update(id(p) for p in module.parameters(recurse=False))

    def walk(module: torch.nn.Module) -> None:
        unit = by_module.get(module)
        for child in module.children():
            walk(child)
        initialise(module)
        if unit is not None:
            settle(unit)

    if meta:
        for child in model.children():
            walk(child)
        initialise(model)
    for unit in units:
        if unit.name not in digests:
            settle(unit)
    return digests


def _check_same_everywhere(units: list[Unit], digests: dict[str, list[bytes]], process_set: ProcessSet) -> None:
    """CollectiveMismatchError on every rank if the ranks' parameters differ in names, shapes, dtypes or values."""
    mine = [(name, tuple(shape), str(p.dtype), digest) for u in units
            for name, shape, p, digest in zip(u.names, u.shapes, u.params, digests[u.name])]
    everyone = core.allgather_object(mine, name="shard_parameters.check", process_set=process_set)
    ranks = process_set.ranks or list(range(runtime().size))
    structure = parameter_mismatch([[entry[:3] for entry in listed] for listed in everyone], ranks)
    if structure:
        raise CollectiveMismatchError(structure)
    for position, (name, *_rest) in enumerate(mine):
        values = {rank: listed[position][3].hex()[:12] for rank, listed in zip(ranks, everyone)}
        if len(set(values.values())) > 1:
            raise CollectiveMismatchError(
                f"Parameter {name!r} differs between ranks at hvd.shard_parameters (digests: "
                f"{disagreement(values)}): broadcast the parameters from one rank first "
                f"(hvd.broadcast_parameters), or build the model with the same seed on every rank.")


def _register_hooks(sharded: ShardedModel) -> None:
    root = next((u for u in sharded.units if u.is_root), None)

    def before_model(_module: torch.nn.Module, _args: Any) -> None:
        sharded.begin_pass()
        if root is not None:
            sharded.before_forward(root)

    def after_model(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        sharded.after_forward(root, output)

    sharded.model.register_forward_pre_hook(before_model)
    sharded.model.register_forward_hook(after_model)
    for unit in sharded.units:
        if unit.module is not None and not unit.is_root and not unit.persistent:
            unit.module.register_forward_pre_hook(lambda _m, _a, unit=unit: sharded.before_forward(unit))
            unit.module.register_forward_hook(lambda _m, _a, out, unit=unit: sharded.after_forward(unit, out))


@contextmanager
def gathered_parameters(module: torch.nn.Module, modify: bool = False, rank0_only: bool = False) -> Iterator[None]:
    """Inside the block, the parameters of `module` (a sharded model or any of its modules) are whole tensors.

    `modify=True`: what the block writes into them is kept (each rank keeps its own slice of its own values, so
    change them the same way on every rank; under `torch.no_grad()`, as for any in-place change of a parameter).
    `rank0_only=True`: only global rank 0 keeps the gathered values; the other ranks release them at once (the
    gather itself is collective, as in FSDP's `summon_full_params(rank0_only=True)`). Units a running forward
    holds are left gathered. Collective: every rank of the set enters it."""
    sharded = sharded_model_of(module.parameters())
    if sharded is None:
        raise ValueError("gathered_parameters needs a model sharded by hvd.shard_parameters")
    wanted = {id(p) for p in module.parameters()}
    units = [u for u in sharded.units if any(id(p) in wanted for p in u.params)]
    keep = not rank0_only or runtime().rank == 0
    if modify and rank0_only:
        raise ValueError("gathered_parameters(modify=True) needs every rank's values: drop rank0_only")
    gathered = [unit for unit in units if not unit.gathered]  # the others are in use by a forward: left as they are
    for unit in gathered:  # all together: the block sees them at once
        if not unit.pending:  # (a prefetch in flight is waited for)
            unit.start_gather(sharded.next_position, sharded.process_set)
        unit.finish_gather()
        if not keep:
            unit.release()
    try:
        yield
    finally:
        for unit in units:
            if modify:
                unit.keep_own_slices()
        for unit in gathered:
            unit.release()
