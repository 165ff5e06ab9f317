"""Helpers for the tensor/pipeline-parallel worker scripts: named checks that print one
`CHECK <name> OK|FAIL` line per rank, fp32 comparisons at the issue's tolerance, and expected
errors. A check keeps running its collectives after a mismatch (so every rank stays in step) and
fails at its end."""
from __future__ import annotations

import torch

from harness import FAILURES, check, expect_raises, fail, finish, log  # noqa: F401  (one harness)

RTOL, ATOL = 1e-5, 1e-6


def close(actual, expected, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """fp32 equality at rtol 1e-5 / atol 1e-6 (the issue's bar)."""
    if actual is None or expected is None:
        if actual is not expected:
            fail(f"{what}: one side is None (actual={type(actual).__name__}, "
                 f"expected={type(expected).__name__})")
        return
    if tuple(actual.shape) != tuple(expected.shape):
        return fail(f"{what}: shape {list(actual.shape)} != expected {list(expected.shape)}")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        fail(f"{what}: {str(exc).splitlines()[0:4]}")


def equal(actual, expected, what: str) -> None:
    """Bit-identical."""
    if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
        return fail(f"{what}: {actual.dtype}{list(actual.shape)} != "
                    f"{expected.dtype}{list(expected.shape)}")
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().max().item()
        fail(f"{what}: not bit-identical (max abs diff {diff})")
