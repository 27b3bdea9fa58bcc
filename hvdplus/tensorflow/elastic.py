"""hvd.elastic for TensorFlow (horovod.tensorflow.elastic): run, State, ObjectState, TensorFlowState,
TensorFlowKerasState.

The states keep lists of variables, Keras models and Keras optimizers through handlers (HandledState, as
TorchState does). A commit copies the variables' values into host arrays that the first commit allocates and later
ones reuse (Horovod keeps a fresh copy of every variable at each commit): one copy of the state per commit, into
the same memory each time. A restore assigns them back; a sync broadcasts rank 0's variables, then commits them.
State and ObjectState are exported here too, as in hvdplus.torch.elastic, for users who subclass them.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import tensorflow as tf

from hvdplus.common.basics import rank
from hvdplus.common.collectives import broadcast_object
from hvdplus.common.elastic.state import HandledState, ObjectState, OptimizerHandler, State, StateHandler, run_fn
from hvdplus.common.exceptions import HorovodInternalError
from hvdplus.tensorflow.functions import broadcast_variables

if TYPE_CHECKING:
    import keras
    from tensorflow.compat.v1 import Session

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState"]

# The graph ops that run and check a collective (hvdplus.tensorflow._graph.execute), as a failed op names them.
_COLLECTIVE_NODE = re.compile(r"\{\{node (?:[^{}]*/)?Horovod(?:Submit|Wait|Check)(?:_\d+)?\}\}")


_StateT = TypeVar("_StateT", bound=State)
_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def _collective_errors_as_internal(func: Callable[_Params, _Result]) -> Callable[_Params, _Result]:
    """`func`, raising HorovodInternalError for a collective that failed inside a graph (a tf.function, Keras'
    train step): TensorFlow reports it as the OpError of the collective's op, as Horovod's ops' UnknownError."""

    @functools.wraps(func)
    def wrapper(*args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as exc:
            if isinstance(exc, HorovodInternalError) or not _COLLECTIVE_NODE.search(exc.message or ""):
                raise
            raise HorovodInternalError(exc.message) from exc

    return wrapper


def run(
    func: Callable[Concatenate[_StateT, _Params], _Result],
) -> Callable[Concatenate[_StateT, _Params], _Result]:
    """Decorate the training function `func(state, ...)`: it runs until it returns, across failures and host
    changes (see hvdplus.common.elastic.state). Collectives must not run outside it, or new workers would deadlock
    against the others' state sync."""
    return run_fn(_collective_errors_as_internal(func))


def _host_copy(value: Any, old: np.ndarray | None) -> np.ndarray:
    """`value` (a tensor or an array) copied into `old` when it fits, else into a new array."""
    source = np.asarray(value)  # a host tensor's own memory: the copy below is the only one
    if old is None or old.shape != source.shape or old.dtype != source.dtype:
        return np.array(source, copy=True)
    np.copyto(old, source)
    return old


class _Eager:
    """Reads, loads and broadcasts variables eagerly."""

    def read(self, variables: list[Any]) -> list[Any]:
        return [tf.convert_to_tensor(v) for v in variables]

    def load(self, variables: list[Any], arrays: list[np.ndarray]) -> None:
        for variable, array in zip(variables, arrays):
            variable.assign(array)

    def broadcast(self, variables: list[Any]) -> None:
        broadcast_variables(variables, root_rank=0)


class _InSession:
    """Reads, loads and broadcasts a fixed list of graph variables with ops built once and run by `session`."""

    def __init__(self, session: Session, variables: list[Any]) -> None:
        self.session = session
        with session.graph.as_default():
            self._bcast_op = broadcast_variables(variables, root_rank=0)
            self._feeds = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in variables]
            self._load_op = tf.group(*[v.assign(feed) for v, feed in zip(variables, self._feeds)])

    def read(self, variables: list[Any]) -> list[Any]:
        return self.session.run(variables)

    def load(self, variables: list[Any], arrays: list[np.ndarray]) -> None:
        self.session.run(self._load_op, dict(zip(self._feeds, arrays)))

    def broadcast(self, variables: list[Any]) -> None:
        self.session.run(self._bcast_op)


