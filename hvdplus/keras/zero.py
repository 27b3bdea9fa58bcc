"""ZeRO-style optimizer-state sharding for Keras 3 (TensorFlow backend): `hvd.ZeroOptimizer(opt)`.

Each rank of the process set keeps the optimizer state (Adam's moments, momentum, ...) of only its part of
the parameters. The trainable variables of each dtype, in order, are laid end to end as one flat sequence
and cut into N balanced contiguous ranges (`hvdplus.common.plans.sharding.partition`; a variable may span ranks).
Each rank holds its range of each dtype in one flat *shard variable*; the wrapped optimizer is built on the
shard variables only, so its slot variables have the shard's size, not the model's.

A step (`apply(grads, trainable_variables)`, also what `model.fit` calls):
 1. the gradients of each dtype are flattened into one tensor (a missing gradient counts as zeros) and
    reduce-scattered (averaged) with the plan's per-rank counts: each rank receives only its averaged shard
    (`compression` applies to this reduce-scatter);
 2. the shard variables are refreshed from the model's variables (so weights set outside the optimizer,
    by a broadcast, `set_weights` or `load_weights`, are seen) and the wrapped optimizer updates them;
 3. the updated shards are allgathered and written back into the model's variables.
With `backward_passes_per_step=k` the local gradients are summed for k calls (DistributedOptimizer's
accumulation, shared code: its accumulators are model-sized) and the sharded step runs on every k-th call;
as there, `iterations` counts every call, so an update that reads the step count (Adam's bias correction)
sees k times the number of updates. The collectives are named after the
optimizer (`name`, default "ZeroOptimizer"), made unique in the step's graph, so every rank agrees.

At the first step (when the optimizer is built: `model.fit` builds it before training) every rank checks that
all ranks have the same trainable variables (number, shapes, dtypes): otherwise CollectiveMismatchError is
raised on every rank, naming the first variable that differs and the ranks.

Saved state. `ZeroOptimizer(opt)` is an instance of a dynamic subclass of `type(opt)` built from
`opt.get_config()` (as DistributedOptimizer), under the plain class's name, so `model.save()` records a plain
Keras optimizer (e.g. `Adam`) and the file loads with `keras.models.load_model` where hvdplus is absent.
What the file holds of the optimizer's *state*:
 - by default only the state every rank shares (`iterations` and the learning-rate variable); the sharded
   slots are left out, so plain Keras loads the model (weights exact) with a warning that it skips the
   optimizer's variables ("... has N variables whereas the saved optimizer has 2"), and a fresh state;
 - after `optimizer.consolidated_variables(to=r)` (collective: every rank calls it) and until the next step,
   `model.save()` on rank r writes the full state in the plain optimizer's layout, which plain
   `keras.models.load_model` restores exactly (as if trained without sharding). A ZeroOptimizer loading
   such a file (`model.load_weights` on a built model) takes its own shard of it, and so does
   `ZeroOptimizer(loaded_model.optimizer)` when it wraps an optimizer that is already built.

Limits: exact equality with single-process training holds for element-wise optimizers (SGD, Adam, AdamW without
`exclude_from_weight_decay`, RMSprop, Adagrad, Adamax, Nadam, Lion, ...): the update of a flat shard is the
update of its elements. Per-variable rules (`clipnorm`, `global_clipnorm`, `use_ema`) are refused; optimizers
that look at whole matrices (Adafactor, LAMB, Muon) run but are not equivalent. A variable with no gradient
is updated with a zero gradient (plain Keras skips it). LossScaleOptimizer cannot be wrapped.
`hvd.broadcast_model` / `BroadcastGlobalVariablesCallback` must not broadcast the sharded slots (they differ
between ranks): broadcast the model's variables and `optimizer.replicated_variables` only.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdplus.common import basics
from hvdplus.common import collectives as core
from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.exceptions import CollectiveMismatchError
from hvdplus.common.ops import ReduceOp
from hvdplus.common.optimizer_options import check_compression, check_passes
from hvdplus.common.plans.sharding import DtypePartition, partition
from hvdplus.common.subclassing import disguised_subclass
from hvdplus.keras.optimizer import DistributedOptimizerMixin, OptimizerMixin
from hvdplus.tensorflow._graph import dtype_name, graph_name
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.flat_ops import allgather_flat, reducescatter_flat

__all__ = ["ZeroOptimizer"]


# Plain Python over tensors (no tensor-dependent control flow): autograph would only spend seconds converting it.
_not_converted = tf.autograph.experimental.do_not_convert


def _set(obj: Any, name: str, value: Any) -> None:
    """Set an attribute past Keras' tracker (which would add keras.Variables to `optimizer.variables`)."""
    object.__setattr__(obj, name, value)


