"""`import hvdlite.jax as hvd`: Horovod's collectives and gradient averaging for JAX.

    hvd.init()
    params = hvd.broadcast_parameters(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.adam(1e-3))
    total = hvd.allreduce(x, op=hvd.Sum)          # eagerly, or inside jax.jit

Collectives take and return jax.Arrays (NumPy arrays and numbers are accepted). Eagerly they
cross into the engine over DLPack, without a copy; inside `jax.jit` they run as ordered host
callbacks (bridge.py). See docs/jax.md.
"""
from __future__ import annotations

from . import elastic  # noqa: F401
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import (AllreduceState, DistributedOptimizer, DistributedState,  # noqa: F401
                        GradientTransformation, allreduce_gradients)

__all__ = list(_ops_all) + ["elastic", "DistributedOptimizer", "allreduce_gradients",
                            "GradientTransformation", "AllreduceState", "DistributedState"]
