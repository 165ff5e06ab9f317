"""Shared helpers for the TensorFlow worker scripts (tf_*.py).

Each worker runs many named checks in one launch (TensorFlow imports slowly) and prints one
`CHECK <name> OK|FAIL ...` line per check and a final `FINISHED ...` line, like ops_common.py for
torch. Every rank builds every rank's input from a seeded generator, so each rank can compute the
single-process reference itself. Inputs are small integers, exact in every dtype.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import zlib  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

from harness import FAILURES, check, expect_raises, fail, finish, log  # noqa: E402,F401


def gen(rank: int, shape, dtype, salt="", lo: int = -4, hi: int = 4) -> np.ndarray:
    """Rank `rank`'s deterministic input (integers in [lo, hi]; [0, hi] unsigned)."""
    seed = (1000 + rank + 7919 * (zlib.crc32(repr(salt).encode()) % 100003)) % (2 ** 31)
    rng = np.random.RandomState(seed)
    dtype = tf.as_dtype(dtype)
    if dtype == tf.bool:
        return rng.randint(0, 2, size=shape).astype(bool)
    if dtype.is_unsigned:
        lo = max(lo, 0)
    return rng.randint(lo, hi + 1, size=shape).astype(dtype.as_numpy_dtype)


def to_np(t) -> np.ndarray:
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def same(actual, expected, what: str) -> None:
    a = to_np(actual)
    e = np.asarray(expected)
    if a.dtype != e.dtype:
        return fail(f"{what}: dtype {a.dtype} != expected {e.dtype}")
    if a.shape != e.shape:
        return fail(f"{what}: shape {a.shape} != expected {e.shape}")
    if not np.array_equal(a.astype(np.float64) if a.dtype.kind not in "b" else a,
                          e.astype(np.float64) if e.dtype.kind not in "b" else e):
        fail(f"{what}: values differ: actual={a.reshape(-1)[:8].tolist()} "
             f"expected={e.reshape(-1)[:8].tolist()}")


def close(actual, expected, what: str, rtol=1e-5, atol=1e-6) -> None:
    a = to_np(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        return fail(f"{what}: shape {a.shape} != expected {e.shape}")
    if not np.allclose(a, e, rtol=rtol, atol=atol):
        diff = np.abs(a - e).max() if a.size else 0
        fail(f"{what}: max abs diff {diff:.3g} (rtol {rtol}, atol {atol}) "
             f"actual={a.reshape(-1)[:6].tolist()} expected={e.reshape(-1)[:6].tolist()}")
