"""hvdplus.tensorflow.keras: the same module as hvdplus.keras (horovod.tensorflow.keras's import path)."""

import sys

import hvdplus.keras

sys.modules[__name__] = hvdplus.keras
