"""Horovod's Keras `DistributedOptimizer` on Keras 3 (and on Keras 2 via `tf_keras`).

The wrapper is a dynamically created subclass of the user's optimizer class with the SAME name and
module, built from the optimizer's config, so `model.save()` records a plain `Adam` (or `SGD`, ...)
that plain Keras loads, and `isinstance(opt, keras.optimizers.Adam)` still holds.

It reduces gradients on the optimizer's public path: Keras 3 routes `apply_gradients` and
`model.fit` through `Optimizer.apply(grads, variables)`, which is overridden; Keras 2 (`tf_keras`,
`TF_USE_LEGACY_KERAS=1`) routes `minimize` and `model.fit` through `apply_gradients`, which is
overridden there. No private optimizer method is patched (the reason Horovod's Keras support broke
with Keras 3, horovod#4290).
"""
from __future__ import annotations

import json
import os
import warnings

import tensorflow as tf

from ..._keras_callbacks import built_layer_variables as _built_layer_variables
from ..._keras_callbacks import optimizer_variables as _optimizer_variables
from ..compression import Compression
from ..gradient_aggregation import LocalGradientAggregationHelper
from ..gradients import GradientReducer, check_reduce_args, var_ref
from ..mpi_ops import Average, Sum, global_process_set


# ---------------------------------------------------------------------- which Keras
def keras_module():
    """The Keras that `tf.keras` resolves to: Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1."""
    return tf.keras


def keras_version() -> str:
    version = getattr(tf.keras, "__version__", None)
    if version is None:
        try:
            import tf_keras
            version = tf_keras.__version__
        except ImportError:
            version = "2"
    return str(version)


def is_keras3() -> bool:
    try:
        return int(keras_version().split(".")[0]) >= 3
    except ValueError:
        return True


def _legacy_keras_requested() -> bool:
    # TensorFlow's own rule for what tf.keras resolves to.
    return os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1")


def _configured_backend():
    """The backend Keras 3 will load: KERAS_BACKEND, else keras.json, else None (tensorflow)."""
    backend = os.environ.get("KERAS_BACKEND")
    if backend:
        return backend
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        return None


def _backend_error(backend: str, detail: str = "") -> ImportError:
    return ImportError(
        f"hvdlite.tensorflow.keras needs Keras on the TensorFlow backend, but Keras 3 is set to "
        f"the {backend!r} backend (KERAS_BACKEND={os.environ.get('KERAS_BACKEND', '')!r} or "
        f"keras.json){detail}. Set KERAS_BACKEND=tensorflow before importing Keras"
        + (", or train a PyTorch-backend model with hvdlite.torch" if backend == "torch" else "")
        + (", or run Keras 2 code with TF_USE_LEGACY_KERAS=1 and the tf_keras package"
           if backend != "torch" else "") + ".")


def check_backend() -> None:
    """Keras 3 must run on the TensorFlow backend for hvdlite.tensorflow.keras."""
    if not _legacy_keras_requested():
        configured = _configured_backend()
        if configured not in (None, "tensorflow"):
            raise _backend_error(configured)
    try:
        if not is_keras3():
            return
        import keras
    except Exception as exc:
        raise ImportError(f"hvdlite.tensorflow.keras could not import Keras through tf.keras: "
                          f"{exc}") from exc
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise _backend_error(backend)


def _keras3_optimizer_base():
    try:
        import keras
        return keras.optimizers.Optimizer
    except Exception:
        return None


def _tf_keras_optimizer_bases() -> tuple:
    bases = []
    try:
        import tf_keras
        bases.append(tf_keras.optimizers.Optimizer)
        bases.append(tf_keras.optimizers.legacy.Optimizer)
    except Exception:
        pass
    return tuple(bases)


