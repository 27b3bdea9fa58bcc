"""Objects pickled straight into writable byte arrays, for the collectives that carry Python objects.

`np.frombuffer(pickle.dumps(obj))` is read-only, and torch warns ("The given NumPy array is not writable") when
the Gloo engine wraps such an array as a send tensor; pickling into a BytesIO and viewing its buffer gives the
same bytes, writable, without a copy.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

__all__ = ["pickled"]


def pickled(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> np.ndarray:
    """`obj` pickled into a writable uint8 array (no copy of the pickle)."""
    stream = io.BytesIO()
    pickle.dump(obj, stream, protocol)
    return np.frombuffer(stream.getbuffer(), dtype=np.uint8)
