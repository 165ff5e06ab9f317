"""`import hvdlite.keras as hvd`: Horovod's `horovod.keras` API on Keras 3.

Horovod kept a standalone-Keras API (`horovod.keras`) beside `horovod.tensorflow.keras`; on Keras 3
there is one Keras, with several backends. The backend Keras runs on picks the implementation:

- `tensorflow`: everything is `hvdlite.tensorflow.keras` (same objects);
- `torch` (`KERAS_BACKEND=torch`): the same names, with the collectives going through
  `hvdlite.torch` (see `_torch.py`).
"""
from __future__ import annotations

import keras as _keras

BACKEND = _keras.backend.backend()

if BACKEND == "tensorflow":
    from ..tensorflow.keras import *  # noqa: F401,F403
    from ..tensorflow.keras import __all__ as _names
    from ..tensorflow.keras import (DistributedOptimizer, allgather, allreduce,  # noqa: F401
                                    broadcast, broadcast_global_variables, load_model,
                                    reducescatter)
elif BACKEND == "torch":
    from ._torch import *  # noqa: F401,F403
    from ._torch import __all__ as _names
else:
    raise ImportError(f"hvdlite.keras supports Keras 3 on the 'tensorflow' and 'torch' backends; "
                      f"this Keras runs on {BACKEND!r}. Set KERAS_BACKEND=tensorflow or torch.")

from . import callbacks  # noqa: E402,F401


def __getattr__(name):
    if name == "elastic":
        import importlib
        return importlib.import_module(".elastic", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(set(_names) | {"callbacks", "elastic"})
