"""hvdplus.tensorflow.keras: the same module as hvdplus.keras (horovod.tensorflow.keras's import path), its
submodules included (`from hvdplus.tensorflow.keras.elastic import KerasState` gets hvdplus.keras.elastic's)."""

import sys

import hvdplus.keras

sys.modules[__name__] = hvdplus.keras
for _name, _module in list(sys.modules.items()):
    if _name.startswith("hvdplus.keras."):
        sys.modules[__name__ + _name[len("hvdplus.keras") :]] = _module