class _VariablesHandler(StateHandler):
    """A list of variables, committed into reusable host arrays."""

    def __init__(self, value: Any, access: _Eager | _InSession) -> None:
        super().__init__(value)
        self._access = access
        self._saved: list[Any] = []
        self._arrays: list[np.ndarray] = []
        self.save()

    def variables(self) -> list[Any]:
        """The variables a commit keeps (listed at each commit: an optimizer's list grows when it is built)."""
        return list(self.value)

    def save(self) -> None:
        variables = self.variables()
        values = self._access.read(variables)
        old: list[np.ndarray | None] = [*self._arrays, *[None] * (len(values) - len(self._arrays))]
        self._arrays = [_host_copy(value, array) for value, array in zip(values, old)]
        self._saved = variables

    def restore(self) -> None:
        self._access.load(self._saved, self._arrays)

    def sync(self) -> None:
        self._access.broadcast(self.variables())
        self.save()  # as Horovod's TF states: a failure before the next commit goes back to rank 0's values


class _KerasHandler(_VariablesHandler):
    """A Keras object's variables (its `variables` list)."""

    def variables(self) -> list[Any]:
        return list(self.value.variables)


class _ModelHandler(_KerasHandler):
    """A Keras model's variables; fit traces its train step again after a reset."""

    def reset(self) -> None:
        self.value.make_train_function(force=True)  # the step traced before was traced for the old size


class _OptimizerHandler(OptimizerHandler, _KerasHandler):
    """A Keras optimizer's variables; a DistributedOptimizer's gradient accumulation is emptied at a reset."""


def _is_variable(value: Any) -> bool:
    keras = sys.modules.get("keras")  # a Keras variable exists only if the program imported Keras
    return isinstance(value, tf.Variable) or (keras is not None and isinstance(value, keras.Variable))


def _handler_for(session: Session | None) -> Callable[[Any], StateHandler | None]:
    """The handler of a state attribute: lists of variables (read and written by `session` in a graph), Keras
    models and Keras optimizers; None for the plain Python objects."""

    def handler(value: Any) -> StateHandler | None:
        if isinstance(value, (list, tuple)) and value and all(_is_variable(v) for v in value):
            return _VariablesHandler(value, _Eager() if session is None else _InSession(session, list(value)))
        keras = sys.modules.get("keras")
        if keras is not None and isinstance(value, keras.Model):
            if not value.built:
                raise ValueError("Model must be built first. Run `model.build(input_shape)` (or call it on a batch).")
            return _ModelHandler(value, _Eager())
        if keras is not None and isinstance(value, keras.optimizers.Optimizer):
            if hasattr(value, "replicated_variables"):
                raise TypeError(
                    "an elastic state cannot keep a ZeroOptimizer yet: its state is sharded over the "
                    "ranks of one generation of the job and is not resharded at an elastic reset. Use "
                    "hvd.DistributedOptimizer in elastic jobs."
                )
            return _OptimizerHandler(value, _Eager())
        return None

    return handler


class TensorFlowState(HandledState):
    """State of a list of TensorFlow variables (default: tf.compat.v1.global_variables()) and keyword attributes;
    lists of variables, Keras models and Keras optimizers among these are committed as variables too.

    In a tf.compat.v1 graph, `session` (default: the default session) reads, loads and broadcasts the variables."""

    def __init__(self, variables: Sequence[Any] | None = None, session: Session | None = None, **kwargs: Any) -> None:
        if not tf.executing_eagerly():
            session = session or tf.compat.v1.get_default_session()
            if session is None:
                raise ValueError(
                    "TensorFlowState in graph mode needs a session: pass session=, or create the state "
                    "inside `with session.as_default():`"
                )
        self.session = session
        super().__init__(
            _handler_for(session),
            bcast_object=broadcast_object,
            get_rank=rank,
            variables=list(variables) if variables else tf.compat.v1.global_variables(),
            **kwargs,
        )


class TensorFlowKerasState(HandledState):
    """State of a built Keras 3 model, its optimizer (or `optimizer`) and keyword attributes.

    An optimizer that has not been applied yet is built on the model's trainable variables, so that its slots
    are committed and synced from the start. `backend` is accepted for Horovod (Keras 3 runs eagerly)."""

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        backend: Any = None,
        **kwargs: Any,
    ) -> None:
        optimizer = optimizer or getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("TensorFlowKerasState needs an optimizer: compile the model with one, or pass optimizer=")
        if model.built and not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.backend = backend
        super().__init__(
            _handler_for(None), bcast_object=broadcast_object, get_rank=rank, model=model, optimizer=optimizer, **kwargs
        )
