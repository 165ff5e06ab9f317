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

import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

FAILURES: list[str] = []
_CHECKS = 0
_soft: list | None = None


def fail(msg: str) -> None:
    """Record a mismatch; inside check() the check goes on (every rank still runs the same
    collectives) and fails at its end."""
    if _soft is None:
        raise AssertionError(msg)
    _soft.append(msg)


def log(msg: str) -> None:
    print(msg, flush=True)


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


def expect_raises(exc_types, fn, what: str, match: str | None = None):
    try:
        fn()
    except exc_types as exc:
        if match is not None and match not in str(exc):
            fail(f"{what}: raised {type(exc).__name__} without {match!r}: {str(exc)[:600]}")
        return exc
    except Exception as exc:
        fail(f"{what}: expected {exc_types}, got {type(exc).__name__}: {str(exc)[:600]}")
        return exc
    fail(f"{what}: expected {exc_types}, nothing was raised")
    return None


def check(name: str, fn, *args, **kwargs) -> None:
    """Run one named check; a failure is printed, and the script goes on."""
    global _CHECKS, _soft
    _CHECKS += 1
    t0 = time.monotonic()
    _soft = []
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        FAILURES.append(name)
        text = str(exc).strip()
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        # TensorFlow puts the cause at the end of long "in user code" messages.
        summary = lines[0] if len(lines) < 2 else f"{lines[0][:300]} ... {' '.join(lines[-4:])}"
        log(f"CHECK {name} FAIL {type(exc).__name__}: {summary[:2000]}")
        for line in traceback.format_exc().splitlines()[-30:]:
            log(f"  | {line}")
        return
    finally:
        mismatches, _soft = _soft, None
    if mismatches:
        FAILURES.append(name)
        log(f"CHECK {name} FAIL {len(mismatches)} mismatches")
        for m in mismatches[:6]:
            log(f"  | {m}")
        return
    log(f"CHECK {name} OK ({time.monotonic() - t0:.2f}s)")


def finish() -> None:
    log(f"FINISHED {_CHECKS} checks, {len(FAILURES)} failed: {FAILURES}")
