"""Horovod's `hvd.SyncBatchNormalization`: Keras batch normalisation whose training statistics are
those of the global batch (every rank's local batch together).

Each rank sums its count, sum and sum of squares per channel; one grouped allreduce (Sum) makes
them global. The allreduce is differentiable (its gradient is the allreduce of the gradient), so
input gradients are those of the global batch too. Per-rank batch sizes may differ, and a Keras 3
mask is honoured. In inference it is plain batch normalisation with the moving statistics.
"""
from __future__ import annotations

import tensorflow as tf

from ..common import basics as _basics
from .mpi_ops import Sum, _grouped_allreduce


def _global_moments(x, axes, keepdims: bool, weights=None):
    """Mean and (biased) variance of `x` over `axes` and over every rank."""
    compute = tf.float64 if x.dtype == tf.float64 else tf.float32
    xc = tf.cast(x, compute)
    if weights is None:
        shape = tf.shape(xc)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), compute)
        total = tf.reduce_sum(xc, axes, keepdims=True)
        squares = tf.reduce_sum(tf.square(xc), axes, keepdims=True)
        count = tf.ones_like(total) * count
    else:
        w = tf.cast(weights, compute)
        count = tf.reduce_sum(w, axes, keepdims=True)
        total = tf.reduce_sum(w * xc, axes, keepdims=True)
        squares = tf.reduce_sum(w * tf.square(xc), axes, keepdims=True)
    count, total, squares = _grouped_allreduce([count, total, squares], op=Sum)
    count = tf.maximum(count, tf.keras.backend.epsilon())
    mean = total / count
    variance = tf.maximum(squares / count - tf.square(mean), 0.0)
    if not keepdims:
        mean = tf.squeeze(mean, axes)
        variance = tf.squeeze(variance, axes)
    return tf.cast(mean, x.dtype), tf.cast(variance, x.dtype)


def _register(cls):
    utils = getattr(tf.keras, "utils", None)
    register = getattr(utils, "register_keras_serializable", None) if utils else None
    if register is None:
        return cls
    return register(package="hvdlite")(cls)


def _is_keras3() -> bool:
    from .keras.optimizer import is_keras3
    return is_keras3()


_BatchNormalization = tf.keras.layers.BatchNormalization


class SyncBatchNormalization(_BatchNormalization):
    """Batch normalisation over the global batch in training (see `keras.layers.BatchNormalization`
    for the arguments). With one rank it is plain batch normalisation."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not _is_keras3():
            kwargs["fused"] = False
        super().__init__(**kwargs)
        # hvdlite's collectives cannot run under XLA: keep Keras 3's jit_compile="auto" off.
        try:
            self.supports_jit = False
        except Exception:
            pass

    def _moments(self, inputs, *args, **kwargs):
        # Keras 3 calls _moments(inputs, mask); tf_keras calls _moments(inputs, axes, keep_dims),
        # which goes through _calculate_mean_and_var below.
        if not _is_keras3() or _basics.size() == 1:
            return super()._moments(inputs, *args, **kwargs)
        mask = args[0] if args else kwargs.get("mask")
        axes = list(self._reduction_axes)
        weights = None
        if mask is not None:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
        mean, variance = _global_moments(inputs, axes, keepdims=False, weights=weights)
        return mean, variance

    # Keras 2 (tf_keras)
    def _calculate_mean_and_var(self, x, axes, keep_dims, mask=None):
        if _basics.size() == 1:
            return super()._calculate_mean_and_var(x, axes, keep_dims, mask=mask)
        weights = None
        if mask is not None:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
        return _global_moments(x, list(axes), keepdims=keep_dims, weights=weights)


SyncBatchNormalization = _register(SyncBatchNormalization)

__all__ = ["SyncBatchNormalization"]