def _numel(variable: Any) -> int:
    return int(np.prod(variable.shape, dtype=np.int64))


class _NamePassing:
    """The `_hvd_reducer` of DistributedOptimizer's accumulation code: no allreduce (the sharded step
    reduce-scatters), only the collective names, taken in the step's graph before the update's tf.cond and
    handed to the sharded step that runs inside it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.pending: str | None = None

    def names(self, variables: Sequence[Any]) -> list[str]:
        prefix = self.prefix if tf.executing_eagerly() else graph_name(self.prefix)
        return [prefix] * len(variables)

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any], names: Sequence[str] | None = None) -> list[Any]:
        self.pending = names[0] if names else None
        return list(grads)


class _ZeroStep(OptimizerMixin):
    """Placed just before the user's optimizer class: builds it on the shard variables and runs the sharded step.

    Instance attributes (set past Keras' tracker): `_hvd_model_variables`, `_hvd_plans`, `_hvd_shards`,
    `_hvd_slots` ({(plan index, slot name): variable}), `_hvd_recording`, `_hvd_consolidated`."""

    _hvd_process_set: ProcessSet
    _hvd_compression: Compressor
    _hvd_reducer: _NamePassing
    _hvd_base: type
    _hvd_model_variables: list[Any] | None = None
    _hvd_plans: list[DtypePartition[str]]
    _hvd_shards: list[Any]
    _hvd_slots: dict[tuple[int, str], Any]
    _hvd_recording: list[tuple[int, Any, str]] | None = None
    _hvd_consolidated: tuple[int, int, list[np.ndarray]] | None = None

    # ------------------------------------------------------------------ build
    @_not_converted
    def build(self, variables: Sequence[Any]) -> None:
        """Check the variables against the other ranks', plan the shards, build the wrapped optimizer on them.

        Collective (once): every rank in the process set must build its ZeroOptimizer."""
        optimizer: Any = self
        if optimizer.built:
            return
        variables = list(variables)
        process_set = self._hvd_process_set
        if not process_set.included():
            raise ValueError("ZeroOptimizer: this rank is not a member of the optimizer's process set")
        _check_same_variables(variables, process_set, self._hvd_reducer.prefix)
        plans = partition([_numel(v) for v in variables], [dtype_name(v.dtype) for v in variables], process_set.size())
        me = process_set.rank()
        with tf.init_scope():
            shards = []
            for index, plan in enumerate(plans):
                start, end = plan.shard(me)
                flat = [
                    np.asarray(variables[p.param].numpy()).reshape(-1)[p.start : p.start + p.length]
                    for p in plan.pieces(start, end)
                ]
                initial = np.concatenate(flat) if flat else np.zeros([0], plan.kind)
                shards.append(
                    keras.Variable(initial, dtype=plan.kind, trainable=True, name=f"zero_shard_{index}_{plan.kind}")
                )
        _set(self, "_hvd_model_variables", variables)
        _set(self, "_hvd_plans", plans)
        _set(self, "_hvd_shards", shards)
        before = len(optimizer.variables)
        _set(self, "_hvd_recording", [])
        try:
            super().build(shards)
        finally:
            recorded = self._hvd_recording or []
            _set(self, "_hvd_recording", None)
        created = optimizer.variables[before:]
        owner = {id(s): i for i, s in enumerate(shards)}
        slots: dict[tuple[int, str], Any] = {}
        by_id = {id(v): v for v in created}
        for variable_id, reference, name in recorded:
            if variable_id in by_id and id(reference) in owner:
                slots.setdefault((owner[id(reference)], name), by_id[variable_id])
        _set(self, "_hvd_slots", slots)

    @_not_converted
    def add_variable_from_reference(
        self, reference_variable: Any, name: str | None = None, initializer: Any = "zeros"
    ) -> Any:
        variable = super().add_variable_from_reference(reference_variable, name, initializer)
        if self._hvd_recording is not None:
            self._hvd_recording.append((id(variable), reference_variable, name or "var"))
        return variable

    # ------------------------------------------------------------------ step
    @_not_converted
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """The sharded step on local (not yet averaged) gradients of the model's variables."""
        optimizer: Any = self
        grads = list(grads)
        given = trainable_variables if trainable_variables is not None else self._hvd_model_variables
        assert given is not None  # _ZeroOptimizer.apply passes the variables (or raises when it has none)
        variables = list(given)
        if not optimizer.built:
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
        model_variables = self._hvd_model_variables or []
        if len(variables) != len(model_variables) or any(a is not b for a, b in zip(variables, model_variables)):
            raise ValueError(
                f"ZeroOptimizer was built on {len(model_variables)} variables and shards their state; "
                f"apply() must get gradients of those same variables, in the same order "
                f"(got {len(variables)} variables)"
            )
        if len(grads) != len(variables):
            raise ValueError(f"ZeroOptimizer.apply: {len(grads)} gradients for {len(variables)} variables")
        prefix = self._hvd_reducer.pending
        self._hvd_reducer.pending = None
        if prefix is None:
            prefix = self._hvd_reducer.names([None])[0]
        process_set, compression = self._hvd_process_set, self._hvd_compression
        me = process_set.rank()
        shard_grads = []
        for index, (plan, shard) in enumerate(zip(self._hvd_plans, self._hvd_shards)):
            flat = tf.concat(
                [tf.reshape(tf.cast(_dense(grads[i], variables[i]), shard.dtype), [-1]) for i in plan.params], 0
            )
            wire, ctx = compression.compress(flat)
            reduced = reducescatter_flat(
                wire, plan.counts, f"{prefix}.reducescatter{index}", ReduceOp.AVERAGE, process_set
            )
            shard_grads.append(tf.cast(compression.decompress(reduced, ctx), shard.dtype))
            shard.assign(_own_slice(plan, variables, me, shard.dtype))
        super().apply(shard_grads, self._hvd_shards)
        for index, (plan, shard) in enumerate(zip(self._hvd_plans, self._hvd_shards)):
            full = allgather_flat(shard.value, plan.counts, f"{prefix}.allgather{index}", process_set)
            for i, offset, numel in zip(plan.params, plan.offsets, plan.numels):
                variables[i].assign(tf.reshape(full[offset : offset + numel], variables[i].shape))

    # ------------------------------------------------------------------ state
    @property
    def sharded_variables(self) -> list[Any]:
        """This rank's shard variables and the optimizer's slot variables built on them (they differ between
        ranks: never broadcast them)."""
        if not getattr(self, "built", False) or self._hvd_model_variables is None:
            return []
        sharded = {id(v) for v in self._hvd_slots.values()} | {id(v) for v in self._hvd_shards}
        return [v for v in self._all_variables() if id(v) in sharded] + list(self._hvd_shards)

    @property
    def replicated_variables(self) -> list[Any]:
        """The optimizer's variables that every rank holds whole (`iterations`, the learning rate, ...)."""
        sharded = {id(v) for v in self.sharded_variables}
        return [v for v in self._all_variables() if id(v) not in sharded]

    def _all_variables(self) -> list[Any]:
        return list(super().variables)

    def _built_variables(self) -> list[Any]:
        """The model's variables, on which `build` planned the shards."""
        assert self._hvd_model_variables is not None, "the optimizer is built first"
        return self._hvd_model_variables

    def _plain_layout(self) -> list[tuple[str, Any]]:
        """The variables of the plain optimizer built on the model's variables, in its order: ("slot", (model
        variable index, slot name)) or ("replicated", our variable)."""
        config = self.get_config()
        probe = disguised_subclass(_SlotProbe, self._hvd_base).from_config(config)
        _set(probe, "_hvd_probe_calls", {})
        model_variables = self._built_variables()
        probe.build(model_variables)
        index_of = {id(v): i for i, v in enumerate(model_variables)}
        replicated = iter(self.replicated_variables)
        layout: list[tuple[str, Any]] = []
        for variable in probe.variables:
            call = probe._hvd_probe_calls.get(id(variable))
            if call is None:
                mine = next(replicated, None)
                if mine is None or tuple(mine.shape) != tuple(variable.shape):
                    raise NotImplementedError(
                        f"ZeroOptimizer cannot map the state of {type(self).__name__} to its "
                        f"plain layout (variable {variable.path})"
                    )
                layout.append(("replicated", mine))
            else:
                reference, name = call
                param = index_of[id(reference)]
                plan_index = next(k for k, plan in enumerate(self._hvd_plans) if param in plan.params)
                if (plan_index, name) not in self._hvd_slots:
                    raise NotImplementedError(f"ZeroOptimizer: no sharded slot {name!r} for {reference.path}")
                layout.append(("slot", (param, name)))
        return layout

    def consolidated_variables(self, to: int | None = 0) -> list[np.ndarray] | None:
        """The optimizer's full state in the plain optimizer's layout (what `type(opt)` built on the model's
        variables would hold), as numpy arrays, on the rank of global rank `to` (every rank with `to=None`);
        None on the others. Until the next step, `model.save()` on that rank writes this full state.

        Collective: every rank in the process set must call it, eagerly (not inside tf.function)."""
        optimizer: Any = self
        if not optimizer.built:
            raise ValueError("ZeroOptimizer.consolidated_variables: the optimizer is not built yet")
        process_set = self._hvd_process_set
        root = None if to is None else core.check_root(to, process_set)
        layout = self._plain_layout()
        gathered: dict[tuple[int, str], np.ndarray] = {}
        for number, ((plan_index, name), slot) in enumerate(sorted(self._hvd_slots.items(), key=lambda kv: kv[0])):
            plan = self._hvd_plans[plan_index]
            gathered[(plan_index, name)] = np.asarray(
                allgather_flat(
                    tf.reshape(tf.convert_to_tensor(slot.value), [-1]),
                    plan.counts,
                    f"{self._hvd_reducer.prefix}.consolidate{number}",
                    process_set,
                )
            )
        if root is not None and basics.rank() != root:
            return None
        result = []
        for kind, what in layout:
            if kind == "replicated":
                result.append(np.array(what.numpy()))
                continue
            param, name = what
            plan_index = next(k for k, plan in enumerate(self._hvd_plans) if param in plan.params)
            plan = self._hvd_plans[plan_index]
            offset = plan.offsets[plan.params.index(param)]
            variable = self._built_variables()[param]
            result.append(gathered[(plan_index, name)][offset : offset + _numel(variable)].reshape(variable.shape))
        _set(self, "_hvd_consolidated", (int(optimizer.iterations.numpy()), len(layout), result))
        return result

    def save_own_variables(self, store: Any) -> None:
        """The replicated state, or the full plain-layout state right after `consolidated_variables` here."""
        optimizer: Any = self
        snapshot = self._hvd_consolidated
        if snapshot is not None and snapshot[0] == int(optimizer.iterations.numpy()):
            for i, value in enumerate(snapshot[2]):
                store[str(i)] = value
            return
        if not optimizer.built:
            return super().save_own_variables(store)
        for i, variable in enumerate(self.replicated_variables):
            store[str(i)] = np.array(variable.numpy())

    def load_own_variables(self, store: Any) -> None:
        """Load a plain-layout state (this rank takes its shard of each slot) or a replicated-only one."""
        optimizer: Any = self
        if not optimizer.built:
            return super().load_own_variables(store)
        count = len(store.keys())
        replicated = self.replicated_variables
        if count == len(replicated):
            for i, variable in enumerate(replicated):
                variable.assign(store[str(i)])
            return
        layout = self._plain_layout()
        if count != len(layout):
            warnings.warn(
                f"Skipping variable loading for ZeroOptimizer '{optimizer.name}': the saved optimizer has "
                f"{count} variables, neither the plain layout ({len(layout)}) nor the replicated state "
                f"({len(replicated)})",
                stacklevel=2,
            )
            return
        me = self._hvd_process_set.rank()
        pending: dict[tuple[int, str], np.ndarray] = {}
        for i, (kind, what) in enumerate(layout):
            if kind == "replicated":
                what.assign(store[str(i)])
                continue
            param, name = what
            plan_index = next(k for k, plan in enumerate(self._hvd_plans) if param in plan.params)
            plan = self._hvd_plans[plan_index]
            start, end = plan.shard(me)
            slot = self._hvd_slots[(plan_index, name)]
            buffer = pending.setdefault((plan_index, name), np.array(slot.numpy()).reshape(-1))
            value = np.asarray(store[str(i)]).reshape(-1)
            for piece in plan.pieces(start, end):
                if piece.param == param:
                    buffer[piece.offset - start : piece.offset - start + piece.length] = value[
                        piece.start : piece.start + piece.length
                    ]
        for key, buffer in pending.items():
            self._hvd_slots[key].assign(buffer)


class _SlotProbe(OptimizerMixin):
    """Records which model variable each slot of a plain optimizer refers to, creating empty variables only."""

    _hvd_probe_calls: dict[int, tuple[Any, str]]

    @_not_converted
    def add_variable_from_reference(
        self, reference_variable: Any, name: str | None = None, initializer: Any = "zeros"
    ) -> Any:
        optimizer: Any = self
        variable = optimizer.add_variable(
            shape=(0,), initializer="zeros", dtype=reference_variable.dtype, name=f"probe_{name or 'var'}"
        )
        self._hvd_probe_calls[id(variable)] = (reference_variable, name or "var")
        return variable


class _ZeroOptimizer(DistributedOptimizerMixin, _ZeroStep):
    """DistributedOptimizer's accumulation in front of the sharded step: its `super().apply` after the
    accumulation lands in `_ZeroStep.apply` (the method resolution order is _ZeroOptimizer,
    DistributedOptimizerMixin, _ZeroStep, the user's class)."""

    _hvd_reducer: _NamePassing  # what _ZeroStep needs, and a reducer for DistributedOptimizerMixin's accumulation

    @_not_converted
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """One step (every `backward_passes_per_step`-th call) of ZeRO sharding; see the module docstring.

        Collective: every rank in the process set must call this the same number of times."""
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = self._hvd_model_variables
        if trainable_variables is None:
            raise ValueError(
                "the optimizer is not built yet: pass trainable_variables to apply(), or call "
                "optimizer.build(model.trainable_variables) first"
            )
        variables = list(trainable_variables)
        if self._hvd_passes == 1:
            return _ZeroStep.apply(self, grads, variables)
        return self._hvd_accumulate(grads, variables, variables)


def _dense(grad: Any, variable: Any) -> tf.Tensor:
    if grad is None:
        return tf.zeros(variable.shape, variable.dtype)
    return tf.convert_to_tensor(grad)  # densifies tf.IndexedSlices


def _own_slice(plan: DtypePartition[str], variables: Sequence[Any], rank: int, dtype: Any) -> tf.Tensor:
    start, end = plan.shard(rank)
    parts = [
        tf.reshape(tf.convert_to_tensor(variables[p.param]), [-1])[p.start : p.start + p.length]
        for p in plan.pieces(start, end)
    ]
    return tf.concat(parts, 0) if parts else tf.zeros([0], dtype)


def _check_same_variables(variables: Sequence[Any], process_set: ProcessSet, prefix: str) -> None:
    """CollectiveMismatchError on every rank unless all ranks have the same number, shapes and dtypes."""
    mine = [
        (getattr(v, "path", None) or v.name, tuple(int(d) for d in v.shape), dtype_name(v.dtype)) for v in variables
    ]
    everyone = core.allgather_object(mine, f"{prefix}.check_variables", process_set)
    ranks = process_set._runtime_ranks()  # global ranks, in set order
    reference = everyone[0]
    for member, theirs in zip(ranks[1:], everyone[1:]):
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a is not None and b is not None and a[1:] == b[1:]:
                continue
            known = a or b
            assert known is not None  # i is within the longer of the two lists
            name = known[0]
            described = [
                f"rank {r}: " + ("no such variable" if x is None else f"shape {x[1]} {x[2]} ({x[0]!r})")
                for r, x in ((ranks[0], a), (member, b))
            ]
            raise CollectiveMismatchError(
                f"ZeroOptimizer: trainable variable {i} ({name!r}) differs between ranks ({'; '.join(described)}); "
                f"rank {ranks[0]} has {len(reference)} trainable variables, rank {member} {len(theirs)}. Every rank "
                f"must build the same model."
            )


def ZeroOptimizer(
    optimizer: keras.optimizers.Optimizer,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = True,
    process_set: ProcessSet = global_process_set,
    name: str | None = None,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that its state is sharded over the ranks of `process_set` (ZeRO stage 1 with
    reduce-scattered gradients); the model's parameters stay whole and equal on every rank.

    Returns an instance of a dynamic subclass of `type(optimizer)` (isinstance checks hold; `model.save()`
    records the plain class). A built `optimizer` (e.g. loaded with a model) passes on this rank's shard of its
    state and its iteration count; wrapping it then builds the ZeroOptimizer (a collective).
    `compression` (e.g. `Compression.bf16`) is the reduce-scatter's wire dtype;
    `backward_passes_per_step` k accumulates k calls' gradients (averaged over them with
    `average_aggregated_gradients`) before one update; `name` renames the optimizer and prefixes its
    collectives. See the module docstring for the step and for what `model.save()` keeps.
    Collective: every rank in the process set must wrap its optimizer and apply it the same number of times."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a Keras 3 optimizer (keras.optimizers.Optimizer), got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, DistributedOptimizerMixin):
        raise ValueError("optimizer is already wrapped by hvdplus; wrap the original optimizer")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError("ZeroOptimizer cannot wrap a LossScaleOptimizer")
    for option in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, option, None):
            raise ValueError(
                f"ZeroOptimizer: {option} needs whole-variable gradient norms, which no rank has; "
                f"use clipvalue, or clip before apply()"
            )
    if getattr(optimizer, "use_ema", False):
        raise ValueError("ZeroOptimizer does not support use_ema (the moving averages would be of shards)")
    check_passes(backward_passes_per_step)
    check_compression(compression)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped: Any = disguised_subclass(_ZeroOptimizer, type(optimizer)).from_config(config)
    wrapped._hvd_reducer = _NamePassing(name or "ZeroOptimizer")
    wrapped._hvd_passes = backward_passes_per_step
    wrapped._hvd_average_aggregated = average_aggregated_gradients
    wrapped._hvd_process_set = process_set
    wrapped._hvd_compression = compression
    wrapped._hvd_base = type(optimizer)
    if optimizer.built:  # keep this rank's shard of its state (it is in the plain layout)
        wrapped.build(optimizer._trainable_variables)  # the list a built Keras optimizer was built with
        wrapped.load_own_variables({str(i): np.array(v.numpy()) for i, v in enumerate(optimizer.variables)})
    return wrapped
