"""`import hvdlite.keras as hvd`: Horovod's `horovod.keras` API on Keras 3.

Horovod kept a standalone-Keras API (`horovod.keras`) beside `horovod.tensorflow.keras`; on Keras 3
there is one Keras, with several backends. The backend Keras runs on picks the implementation:

- `tensorflow`: everything is `hvdlite.tensorflow.keras` (same objects);
- `torch` (`KERAS_BACKEND=torch`): the same names, with the collectives going through
  `hvdlite.torch` (see `_torch.py`);
- `jax` (`KERAS_BACKEND=jax`): the same names, with the collectives going through `hvdlite.jax`,
  inside the compiled train step as host callbacks (see `_jax.py`).
"""
from __future__ import annotations

import keras as _keras

BACKEND = _keras.backend.backend()

if BACKEND == "tensorflow":
    from ..tensorflow.keras import *  # noqa: F401,F403
    from ..tensorflow.keras import __all__ as _names
    from ..tensorflow.keras import (Average, Compression, allgather, allreduce,  # noqa: F401
                                    broadcast, broadcast_global_variables, global_process_set,
                                    load_model, reducescatter)
    from ..tensorflow.keras import DistributedOptimizer as _backend_optimizer
elif BACKEND == "torch":
    from ._torch import *  # noqa: F401,F403
    from ._torch import __all__ as _names
    from ._torch import Average, Compression, global_process_set
    from ._torch import DistributedOptimizer as _backend_optimizer
elif BACKEND == "jax":
    from ._jax import *  # noqa: F401,F403
    from ._jax import __all__ as _names
    from ._jax import Average, Compression, global_process_set
    from ._jax import DistributedOptimizer as _backend_optimizer
else:
    raise ImportError(f"hvdlite.keras supports Keras 3 on the 'tensorflow', 'torch' and 'jax' "
                      f"backends; this Keras runs on {BACKEND!r}. Set KERAS_BACKEND=tensorflow, "
                      f"torch or jax.")

from . import callbacks  # noqa: E402,F401


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, num_groups=0, groups=None, *,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         process_set=global_process_set, scale_local_gradients=True):
    """horovod.keras' DistributedOptimizer: the backend's (hvdlite.tensorflow.keras's
    arguments), in horovod.keras' order.

    Why a signature of its own: horovod.keras takes `num_groups` and `groups` right after `op`,
    where horovod.tensorflow.keras takes `backward_passes_per_step` and
    `average_aggregated_gradients`; a horovod.keras script that passed `num_groups`
    positionally would otherwise accumulate gradients over that many steps, silently. The
    arguments horovod.keras lacks are keyword-only."""
    return _backend_optimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def __getattr__(name):
    if name == "elastic":
        import importlib
        return importlib.import_module(".elastic", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(set(_names) | {"callbacks", "elastic"})
