"""NumPy reference of Horovod's Adasum, written from the formula (independent of hvdlite's code).

For two vectors a, b: (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, a coefficient being 1 when
its squared norm is below 1e-8; ranks are combined pairwise in Horovod's VHDD order, i.e. the
binary tree over consecutive ranks ((x0 + x1) + (x2 + x3)), the combined values rounded to the
tensor's dtype after every level. Fused tensors are reduced each on its own.
"""
from __future__ import annotations

import numpy as np


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    dot, anorm, bnorm = float(a @ b), float(a @ a), float(b @ b)
    acoeff = 1.0 - dot / (2.0 * anorm) if anorm >= 1e-8 else 1.0
    bcoeff = 1.0 - dot / (2.0 * bnorm) if bnorm >= 1e-8 else 1.0
    return acoeff * a + bcoeff * b


def adasum(per_rank: list, dtype=None) -> np.ndarray:
    """Adasum of one tensor given every rank's value (a list ordered by rank)."""
    arrays = [np.asarray(x) for x in per_rank]
    shape = arrays[0].shape
    dtype = dtype or arrays[0].dtype
    n = len(arrays)
    assert n & (n - 1) == 0, "power of two ranks only"
    level = [x.astype(dtype) for x in arrays]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]).astype(dtype) for i in range(0, len(level), 2)]
    return np.asarray(level[0], dtype=dtype).reshape(shape)
