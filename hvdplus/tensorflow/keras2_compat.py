"""Keras 2 idioms on Keras 3, so that unmodified Horovod scripts run: turned on by the `horovod` alias only.

Horovod's examples and the scripts written from them use Keras 2 forms that Keras 3 rejects:

- `keras.optimizers.SGD(lr=0.1)` (Keras 3: `learning_rate=`; raises "Argument(s) not recognized"),
- `optimizer.lr` (Keras 3: `optimizer.learning_rate`),
- `optimizer.variables()` (Keras 3: `variables` is a list property; "'list' object is not callable"),
- `model.compile(..., experimental_run_tf_function=False)` (Keras 3: no such argument; it always compiles),
- `keras.layers.BatchNormalization(fused=False)` (Keras 3: no `fused` argument; "Unrecognized keyword arguments"),
- `variable.ref()` on a Keras variable (Keras 2's variables were tf.Variables; Keras 3's have no `ref()` and are
  not hashable),
- `tf.keras.losses.mean_squared_error` and the other loss functions that Keras 3 exports from `keras.losses`
  only (`tf.keras.losses` keeps the short names such as `MSE`),
- `session.run(keras_variable)` in a tf.compat.v1 Session (Keras 3: "Can not convert a Variable"; fetch
  `variable.value`, its tf.Variable).

`enable()` makes Keras 3 accept each of them, on every optimizer (plain ones too) and model of the process,
and warns once per idiom with its Keras 3 form. hvdplusrun's `horovod` alias calls it when a script imports
horovod.tensorflow, horovod.keras or horovod.tensorflow.keras; `import hvdplus...` never does, so code
written for hvdplus meets plain Keras 3.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from tensorflow.python.client.session import register_session_run_conversion_functions
from tensorflow.python.util.object_identity import Reference  # what tf.Variable.ref() returns

__all__ = ["Keras2IdiomWarning", "enable", "enabled"]

_warned: set[str] = set()
_enabled = False


class Keras2IdiomWarning(UserWarning):
    """A Keras 2 idiom was accepted for an unmodified Horovod script; the message names the Keras 3 form."""


def _warn_once(idiom: str, keras3: str) -> None:
    """Warn about `idiom` the first time it is used, pointing at the script's line."""
    if idiom not in _warned:
        _warned.add(idiom)
        warnings.warn(
            f"{idiom} is Keras 2; hvdplus accepts it for Horovod scripts. Keras 3: {keras3}",
            Keras2IdiomWarning,
            stacklevel=_script_level(),
        )


def _script_level() -> int:
    """The stacklevel, for a warning raised by our caller, of the first frame of the script's own code: outside
    hvdplus, Keras and TF, and not a copy made by autograph (inside a tf.function that is the function's call)."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and _internal(frame):
        frame, level = frame.f_back, level + 1
    return level


def _internal(frame: types.FrameType) -> bool:
    module = frame.f_globals.get("__name__", "").split(".")[0]
    return module in ("hvdplus", "keras", "tensorflow") or "__autograph_generated_file" in frame.f_code.co_filename


class _CallableList(list):
    """Keras 3's `optimizer.variables` list that Keras 2's `optimizer.variables()` can also call."""

    @tf.autograph.experimental.do_not_convert  # called inside tf.functions: keep the warning's frames our own
    def __call__(self) -> list[Any]:
        _warn_once("optimizer.variables()", "optimizer.variables (a list property)")
        return list(self)


def _callable_variables(prop: property) -> property:
    getter = prop.fget
    assert getter is not None  # the `variables` properties patched in enable() are readable
    return property(lambda self: _CallableList(getter(self)), prop.fset, prop.fdel, prop.__doc__)


def _accept_lr(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "lr" in kwargs:
            _warn_once("the optimizer argument lr=", "learning_rate=")
            kwargs["learning_rate"] = kwargs.pop("lr")
        init(self, *args, **kwargs)

    return __init__


def _lr_alias() -> property:
    def get(self: Any) -> Any:
        _warn_once("optimizer.lr", "optimizer.learning_rate")
        return self.learning_rate

    def set_(self: Any, value: Any) -> None:
        _warn_once("optimizer.lr", "optimizer.learning_rate")
        self.learning_rate = value

    return property(get, set_, doc="Keras 2's name of `learning_rate`.")


def _drop_run_tf_function(compile_: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(compile_)
    def compile(self: Any, *args: Any, **kwargs: Any) -> None:
        if "experimental_run_tf_function" in kwargs:
            _warn_once(
                "model.compile(experimental_run_tf_function=...)",
                "leave it out (Keras 3 runs the train step as a tf.function; run_eagerly=True to debug)",
            )
            kwargs.pop("experimental_run_tf_function")
        compile_(self, *args, **kwargs)

    return compile


def _drop_fused(init: Callable[..., None]) -> Callable[..., None]:
    # No functools.wraps and no *args: Keras' Layer.__new__ reads both inspect.signature (which follows __wrapped__)
    # and getfullargspec (which does not) of __init__ and needs the two to agree.
    def __init__(self: Any, axis: Any = -1, **kwargs: Any) -> None:
        if "fused" in kwargs:
            _warn_once("BatchNormalization(fused=...)", "leave it out (Keras 3 chooses its kernel itself)")
            kwargs.pop("fused")
        init(self, axis, **kwargs)

    __init__.__doc__ = init.__doc__
    return __init__


def _variable_ref(self: Any) -> Reference:
    """Keras 2's `variable.ref()`: a hashable reference to the variable itself (`.deref()` gives it back)."""
    _warn_once("variable.ref()", "key by id(variable) or variable.path (Keras variables are not hashable)")
    return Reference(self)


def _fetch_value(variable: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """How a tf.compat.v1 Session fetches a Keras variable: its tf.Variable (`variable.value`)."""
    _warn_once("session.run(keras_variable)", "session.run(variable.value)")
    return [variable.value], lambda values: values[0]


def _keras2_losses(module: types.ModuleType) -> Callable[[str], Any]:
    """A module `__getattr__` for `tf.keras.losses`: the loss functions only `keras.losses` exports in Keras 3."""
    import keras

    def __getattr__(name: str) -> Any:
        function = getattr(keras.losses, name, None) if not name.startswith("_") else None
        if function is None:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        _warn_once(f"tf.keras.losses.{name}", f"keras.losses.{name}")
        return function

    return __getattr__


def enable() -> None:
    """Make this process's Keras 3 accept the Keras 2 idioms above (idempotent)."""
    global _enabled
    if _enabled:
        return
    from keras._tf_keras.keras import losses as tf_keras_losses
    from keras.src.backend.tensorflow.core import Variable
    from keras.src.layers.normalization.batch_normalization import BatchNormalization
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
    from keras.src.trainers.trainer import Trainer

    BaseOptimizer.__init__ = _accept_lr(BaseOptimizer.__init__)
    BaseOptimizer.lr = _lr_alias()
    for cls in (BaseOptimizer, LossScaleOptimizer):  # the classes that define the `variables` property
        cls.variables = _callable_variables(cls.__dict__["variables"])
    Trainer.compile = _drop_run_tf_function(Trainer.compile)
    BatchNormalization.__init__ = _drop_fused(BatchNormalization.__init__)
    Variable.ref = _variable_ref
    tf_keras_losses.__getattr__ = _keras2_losses(tf_keras_losses)
    register_session_run_conversion_functions(Variable, _fetch_value)
    _enabled = True


def enabled() -> bool:
    """Whether `enable()` ran in this process."""
    return _enabled
