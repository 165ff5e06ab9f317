"""Keras DistributedOptimizer with the stateful compressors (int8, PowerSGD) under model.fit
(tf.function): training converges like uncompressed training and every rank ends with the same
weights.

Usage: hvdlite-run -np 2 python tf_keras_compression.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from tf_common import check, fail, finish, log  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
rng = np.random.RandomState(0)
X = rng.randn(512, 32).astype(np.float32)
Y = (X[:, :8] @ rng.randn(8, 5)).argmax(1).astype(np.int64)
XL, YL = X[RANK::SIZE], Y[RANK::SIZE]


def fit(compression) -> tuple[float, list]:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(5)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                   compression=compression)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(XL, YL, batch_size=64, epochs=4, verbose=0, shuffle=False)
    return float(hist.history["loss"][-1]), [w.numpy() for w in model.trainable_weights]


def converges():
    base, _ = fit(hvd.Compression.none)
    for name, comp in (("int8", hvd.Compression.int8),
                       ("powersgd", hvd.Compression.powersgd(rank=2))):
        loss, weights = fit(comp)
        log(f"keras {name}: final loss {loss:.4f} (none {base:.4f})")
        if loss > base * 1.1 + 0.02:
            fail(f"{name}: final loss {loss:.4f} vs uncompressed {base:.4f}")
        flat = np.concatenate([w.ravel() for w in weights])
        allw = hvd.allgather(tf.constant(flat[None, :]), name=f"kc.{name}").numpy()
        if not np.array_equal(allw[0], allw[-1]):
            fail(f"{name}: ranks ended with different weights")


check("keras fit with int8 and powersgd", converges)
finish()
