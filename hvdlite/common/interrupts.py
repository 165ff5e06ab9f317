"""Signals held back while a caller's thread does a step of the engine's work that must not be
cut in half.

Why: a caller's thread does some of the engine's work itself. While it waits for a round over
the control connections, it reads and applies the peers' round messages
(engine.Engine._read_peers). Python runs a signal's handler on the main thread between any two
bytecodes, so a Ctrl-C (KeyboardInterrupt), or a handler that raises (a `signal.alarm` timeout),
could land after a message had been read off its socket and before it was applied. The message
was then lost: this rank's round never ended, and every rank hung at its next collective.
Blocking the signal (pthread_sigmask) cannot prevent that: the kernel hands a signal sent to the
process to any thread that does not block it (gloo's, MPI's), and the main thread still runs
the Python handler at its next bytecode.

How: hold() wraps the Python handlers of the signals below in one (_Wrapper) that records a
signal instead of running its handler while a hold is open; release() then runs each recorded
signal's handler on the same thread, so the exception it raises comes out once the step is
complete, where the engine's usual rules for an interrupted caller apply (engine.Engine's module
docstring). Outside a hold the wrapper calls the handler at once, as before. A handler installed
later replaces the wrapper, and a hold at least RECHECK_S later wraps it in turn; unwrap() puts
the handlers back (shutdown). Signals whose handler is the default action or ignored are left
alone: they run no Python. Only the main thread runs Python signal handlers, so hold() is a
no-op elsewhere.
"""
from __future__ import annotations

import signal
import sys
import threading
import time

# Signals a user or a library commonly handles in Python, where an exception may come from.
SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGALRM", "SIGHUP", "SIGUSR2")
                if hasattr(signal, n))

_MAIN = threading.main_thread().ident
_depth = 0
_pending: list = []
# When hold() last looked at the handlers. Looking costs ~2 us a signal (signal.getsignal), a
# noticeable part of applying a round message, so a hold looks at most once every RECHECK_S: a
# handler installed in between runs undeferred until then, as every handler did before.
RECHECK_S = 1.0
_checked = -RECHECK_S


class _Wrapper:
    """A signal's Python handler, run later while a hold is open."""

    __slots__ = ("handler",)

    def __init__(self, handler):
        self.handler = handler

    def __call__(self, signum, frame):
        if _depth:
            if signum not in _pending:
                _pending.append(signum)
            return
        self.handler(signum, frame)


def _wrap() -> None:
    global _checked
    _checked = time.monotonic()
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if callable(current) and current.__class__ is not _Wrapper:
            # (signal.signal runs a handler already due first: its exception leaves here,
            # before the hold opens and before anything of the step has been done.)
            signal.signal(signum, _Wrapper(current))


def hold() -> bool:
    """Open a hold on the calling thread; True when it is the main thread (then call release()
    once the step is complete, also when it raised), False elsewhere (nothing to release)."""
    global _depth
    if threading.get_ident() != _MAIN:
        return False
    if time.monotonic() - _checked >= RECHECK_S:
        _wrap()
    _depth += 1
    return True


def release() -> None:
    """Close a hold opened by hold(); the last one runs the handlers of the signals that came
    meanwhile, in arrival order, and raises what the first of them raised."""
    global _depth
    _depth -= 1
    if _depth or not _pending:
        return
    due = _pending[:]
    del _pending[:]
    first = None
    for signum in due:
        handler = signal.getsignal(signum)
        if handler.__class__ is _Wrapper:
            handler = handler.handler
        try:
            if callable(handler):
                handler(signum, sys._getframe(1))
            else:                         # reset to the default action meanwhile: take it
                signal.raise_signal(signum)
        except BaseException as exc:      # (the first one raises; the rest still run)
            if first is None:
                first = exc
    if first is not None:
        raise first


def unwrap() -> None:
    """Put back the handlers hold() wrapped (main thread only; elsewhere they stay wrapped,
    which only passes every signal through)."""
    global _checked
    if threading.get_ident() != _MAIN:
        return
    _checked = -RECHECK_S
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current.__class__ is _Wrapper:
            signal.signal(signum, current.handler)
