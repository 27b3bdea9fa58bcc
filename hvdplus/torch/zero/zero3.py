"""ZeRO-3 in Horovod's API: `hvd.shard_parameters(model, units=...)` keeps 1/N of every parameter on each rank.

Why this API: a Horovod user wraps what they already have. `shard_parameters` shards the model in place and
returns it (as FSDP2's `fully_shard` does), so model code, parameter names, `state_dict` keys and param groups
stay the user's; `hvd.ZeroOptimizer` over its parameters then steps the shards (optimizer.py). It is one call for the
whole model, not one per module, because the units must be known together: which unit owns a parameter that two
modules share, the order in which prefetch gathers them, and one positional name sequence for all ranks.

A unit is a module (chosen by class, by a predicate, or listed) whose parameters, flattened per (dtype,
trainable), are split evenly over the process set (common/plans/sharding.py). Parameters that no unit owns, or that
modules of several units share (an embedding tied to the output layer), belong to the enclosing unit, the root
(the model itself), which stays gathered from the model's forward to the end of its backward. Parameters of at
most `persist_below` elements stay whole on every rank (DeepSpeed's `param_persistence_threshold`).

Between uses a parameter's `.data` is an empty tensor. Before a unit's forward its shards are allgathered into
one flat buffer per dtype and the parameters become views of it; after the forward the buffer's storage is
released (`reshard_after_forward`), so that tensors autograd saved stay valid views that the gather before the
unit's backward (hooked on its outputs) fills again. The next units are prefetched with non-blocking gathers,
in forward order and then in reverse, at most `max_live_units` at once. Gradients are reduce-scattered as each
unit's backward completes (shards.py), after which the unit releases its buffer.

Every gather and reduce-scatter of a pass takes the next positional name ("zero3.<model>.<n>"), tagged with its unit:
ranks that run units in different orders, or skip one, meet a different unit, kind or size under one name and
fail on every rank at once (a CollectiveMismatchError naming both units) instead of waiting or mixing them.

The shards and gathered buffers live on the model's device (`device=`: a GPU, or the CPU; a model built on the
meta device is materialised there unit by unit), and the gathers run on its device plane (NCCL) when it has one.
`offload="parameters"` keeps the shards in host memory, copied to the device at each gather.
`checkpoint_activations=True` runs each unit's forward under `torch.utils.checkpoint` (non-reentrant), so that
its activations are recomputed in backward, after the backward has gathered the unit again.

This module chooses the units and runs them (the hooks, prefetch, names); a unit and its buffers are
zero3_units.py, building the shards (also from a model on the `meta` device) zero3_init.py, checkpoints
zero3_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from hvdplus.common.basics import ProcessSet, global_process_set, runtime
from hvdplus.torch.buffers import one_device
from hvdplus.torch.streams import SideStream
from hvdplus.torch.zero.zero3_init import check_same_everywhere, default_init, materialize, meta_parameters
from hvdplus.torch.zero.zero3_units import OFFLOADS, PERSISTENT, ROOT, Unit

__all__ = ["shard_parameters", "gathered_parameters", "ShardedModel", "sharded_model_of"]

UnitChoice = Sequence[type] | Callable[[str, torch.nn.Module], bool] | Sequence[torch.nn.Module] | None


class _InputsReached(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's own backward has reached them."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


class ShardedModel:
    """The units of one sharded model and the hooks that gather and release them (`model._hvdplus_zero3`)."""

    built: dict[tuple[int, ...], int] = {}  # models sharded so far per process set (by its ranks): the members
    # of a set shard their models over it in the same order, so the count is the same on each of them

    def __init__(
        self,
        model: torch.nn.Module,
        units: list[Unit],
        process_set: ProcessSet,
        reshard_after_forward: bool,
        prefetch: int,
        max_live_units: int,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        device: torch.device,
        checkpoint_activations: bool = False,
    ) -> None:
        self.model, self.units, self.process_set = model, units, process_set
        self.device, self.checkpoint_activations = device, checkpoint_activations
        self.reshard_after_forward, self.prefetch, self.max_live_units = reshard_after_forward, prefetch, max_live_units
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        members = tuple(process_set.ranks or ())
        self.id = ShardedModel.built.get(members, 0)  # in the names: two sharded models never share one
        ShardedModel.built[members] = self.id + 1
        self.position = 0
        self.reached: set[int] = set()  # units whose backward reached their inputs, in this backward
        self.sent: set[int] = set()  # units whose gradients all left, in this backward
        self.order: list[Unit] = []  # units in the order the last pass's forward ran them
        self.current: list[Unit] = []
        self.end_of_backward_queued = False
        self.gradients: Any = None  # the ZeroOptimizer's shards, once one is wrapped around these parameters
        self.recomputing = 0  # > 0 while a checkpointed unit's forward runs again in backward
        self.unit_of = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}

    def shape_of(self, p: torch.Tensor) -> torch.Size:
        """A sharded parameter's own shape (it is an empty tensor between uses)."""
        unit, i = self.unit_of[id(p)]
        return unit.shapes[i]

    # ------------------------------------------------------------------ names
    def next_name(self) -> str:
        """The next positional collective name of this pass: the same sequence on every rank."""
        self.position += 1
        return f"zero3.{self.id}.{self.position - 1}"

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
        self.reached.clear()
        self.sent.clear()

    def gather(self, unit: Unit) -> None:
        """Make `unit`'s parameters whole (waiting for its prefetch if one is in flight). Collective."""
        if unit.gathered:
            return
        if not unit.pending:
            unit.start_gather(self.next_name, self.process_set)
        unit.finish_gather()

    def live(self) -> int:
        return sum(1 for u in self.units if (u.gathered or u.pending) and not u.persistent and not u.is_root)

    def prefetch_from(self, order: list[Unit], after: int) -> None:
        """Start gathering the next `prefetch` units of `order` after index `after`, within max_live_units."""
        for unit in order[after + 1 : after + 1 + self.prefetch]:
            if unit.gathered or unit.pending or unit.persistent:
                continue
            if self.live() >= self.max_live_units:
                return
            unit.start_gather(self.next_name, self.process_set)

    def before_forward(self, unit: Unit, args: tuple) -> tuple | None:
        """Gather `unit` and prefetch the next ones; returns its inputs routed through _InputsReached when a
        backward will run (so that the unit is released as soon as its own backward is done). In a checkpointed
        unit's recomputation (in backward) it only gathers: the pass's order and hooks are the forward's."""
        if self.recomputing:
            self.gather(unit)
            return None
        self.current.append(unit)
        self.gather(unit)
        j = len(self.current) - 1
        if j < len(self.order) and self.order[j] is unit:
            self.prefetch_from(self.order, j)
        if unit.is_root or not torch.is_grad_enabled():
            return None
        positions = [n for n, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not positions:
            return None
        routed = _InputsReached.apply(lambda: self.inputs_reached(unit), *(args[n] for n in positions))
        routed_args = list(args)
        for n, tensor in zip(positions, routed):
            routed_args[n] = tensor
        return tuple(routed_args)

    def cast_inputs(self, args: tuple) -> tuple | None:
        """The model's floating-point inputs in `param_dtype` (None: no mixed precision, nothing to change)."""
        if self.param_dtype is None:
            return None
        return tuple(
            tree_map(
                lambda a: a.to(self.param_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a,
                list(args),
            )
        )

    def after_forward(self, unit: Unit | None, output: Any) -> None:
        """After a unit's forward (None: the model's, which has no root unit): hook the backward's start on the
        outputs, and release what the backward will gather again (everything, for a forward without one). Nothing
        in a recomputation: the unit's backward follows at once and releases it."""
        if self.recomputing:
            return
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        needs_backward = torch.is_grad_enabled() and bool(outputs)
        if needs_backward and unit is not None:

            def backward_reached(grad: torch.Tensor, unit: Unit = unit) -> torch.Tensor:
                self.before_backward(unit)
                return grad

            for tensor in outputs:
                tensor.register_hook(backward_reached)
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
        """shards.py started the reduce-scatter of every trainable partition of `unit`: its buffer can go, unless
        it has frozen parameters, which its backward may still need until it reaches its inputs."""
        self.sent.add(id(unit))
        if all(p.requires_grad for p in unit.params) or id(unit) in self.reached:
            unit.release()

    def inputs_reached(self, unit: Unit) -> None:
        """`unit`'s backward is done: release it if its gradients have left too (or it has none to send)."""
        self.reached.add(id(unit))
        if id(unit) in self.sent or not any(p.requires_grad for p in unit.params):
            unit.release()

    def end_of_backward(self) -> None:
        self.end_of_backward_queued = False
        self.reached.clear()
        self.sent.clear()
        self.release_all()

    def release_all(self) -> None:
        for unit in self.units:
            if unit.pending:
                unit.finish_gather()
            unit.release()


def sharded_model_of(params: Iterable[torch.Tensor]) -> ShardedModel | None:
    """The ShardedModel that owns these parameters, if `shard_parameters` sharded them."""
    found = {id(p._hvdplus_zero3): p._hvdplus_zero3 for p in params if hasattr(p, "_hvdplus_zero3")}
    if len(found) > 1:
        raise ValueError(
            "the parameters belong to several models sharded by hvd.shard_parameters; wrap one "
            "ZeroOptimizer per sharded model"
        )
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
        classes = [u for u in listed if isinstance(u, type)]
        if len(classes) == len(listed):
            chosen = [m for n, m in named if n and isinstance(m, tuple(classes))]
        elif all(isinstance(u, torch.nn.Module) for u in listed):
            mine = {id(m) for _, m in named}
            strangers = [type(u).__name__ for u in listed if id(u) not in mine]
            if strangers:
                raise ValueError(f"units must be modules of the model; {strangers} are not")
            chosen = [u for u in listed if u is not model]
        else:
            raise TypeError(
                "units must be a list of module classes, a list of the model's modules, or a "
                "function (name, module) -> bool"
            )
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
        owners[key] = (common[-1] if common else ROOT, *first_name[key])
    return owners


# ---------------------------------------------------------------------- building
def shard_parameters(
    model: torch.nn.Module,
    units: UnitChoice = None,
    *,
    process_set: ProcessSet = global_process_set,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    max_live_units: int = 2,
    persist_below: int = 0,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    init: Callable[[torch.nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    offload: str | None = None,
    checkpoint_activations: bool = False,
) -> torch.nn.Module:
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
    (default: its `reset_parameters()` or `_reset_parameters()`). `device`: where the shards and the gathered
    parameters live, e.g. `torch.device("cuda", hvd.local_rank())` for a model built on the meta device (default:
    the device of the model's parameters, all on one; the CPU for a meta model); parameters elsewhere are copied
    there unit by unit, and the model's buffers moved there. `offload="parameters"`: the shards live in (pinned)
    host memory and each gather copies them to `device` first. `checkpoint_activations`: each unit's forward
    runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, its activations recomputed in backward.

    Collective: every rank of the set must call this with the same model structure; parameters that differ
    between ranks (or shard on different kinds of device) raise CollectiveMismatchError on every rank, naming the
    parameter and the ranks."""
    if hasattr(model, "_hvdplus_zero3"):
        raise ValueError("this model is already sharded by hvd.shard_parameters")
    if not process_set.included():
        raise ValueError(
            f"this rank ({runtime().rank}) is not in {process_set}: only its members can shard a model over it"
        )
    if prefetch < 0 or max_live_units < 1:
        raise ValueError(f"prefetch must be >= 0 and max_live_units >= 1, got {prefetch} and {max_live_units}")
    if offload not in OFFLOADS:
        raise ValueError(
            f"offload must be None or 'parameters', got {offload!r} (the optimizer's state is offloaded by "
            f"hvd.ZeroOptimizer(..., offload='optimizer'))"
        )
    if not isinstance(checkpoint_activations, bool):
        raise TypeError(f"checkpoint_activations must be True or False, got {checkpoint_activations!r}")
    device = _shard_device(model, device)
    size, index = process_set.size(), process_set.rank()
    places = meta_parameters(model)
    unit_names = _unit_modules(model, units)
    owners = _owners(model, unit_names)
    by_unit: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for unit_name, param_name, p in owners.values():
        key = PERSISTENT if p.numel() <= persist_below else unit_name
        by_unit.setdefault(key, []).append((param_name, p))
    modules = {name: module for module, name in unit_names.items()}
    modules[ROOT] = model
    order = [ROOT] + [n for n in modules if n != ROOT] + [PERSISTENT]
    copies = SideStream(device)  # offload: the shards' copies to the device, one stream for the model
    built = [
        Unit(
            name,
            modules.get(name),
            by_unit[name],
            size,
            index,
            param_dtype,
            name == PERSISTENT,
            device,
            offload,
            copies,
        )
        for name in order
        if name in by_unit
    ]
    digests = materialize(model, built, unit_names, init or default_init, places, device)
    _move_buffers(model, device)
    check_same_everywhere(built, digests, process_set, device, list(model.named_buffers()))
    sharded = ShardedModel(
        model,
        built,
        process_set,
        reshard_after_forward,
        prefetch,
        max_live_units,
        param_dtype,
        reduce_dtype if reduce_dtype is not None else param_dtype,
        device,
        checkpoint_activations,
    )
    for unit in built:
        for p in unit.params:
            p._hvdplus_zero3 = sharded  # type: ignore[attr-defined]
    model._hvdplus_zero3 = sharded  # type: ignore[assignment]
    _register_hooks(sharded)
    return model


def _shard_device(model: torch.nn.Module, device: torch.device | str | None) -> torch.device:
    """Where the shards live: `device`, else the one device of the model's (non-meta) parameters, else the CPU;
    ValueError naming a parameter on each device when they are on several."""
    named = {id(p): name for name, p in model.named_parameters() if not p.is_meta}
    found = one_device([p for p in model.parameters() if not p.is_meta], lambda p: named[id(p)], "hvd.shard_parameters")
    chosen = found if device is None else torch.device(device)
    if chosen.type == "meta":
        raise ValueError("device must be where the shards live (e.g. torch.device('cuda', hvd.local_rank())), not meta")
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """The model's buffers on the shards' device (those a meta build made are there already)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _checkpointed(sharded: ShardedModel, unit: Unit) -> None:
    """Run `unit`'s forward under non-reentrant activation checkpointing. Its recomputation runs in backward,
    once the gradient reached the unit's outputs, whose hook gathered it again; it gathers the unit itself in
    case it was released since, and marks the recomputation so that the hooks of units inside it only gather."""
    assert unit.module is not None
    forward = unit.module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = 0

        def run(*args: Any, **kwargs: Any) -> Any:
            """checkpoint() calls this once for the forward, then again for each recomputation in backward."""
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*args, **kwargs)
            sharded.recomputing += 1
            try:
                sharded.gather(unit)
                return forward(*args, **kwargs)
            finally:
                sharded.recomputing -= 1

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    unit.module.forward = checkpointed


def _register_hooks(sharded: ShardedModel) -> None:
    root = next((u for u in sharded.units if u.is_root), None)

    def before_model(_module: torch.nn.Module, args: tuple) -> tuple | None:
        sharded.begin_pass()
        if root is not None:
            sharded.before_forward(root, args)
        return sharded.cast_inputs(args)

    def after_model(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        sharded.after_forward(root, output)

    sharded.model.register_forward_pre_hook(before_model)
    sharded.model.register_forward_hook(after_model)
    hooked = [u for u in sharded.units if u.module is not None and not u.is_root and not u.persistent]
    inner = {id(m) for u in hooked for m in u.module.modules() if m is not u.module}  # type: ignore[union-attr]
    for unit in hooked:
        module = unit.module
        assert module is not None
        module.register_forward_pre_hook(lambda _m, args, unit=unit: sharded.before_forward(unit, args))
        module.register_forward_hook(lambda _m, _a, out, unit=unit: sharded.after_forward(unit, out))
        if sharded.checkpoint_activations and id(module) not in inner:  # a unit inside one is checkpointed with it
            _checkpointed(sharded, unit)


@contextmanager
def gathered_parameters(module: torch.nn.Module, modify: bool = False, rank0_only: bool = False) -> Iterator[None]:
    """Inside the block, the parameters of `module` (a sharded model or any of its modules) are whole tensors.

    `modify=True`: what the block writes into them is kept (each rank keeps its own slice of its own values, so
    change them the same way on every rank; under `torch.no_grad()`, as for any in-place change of a parameter).
    `rank0_only=True`: only the set's first rank keeps the gathered values; the others release them at once (the
    gather itself is collective, as in FSDP's `summon_full_params(rank0_only=True)`). Units a running forward
    holds are left gathered. Collective: every rank of the set enters it."""
    sharded = sharded_model_of(module.parameters())
    if sharded is None:
        raise ValueError("gathered_parameters needs a model sharded by hvd.shard_parameters")
    wanted = {id(p) for p in module.parameters()}
    units = [u for u in sharded.units if any(id(p) in wanted for p in u.params)]
    keep = not rank0_only or sharded.process_set.rank() == 0
    if modify and rank0_only:
        raise ValueError("gathered_parameters(modify=True) needs every rank's values: drop rank0_only")
    gathered = [unit for unit in units if not unit.gathered]  # the others are in use by a forward: left as they are
    for unit in gathered:  # all together: the block sees them at once
        sharded.gather(unit)
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
