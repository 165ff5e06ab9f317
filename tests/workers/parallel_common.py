"""Helpers for the tensor/pipeline-parallel worker scripts: named checks that print one
`CHECK <name> OK|FAIL` line per rank, fp32 comparisons at the issue's tolerance, and expected
errors. A check keeps running its collectives after a mismatch (so every rank stays in step) and
fails at its end."""
from __future__ import annotations

import time
import traceback

import torch

RTOL, ATOL = 1e-5, 1e-6
FAILURES: list[str] = []
_CHECKS = 0
_soft: list | None = None


def log(msg: str) -> None:
    print(msg, flush=True)


def fail(msg: str) -> None:
    if _soft is None:
        raise AssertionError(msg)
    _soft.append(msg)


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


def expect_raises(exc_types, fn, what: str, match=None):
    """`fn()` must raise one of `exc_types` with every string in `match` in its message."""
    try:
        fn()
    except exc_types as exc:
        for m in ([match] if isinstance(match, str) else (match or [])):
            if m not in str(exc):
                fail(f"{what}: {type(exc).__name__} without {m!r}: {exc}")
        return exc
    except Exception as exc:
        fail(f"{what}: expected {exc_types}, got {type(exc).__name__}: {exc}")
        return exc
    fail(f"{what}: expected {exc_types}, nothing was raised")
    return None


def check(name: str, fn, *args, **kwargs) -> None:
    global _CHECKS, _soft
    _CHECKS += 1
    t0 = time.monotonic()
    _soft = []
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        FAILURES.append(name)
        log(f"CHECK {name} FAIL {type(exc).__name__}: {exc}")
        for line in traceback.format_exc().splitlines()[-25:]:
            log(f"  | {line}")
        return
    finally:
        mismatches, _soft = _soft, None
    if mismatches:
        FAILURES.append(name)
        log(f"CHECK {name} FAIL {len(mismatches)} mismatches")
        for m in mismatches[:8]:
            log(f"  | {m}")
        return
    log(f"CHECK {name} OK ({time.monotonic() - t0:.2f}s)")


def finish() -> None:
    log(f"FINISHED {_CHECKS} checks, {len(FAILURES)} failed: {FAILURES}")
