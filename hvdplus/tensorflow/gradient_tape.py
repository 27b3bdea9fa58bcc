"""horovod.tensorflow's DistributedGradientTape: `tape.gradient` returns gradients averaged over the ranks.

`DistributedGradientTape(tape)` returns a copy of `tape` whose class is a dynamic subclass of `type(tape)`
(so `isinstance(wrapped, tf.GradientTape)` holds); it shares what the original recorded, so it can wrap
a tape before or after the `with` block, eagerly or inside tf.function.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import tensorflow as tf

from hvdplus.common.basics import ProcessSet, global_process_set
from hvdplus.common.ops import Average, ReduceOp
from hvdplus.common.optimizer_options import merge_num_groups
from hvdplus.common.subclassing import disguised_subclass
from hvdplus.tensorflow.compression import Compression, Compressor
from hvdplus.tensorflow.gradients import GradientReducer

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]

if TYPE_CHECKING:  # the mixin below sits before the user's tape class, whose gradient() it calls
    _TapeMixin: TypeAlias = tf.GradientTape
else:
    _TapeMixin = object


class _DistributedGradientTape(_TapeMixin):
    """Mixin placed before the user's tape class; `_hvd_reducer` is set on each wrapped instance."""

    _hvd_reducer: GradientReducer

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """The wrapped tape's gradients, allreduced. Collective: every rank must call this, in the same order."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        reduced = self._hvd_reducer.reduce(tf.nest.flatten(grads), flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(
        self, target: Any, sources: Sequence[Any], output_gradients: Any = None
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """`gradient()`'s results split as Horovod's method does: (source, gradient) pairs of the local sources
        (registered or of `local_layers`), then those of the others, each in the order of `sources`.

        Collective: as `gradient()`."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, grads))
        local = [(s, g) for s, g in pairs if self._hvd_reducer.is_local(s)]
        shared = [(s, g) for s, g in pairs if not self._hvd_reducer.is_local(s)]
        return local, shared

    def register_local_source(self, source: Any) -> None:
        """Keep `source`'s gradient local to this rank (not allreduced), as Horovod's method does."""
        self._hvd_reducer.register_local([source])


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    sparse_as_dense: bool = False,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[Any] | None = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """Wrap `gradtape` so that `gradient()` returns gradients averaged (`op`) over the ranks of `process_set`.

    `compression` is the wire codec (e.g. `Compression.fp16`); tf.IndexedSlices gradients are allgathered unless
    `sparse_as_dense`; `gradient_predivide_factor` f divides by f before the sum and by size/f after (Average
    only); `groups` (an int, or lists of variables) sets how many allreduce ops carry the gradients (one op
    by default). Collective: every rank must call `gradient()` on the same sources, in the same order."""
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedGradientTape):
        raise ValueError("gradtape is already a DistributedGradientTape; wrap the original tape only once")
    groups = merge_num_groups(num_groups, groups)
    reducer = GradientReducer(
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        groups,
        process_set,
        scale_local_gradients,
        "DistributedGradientTape",
    )
    wrapped = copy.copy(gradtape)
    wrapped.__class__ = disguised_subclass(_DistributedGradientTape, type(gradtape))
    wrapped._hvd_reducer = reducer
    return wrapped


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    sparse_as_dense: bool = False,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[Any] | None = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:
    """A DistributedGradientTape whose `local_layers` (a Keras layer or a list of them) keep local gradients.

    Collective: as DistributedGradientTape."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    tape._hvd_reducer.register_local(layer_variables(local_layers))
    return tape


def layer_variables(local_layers: Any) -> Iterable[Any]:
    """The trainable variables of a layer or a list of layers (nothing for None)."""
    if local_layers is None:
        return []
    layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
    return [v for layer in layers for v in layer.trainable_weights]
