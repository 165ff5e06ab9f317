"""The one worker harness: named checks, expected errors, and the result protocol.

Protocol (read by `tests/util.py` `Run`): each rank prints one line per check,

    CHECK <name> OK (<seconds>s)
    CHECK <name> FAIL <reason>        followed by "  | ..." detail lines

and a last line `FINISHED <n> checks, <k> failed: [...]`. A check keeps running its
collectives after a mismatch (`fail` inside `check` records it and goes on), so every rank stays
in step, and fails at its end. Framework-specific comparisons live in ops_common (torch),
parallel_common (fp32 tolerances) and tf_common (TensorFlow); they all report through `fail`.
"""
from __future__ import annotations

import time
import traceback

FAILURES: list[str] = []
_state = {"checks": 0}
_soft: list | None = None     # mismatches collected by the running check


def log(msg: str) -> None:
    print(msg, flush=True)


def fail(msg: str) -> None:
    """Record a mismatch; inside check() the check goes on and fails at its end."""
    if _soft is None:
        raise AssertionError(msg)
    _soft.append(msg)


def wait_until(condition, timeout: float, pause: float = 0.001) -> bool:
    """Poll `condition()` until it is true or `timeout` seconds pass; its last value. For what
    another thread finishes just after the caller saw its result (a completion callback, a
    worker letting go of a tensor): bounded, so a check never hangs."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return bool(condition())
        time.sleep(pause)
    return True


def expect_raises(exc_types, fn, what: str, match=None):
    """`fn()` must raise one of `exc_types` with `match` (a string, or each of a list of
    strings) in its message. Returns the exception."""
    try:
        fn()
    except exc_types as exc:
        for m in ([match] if isinstance(match, str) else (match or [])):
            if m not in str(exc):
                fail(f"{what}: raised {type(exc).__name__} without {m!r}: {str(exc)[:600]}")
        return exc
    except Exception as exc:  # wrong type
        fail(f"{what}: expected {exc_types}, got {type(exc).__name__}: {str(exc)[:600]}")
        return exc
    fail(f"{what}: expected {exc_types}, nothing was raised")
    return None


def _summary(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else ""
    # TensorFlow puts the cause at the end of long "in user code" messages.
    return f"{lines[0][:300]} ... {' '.join(lines[-4:])}"


def check(name: str, fn, *args, **kwargs) -> None:
    """Run one named check; record (and print) a failure instead of stopping the script.

    A check must run the same collectives on every rank even when it fails, so assertions are
    made after the collectives of the check have completed."""
    global _soft
    _state["checks"] += 1
    t0 = time.monotonic()
    _soft = []
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        FAILURES.append(name)
        log(f"CHECK {name} FAIL {type(exc).__name__}: {_summary(exc)[:2000]}")
        for line in traceback.format_exc().splitlines()[-30:]:
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
    """The last line of a rank: proof that it ran every check (the test judges each check by
    its CHECK line, so known bugs can be marked xfail one by one)."""
    log(f"FINISHED {_state['checks']} checks, {len(FAILURES)} failed: {FAILURES}")


def no_threads_left() -> None:
    """After hvd.shutdown(): no hvdlite thread may still run, else this rank exits 3.

    Why: a daemon thread still running while the interpreter finalizes can abort the process
    ("terminate called without an active exception": hvdlite.common.steady.RoundWaiter.join).
    That abort came only when the thread was freeing a tensor at the wrong moment; a thread
    left at all is the bug, and this names it."""
    import os
    import threading
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("hvdlite-"))
    if left:
        log(f"THREADS LEFT AFTER SHUTDOWN: {left}")
        os._exit(3)


__all__ = ["FAILURES", "log", "fail", "expect_raises", "check", "finish", "no_threads_left"]
