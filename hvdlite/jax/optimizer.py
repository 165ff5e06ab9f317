"""Gradient averaging for custom JAX training loops, as an optax-style gradient transformation.

    tx = hvd.DistributedOptimizer(optax.adam(1e-3))        # or any GradientTransformation
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)   # gradients averaged here
        return optax.apply_updates(params, updates), opt_state

`allreduce_gradients()` is the averaging alone, to put in an `optax.chain` where it suits.
Both are `GradientTransformation`s: optax's class where optax is installed, else a NamedTuple
with the same two fields (`init`, `update`), so optax is not needed to use them.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax

from ..common.messages import AVERAGE, SUM
from ..common.process_sets import global_process_set
from .compression import Compression
from .mpi_ops import grouped_allreduce

try:
    import optax as _optax
except ImportError:          # optax is optional
    _optax = None


class _GradientTransformation(NamedTuple):
    """optax.GradientTransformation's shape, for installs without optax."""

    init: Callable[[Any], Any]
    update: Callable[..., tuple]


GradientTransformation = _optax.GradientTransformation if _optax is not None else \
    _GradientTransformation


class AllreduceState(NamedTuple):
    """allreduce_gradients keeps no state."""


def allreduce_gradients(op: int = AVERAGE, compression=Compression.none,
                        gradient_predivide_factor: float = 1.0, name: Optional[str] = None,
                        process_set=global_process_set):
    """A gradient transformation that averages (op=Average) or sums (op=Sum) the updates
    over the ranks of `process_set`, in one grouped allreduce (fused, one host callback inside
    jit). `gradient_predivide_factor`: divide before the sum and multiply after (Horovod's)."""
    if op not in (AVERAGE, SUM):
        raise ValueError("op currently only supports Average and Sum")
    if gradient_predivide_factor != 1.0 and op != AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    f = float(gradient_predivide_factor)
    pre, post = (1.0 / f, f) if f != 1.0 else (1.0, 1.0)
    wire = name or "jax.DistributedOptimizer"

    def init(params):
        del params
        return AllreduceState()

    def update(updates, state, params=None):
        del params
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        reduced = grouped_allreduce(leaves, name=wire, compression=compression, op=op,
                                    prescale_factor=pre, postscale_factor=post,
                                    process_set=process_set)
        return jax.tree_util.tree_unflatten(treedef, reduced), state

    return GradientTransformation(init, update)


class DistributedState(NamedTuple):
    """The state of DistributedOptimizer: the averaging's (empty) and the wrapped optimizer's."""

    allreduce: AllreduceState
    inner: Any


def DistributedOptimizer(optimizer, compression=Compression.none, op: int = AVERAGE,
                         gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, name: Optional[str] = None,
                         process_set=global_process_set):
    """`optimizer` (a GradientTransformation: optax.adam(...), ...) applied to the gradients
    averaged over the ranks (Horovod's arguments). `backward_passes_per_step=N` adds up N
    passes' gradients locally and reduces and applies them once, on the N-th
    (`average_aggregated_gradients` divides the sum by N): optax.MultiSteps around the
    averaging and `optimizer`, so the allreduce runs on the N-th pass only."""
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    reduce = allreduce_gradients(op=op, compression=compression,
                                 gradient_predivide_factor=gradient_predivide_factor, name=name,
                                 process_set=process_set)

    def init(params):
        return DistributedState(reduce.init(params), optimizer.init(params))

    def update(updates, state, params=None):
        reduced, rstate = reduce.update(updates, state.allreduce, params)
        out, inner = optimizer.update(reduced, state.inner, params)
        return out, DistributedState(rstate, inner)

    tx = GradientTransformation(init, update)
    if backward_passes_per_step == 1:
        return tx
    if _optax is None:
        raise ValueError("backward_passes_per_step > 1 needs optax (pip install optax): it "
                         "accumulates the passes with optax.MultiSteps")
    return _optax.MultiSteps(tx, int(backward_passes_per_step),
                             use_grad_mean=bool(average_aggregated_gradients)
                             ).gradient_transformation()


__all__ = ["GradientTransformation", "allreduce_gradients", "DistributedOptimizer",
           "AllreduceState", "DistributedState"]