def _describe(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_flavor(optimizer) -> str:
    """'keras3', 'tf_keras' or 'tf_keras_legacy'; raises a clear error for anything else."""
    k3 = _keras3_optimizer_base()
    if k3 is not None and isinstance(optimizer, k3):
        import keras
        backend = keras.backend.backend()
        if backend != "tensorflow":
            raise ValueError(f"{_describe(optimizer)} is a Keras 3 optimizer on the {backend!r} "
                             f"backend; hvdlite.tensorflow.keras needs KERAS_BACKEND=tensorflow")
        return "keras3"
    try:
        import keras
        base = keras.src.optimizers.base_optimizer.BaseOptimizer
        if isinstance(optimizer, base):
            raise ValueError(
                f"{_describe(optimizer)} is a Keras 3 optimizer for the "
                f"{keras.backend.backend()!r} backend; hvdlite.tensorflow.keras needs "
                f"KERAS_BACKEND=tensorflow")
    except (ImportError, AttributeError):
        pass
    tfk = _tf_keras_optimizer_bases()
    if tfk and isinstance(optimizer, tfk[0]):
        return "tf_keras"
    if len(tfk) > 1 and isinstance(optimizer, tfk[1]):
        return "tf_keras_legacy"
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ValueError(f"{_describe(optimizer)} is a TF1 optimizer, not a Keras one: use "
                         f"hvdlite.tensorflow.DistributedOptimizer for it")
    raise ValueError(
        f"hvdlite.tensorflow.keras.DistributedOptimizer wraps Keras optimizers "
        f"(keras.optimizers.Optimizer subclasses such as SGD, Adam, AdamW; or tf_keras ones "
        f"under TF_USE_LEGACY_KERAS=1), got {_describe(optimizer)}")


# ---------------------------------------------------------------------- shared state
class _HvdConfig:
    """hvdlite's settings on a wrapped optimizer (a plain object: Keras does not track it and
    `get_config()` does not see it)."""

    def __init__(self, reducer: GradientReducer, agg, source):
        self.reducer = reducer
        self.agg = agg
        self.source = source
        # PartialDistributedOptimizer's local layers that were not built yet: their variables
        # are registered as local once they exist (register_pending_layers).
        self.pending_layers: list = []
        # The gradients the last `_compute_gradients` returned, already reduced (tf_keras):
        # apply_gradients applies exactly these without reducing them again.
        self.reduced: list = []


def register_pending_layers(optimizer) -> None:
    """Register the variables of the optimizer's local layers (PartialDistributedOptimizer)
    built since the last call, before the update that would reduce them."""
    hvd = optimizer._hvd
    if hvd.pending_layers:
        found, hvd.pending_layers = _built_layer_variables(hvd.pending_layers)
        for var in found:
            optimizer.register_local_var(var)


def _copy_state(dst, src) -> None:
    """Carry a built optimizer's state (iterations, slots) into its wrapper."""
    sv, dv = _optimizer_variables(src), _optimizer_variables(dst)
    if len(sv) != len(dv) or any(tuple(a.shape) != tuple(b.shape) for a, b in zip(sv, dv)):
        warnings.warn(f"hvdlite: the wrapped {type(src).__name__} was already used on other "
                      f"variables; its state (slots, iterations) is not carried over", stacklevel=2)
        return
    for d, s in zip(dv, sv):
        d.assign(s)


class _Keras3Distributed:
    """Methods of the Keras 3 wrapper (first base of the dynamic subclass)."""

    _hvd_distributed = True

    def register_local_var(self, var):
        """Keep `var`'s gradient local: not reduced (divided by the set size when
        scale_local_gradients)."""
        self._hvd.reducer.register_local(var)
        if self._hvd.agg is not None:
            self._hvd.agg.register_local_var(var)

    def build(self, variables):
        super().build(variables)
        hvd = self._hvd
        if hvd.source is not None:
            if getattr(hvd.source, "built", False):
                with tf.init_scope():  # once, now: not as an op of a graph being traced
                    _copy_state(self, hvd.source)
            hvd.source = None
        if hvd.agg is not None:
            hvd.agg.init(variables)

    def apply(self, grads, trainable_variables=None):
        hvd = self._hvd
        register_pending_layers(self)
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                return super().apply(grads, None)  # Keras' own error
            variables = list(self._trainable_variables)
            passed = None
        else:
            variables = list(trainable_variables)
            if not self.built:
                import keras
                scope = getattr(keras, "name_scope", None)
                with (scope(self.name, caller=self) if scope is not None
                      else tf.name_scope(self.name)):
                    self.build(variables)
                self.built = True
            passed = variables
        if hvd.agg is None:
            reduced = hvd.reducer.reduce(grads, variables)
            return super().apply(reduced, passed)

        def apply_fn(reduced, variables_):
            return super(_Keras3Distributed, self).apply(reduced, passed)

        def skip_fn():
            # Horovod counts every backward pass as an iteration.
            self.iterations.assign_add(1)

        hvd.agg.step(grads, variables, apply_fn, skip_fn)


class _TFKerasDistributed:
    """Methods of the Keras 2 (tf_keras) wrapper.

    Besides `apply_gradients` (which reduces the gradients it is given), the methods Horovod's
    Keras optimizer has on tf_keras, which Horovod's scripts and tests call: `_compute_gradients`
    / `compute_gradients` (the gradients of a loss, reduced), `get_gradients` (the same on
    OptimizerV2), `_aggregate_gradients` (tf_keras' hook, left to the base class: the reduction
    happens in the other two, as in Horovod) and `_agg_helper` (the backward-passes helper, None
    without one). Gradients that `_compute_gradients` reduced and that reach `apply_gradients`
    unchanged (the same tensor objects) are applied without a second reduction. With
    `backward_passes_per_step > 1` they come back local: `apply_gradients` adds them up and
    reduces every N-th pass."""

    _hvd_distributed = True

    @property
    def _agg_helper(self):
        return self._hvd.agg

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        grads, variables = (list(x) for x in zip(*pairs)) if pairs else ([], [])
        return list(zip(self._allreduce(grads, variables), variables))

    def get_gradients(self, loss, params):
        return self._allreduce(super().get_gradients(loss, params), list(params))

    def _aggregate_gradients(self, grads_and_vars):
        base = super()
        if hasattr(base, "_aggregate_gradients"):
            return base._aggregate_gradients(grads_and_vars)
        return base.aggregate_gradients(grads_and_vars)

    def _allreduce(self, grads, variables) -> list:
        """`grads` reduced over the set (local variables' kept), or as they are where
        `apply_gradients` accumulates them first (backward_passes_per_step > 1)."""
        hvd = self._hvd
        register_pending_layers(self)
        if hvd.agg is not None:
            return list(grads)
        reduced = hvd.reducer.reduce(list(grads), list(variables))
        hvd.reduced = [g for g in reduced if g is not None]
        return reduced

    def _hvd_already_reduced(self, grads: list) -> bool:
        kept, self._hvd.reduced = self._hvd.reduced, []
        present = [g for g in grads if g is not None]
        return bool(present) and len(present) == len(kept) and \
            all(g is k for g, k in zip(present, kept))

    def register_local_var(self, var):
        self._hvd.reducer.register_local(var)
        if self._hvd.agg is not None:
            self._hvd.agg.register_local_var(var)

    def _hvd_ensure_built(self, variables):
        hvd = self._hvd
        if hasattr(self, "_create_all_weights"):          # legacy OptimizerV2
            self._create_all_weights(variables)
        elif not getattr(self, "_built", False):
            with tf.init_scope():
                self.build(variables)
        if hvd.source is not None:
            if _optimizer_variables(hvd.source):
                with tf.init_scope():
                    _copy_state(self, hvd.source)
            hvd.source = None

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        hvd = self._hvd
        register_pending_layers(self)
        pairs = list(grads_and_vars)
        if not pairs:
            return super().apply_gradients(pairs, *args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if hvd.source is not None or hvd.agg is not None:
            self._hvd_ensure_built(variables)
        if hvd.agg is None:
            reduced = grads if self._hvd_already_reduced(grads) else \
                hvd.reducer.reduce(grads, variables)
            return super().apply_gradients(list(zip(reduced, variables)), *args, **kwargs)

        def apply_fn(reduced, variables_):
            return super(_TFKerasDistributed, self).apply_gradients(
                list(zip(reduced, variables_)), *args, **kwargs)

        def skip_fn():
            return self.iterations.assign_add(1)

        return hvd.agg.step(grads, variables, apply_fn, skip_fn)


def _distributed_class(base, flavor: str):
    mixin = _Keras3Distributed if flavor == "keras3" else _TFKerasDistributed
    return type(base.__name__, (mixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "__doc__": base.__doc__})


_CLASS_CACHE: dict = {}


def distributed_class_for(base, flavor: str):
    key = (base, flavor)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = _CLASS_CACHE[key] = _distributed_class(base, flavor)
    return cls


def create_distributed_optimizer(optimizer, name=None, device_dense="", device_sparse="",
                                 compression=Compression.none, sparse_as_dense=False,
                                 gradient_predivide_factor=1.0, op=Average,
                                 backward_passes_per_step=1, average_aggregated_gradients=False,
                                 num_groups=0, groups=None, process_set=global_process_set,
                                 scale_local_gradients=True):
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    groups = check_reduce_args(op, gradient_predivide_factor, num_groups, groups)
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if getattr(optimizer, "_hvd_distributed", False):
        raise ValueError(f"{type(optimizer).__name__} is already a hvdlite DistributedOptimizer")
    flavor = optimizer_flavor(optimizer)
    cls = distributed_class_for(type(optimizer), flavor)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    new = cls.from_config(config)
    reducer = GradientReducer("DistributedOptimizer", compression=compression,
                              sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              groups=groups, process_set=process_set,
                              scale_local_gradients=scale_local_gradients)
    agg = None
    if backward_passes_per_step > 1:
        agg = LocalGradientAggregationHelper(
            backward_passes_per_step=backward_passes_per_step,
            allreduce_func=lambda g, v: reducer.reduce(g, v),
            sparse_as_dense=True, average_aggregated_gradients=average_aggregated_gradients,
            optimizer_type=LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS,
            process_set=process_set, scale_local_gradients=scale_local_gradients,
            name=f"{config.get('name', 'optimizer')}_hvd_agg")
    source = optimizer if _optimizer_variables(optimizer) else None
    if flavor == "keras3" and not getattr(optimizer, "built", False):
        source = None
    # The wrapper builds lazily (model.fit builds it before training, a custom loop on its first
    # apply); a built source hands over its state then.
    object.__setattr__(new, "_hvd", _HvdConfig(reducer, agg, source))
    return new


def is_distributed(optimizer) -> bool:
    return bool(getattr(optimizer, "_hvd_distributed", False))


__all__ = ["create_distributed_optimizer", "register_pending_layers", "keras_module", "is_keras3",
           "check_backend", "optimizer_flavor", "distributed_class_for", "is_distributed",
           "var_ref"]
