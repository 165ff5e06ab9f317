"""Local gradient accumulation (`backward_passes_per_step`): add up the gradients of N backward
passes locally and reduce and apply them once, as Horovod's LocalGradientAggregationHelper.

Works eagerly and inside graphs (`tf.function`, Keras `model.fit`): the decision to apply is a
`tf.cond` on a step counter held in a variable, so one traced graph serves every step.
"""
from __future__ import annotations

import tensorflow as tf


class LocalGradientAggregationHelper:
    """Accumulates gradients for `backward_passes_per_step` passes before one reduction.

    `allreduce_func(grads, variables)` reduces a list of gradients (None entries stay None).
    With `average_aggregated_gradients` the accumulated sum is divided by the number of passes
    (Horovod's default is the sum, which matches the loss of the concatenated micro-batches only
    for losses that are sums; use the average for mean losses).
    """

    _OPTIMIZER_TYPE_KERAS = "keras"
    _OPTIMIZER_TYPE_LEGACY = "legacy"

    def __init__(self, backward_passes_per_step, allreduce_func, sparse_as_dense=False,
                 average_aggregated_gradients=False, rank=None, optimizer_type=None,
                 process_set=None, scale_local_gradients=True, name=None):
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.allreduce_func = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.optimizer_type = optimizer_type
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.name = name or "LocalGradientAggregationHelper"
        self.counter = None
        self._acc: dict = {}
        self._local = set()

    # ------------------------------------------------------------------ state
    def init(self, variables) -> None:
        """Create the step counter and one zero accumulator per variable (once)."""
        from .gradients import var_ref
        with tf.init_scope():
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name=f"{self.name}_counter",
                                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for v in variables:
                key = var_ref(v)
                if key in self._acc:
                    continue
                dtype = tf.as_dtype(v.dtype)
                self._acc[key] = tf.Variable(tf.zeros(v.shape, dtype=dtype), trainable=False,
                                             name=f"{self.name}_acc")

    def reset(self) -> None:
        """Drop the passes added up since the last reduction (an elastic reset: every rank
        starts counting again from 0, so their reductions stay in step; a rank that joined, or
        one restored to the last commit, would otherwise count differently)."""
        if self.counter is not None:
            self.counter.assign(0)
        for acc in self._acc.values():
            acc.assign(tf.zeros_like(acc))

    def register_local_var(self, var) -> None:
        from .gradients import var_ref
        self._local.add(var_ref(var))

    def _accumulator(self, var):
        from .gradients import var_ref
        acc = self._acc.get(var_ref(var))
        if acc is None:
            raise ValueError(f"no gradient accumulator for variable {getattr(var, 'name', var)}: "
                             f"the variables passed to apply changed after the first step")
        return acc

    # ------------------------------------------------------------------ one pass
    def step(self, grads, variables, apply_fn, skip_fn=None):
        """Add `grads` to the accumulators; on every N-th call reduce the sums and call
        `apply_fn(reduced_grads, variables)`, otherwise `skip_fn()`. Returns a boolean (tensor)
        telling whether this call applied."""
        grads = list(grads)
        variables = list(variables)
        self.init(variables)
        n = self.backward_passes_per_step
        updates = []
        for g, v in zip(grads, variables):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            acc = self._accumulator(v)
            updates.append(acc.assign_add(tf.cast(g, acc.dtype), read_value=False))
        with tf.control_dependencies([u for u in updates if u is not None]):
            count = self.counter.assign_add(1, read_value=True)

        present = [g is not None for g in grads]

        def do_apply():
            summed = []
            for p, v in zip(present, variables):
                if not p:
                    summed.append(None)
                    continue
                value = tf.identity(self._accumulator(v).read_value())
                if self.average_aggregated_gradients:
                    value = value / tf.cast(n, value.dtype)
                summed.append(value)
            reduced = self.allreduce_func(summed, variables)
            result = apply_fn(reduced, variables)
            deps = [result] if isinstance(result, (tf.Operation, tf.Tensor)) else []
            with tf.control_dependencies(deps):
                resets = [self._accumulator(v).assign(tf.zeros_like(self._accumulator(v)),
                                                      read_value=False)
                          for p, v in zip(present, variables) if p]
                resets.append(self.counter.assign(0, read_value=False))
            if tf.executing_eagerly():
                return tf.constant(True)
            with tf.control_dependencies([r for r in resets if r is not None]):
                return tf.constant(True)

        def do_skip():
            result = skip_fn() if skip_fn is not None else None
            if tf.executing_eagerly():
                return tf.constant(False)
            deps = [result] if isinstance(result, (tf.Operation, tf.Tensor)) else []
            with tf.control_dependencies(deps):
                return tf.constant(False)

        if tf.executing_eagerly():
            return do_apply() if int(count) >= n else do_skip()
        return tf.cond(tf.greater_equal(count, n), do_apply, do_skip)


__all__ = ["LocalGradientAggregationHelper"]
