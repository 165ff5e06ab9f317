"""Horovod's `hvd.DistributedOptimizer` for TensorFlow: wraps a TF1 `tf.compat.v1.train.Optimizer`
(gradients are reduced in `compute_gradients`), and hands Keras optimizers to
`hvdlite.tensorflow.keras.DistributedOptimizer`."""
from __future__ import annotations

import tensorflow as tf

from .compression import Compression
from .gradient_aggregation import LocalGradientAggregationHelper
from .gradients import GradientReducer, check_reduce_args
from .mpi_ops import Adasum, Average, global_process_set

_LegacyOptimizer = tf.compat.v1.train.Optimizer


class _DistributedOptimizer(_LegacyOptimizer):
    """A TF1 optimizer that reduces gradients over the ranks before applying them."""

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="",
                 device_sparse="", compression=Compression.none, sparse_as_dense=False,
                 op=Average, gradient_predivide_factor=1.0, backward_passes_per_step=1,
                 average_aggregated_gradients=False, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._reducer = GradientReducer(
            "DistributedOptimizer", compression=compression, sparse_as_dense=sparse_as_dense,
            op=op, gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
        self._agg_helper = None
        if backward_passes_per_step > 1:
            self._agg_helper = LocalGradientAggregationHelper(
                backward_passes_per_step=backward_passes_per_step,
                allreduce_func=lambda g, v: self._reducer.reduce(g, v),
                sparse_as_dense=True,
                average_aggregated_gradients=average_aggregated_gradients,
                optimizer_type=LocalGradientAggregationHelper._OPTIMIZER_TYPE_LEGACY,
                process_set=process_set, scale_local_gradients=scale_local_gradients,
                name=name)

    def register_local_var(self, var):
        """Keep `var`'s gradient local: not reduced (divided by the set size when
        scale_local_gradients)."""
        self._reducer.register_local(var)
        if self._agg_helper is not None:
            self._agg_helper.register_local_var(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced over the ranks (with
        backward_passes_per_step > 1 they are reduced in `apply_gradients` instead, once every
        N passes)."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        if self._agg_helper is not None:
            return gradients
        grads, variables = zip(*gradients) if gradients else ((), ())
        reduced = self._reducer.reduce(list(grads), list(variables))
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Calls this same method on the wrapped optimizer."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        pairs = [(g, v) for g, v in grads_and_vars]
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]

        def apply_fn(reduced, variables_):
            present = [(g, v) for g, v in zip(reduced, variables_) if g is not None]
            return self._optimizer.apply_gradients(present, global_step=global_step, name=name)

        def skip_fn():
            if global_step is None:
                return tf.no_op() if not tf.executing_eagerly() else None
            return global_step.assign_add(1)

        applied = self._agg_helper.step(grads, variables, apply_fn, skip_fn)
        return None if tf.executing_eagerly() else applied.op

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap `optimizer` so that gradients are averaged (or summed) over the ranks of
    `process_set` before every update.

    A TF1 optimizer (`tf.compat.v1.train.Optimizer`) is wrapped here; a Keras optimizer (Keras 3,
    or tf_keras under TF_USE_LEGACY_KERAS=1) goes to
    `hvdlite.tensorflow.keras.DistributedOptimizer`.
    Arguments as Horovod 0.28's; `average_aggregated_gradients` divides the gradients summed over
    `backward_passes_per_step` passes by that number.
    """
    groups = check_reduce_args(op, gradient_predivide_factor, num_groups, groups)
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if isinstance(optimizer, _LegacyOptimizer):
        if op == Adasum:
            # Horovod wraps a TF1 optimizer in its delta formulation (_DistributedAdasumOptimizer:
            # step locally, then Adasum the change); reducing the gradients by Adasum instead
            # would train differently without a word.
            raise NotImplementedError(
                "DistributedOptimizer(op=Adasum) for a TF1 optimizer (Horovod's delta "
                "formulation) is not available in hvdlite; use "
                "DistributedGradientTape(tape, op=hvd.Adasum), which reduces the gradients by "
                "Adasum as Horovod's tape does, or hvdlite.torch's DistributedOptimizer")
        return _DistributedOptimizer(
            optimizer=optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
            device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    from .keras.optimizer import create_distributed_optimizer, optimizer_flavor
    try:
        optimizer_flavor(optimizer)
    except ValueError as exc:
        raise ValueError(f"Provided optimizer doesn't inherit from either legacy TensorFlow or "
                         f"Keras optimizer: {exc}") from None
    return create_distributed_optimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)


__all__ = ["DistributedOptimizer"]
