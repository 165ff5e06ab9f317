"""The flight recorder: each rank's last collectives, and its threads' stacks, on demand.

A hang is a question about every rank at once ("who is waiting for what, and where in my code?"),
and each rank only knows its own half. So every rank keeps a small ring buffer of its last
collectives (name, op, shape, dtype, process set, state, enqueue/start/finish times), and dumps
it with the Python stack of every thread:

- when the coordinator reports a stall (it asks every rank to dump, a Msg.DUMP frame),
- on SIGUSR1 (hvdlite-run sends it to every rank when it is interrupted),
- by `dump()` from code.

Dumps are JSON files `flight.rank<R>.json` in HVDLITE_FLIGHT_DIR (hvdlite-run sets it per job;
otherwise a directory under the system's temporary directory). hvdlite-run gathers them into one
report (hvdlite/runner/hang_report.py); `hvdlite-timeline --flight DIR` prints the same report.
Recording costs one small slotted record per collective (a dict only in a dump);
HVDLITE_FLIGHT_RECORDER_SIZE=0 turns it off.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Optional

from . import config
from .messages import TYPE_NAMES

log = logging.getLogger(__name__)

DIR_ENV = "HVDLITE_FLIGHT_DIR"
SIZE_ENV = "HVDLITE_FLIGHT_RECORDER_SIZE"
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = tuple({os.path.abspath(p) for p in (sysconfig.get_paths().get("stdlib"),
                                              sysconfig.get_paths().get("platstdlib")) if p})


def _op_name(req: Any) -> str:
    return TYPE_NAMES.get(req.type, str(req.type)).lower()


class _Record:
    """One collective's history; a dict only when a dump asks (snapshot). Why not a dict from
    the start: building ten keys and a shape list cost ~3 us of every collective, and the
    history is read only when something has gone wrong."""

    __slots__ = ("seq", "req", "state", "enqueued", "started", "finished", "error")

    def __init__(self, seq: int, req: Any, now: float) -> None:
        self.seq, self.req, self.state = seq, req, "enqueued"
        self.enqueued, self.started, self.finished = now, None, None
        self.error: Optional[str] = None

    def as_dict(self) -> dict:
        req = self.req
        out = {"name": req.name, "op": _op_name(req), "shape": list(req.shape or ()),
               "dtype": req.dtype, "process_set": req.process_set_id, "state": self.state,
               "enqueued": self.enqueued, "started": self.started, "finished": self.finished,
               "seq": self.seq}
        if self.error is not None:
            out["error"] = self.error
        return out


class Recorder:
    """A bounded history of this rank's collectives (thread-safe, cheap)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.records: deque = deque(maxlen=max(capacity, 1))
        self._seq = itertools.count()      # next() and deque.append are atomic: no lock
        self.rank = 0
        self.size = 1
        self.host = socket.gethostname()
        # Rank 0 adds what its coordinator saw from every rank (set by basics).
        self.coordinator_view: Optional[Callable[[], dict]] = None

    def enqueued(self, req: Any) -> Optional[_Record]:
        if self.capacity <= 0:
            return None
        rec = _Record(next(self._seq), req, time.time())
        self.records.append(rec)
        return rec

    @staticmethod
    def started(rec: Optional[_Record]) -> None:
        if rec is not None and rec.state == "enqueued":
            rec.state, rec.started = "started", time.time()

    @staticmethod
    def finished(rec: Optional[_Record], error: Optional[str] = None) -> None:
        if rec is not None and (rec.state == "enqueued" or rec.state == "started"):
            rec.state = "failed" if error else "done"
            rec.finished = time.time()
            if error:
                rec.error = error[:300]

    def snapshot(self) -> list[dict]:
        # list() of a deque another thread appends to can raise RuntimeError: retry.
        for _ in range(100):
            try:
                records = list(self.records)
                break
            except RuntimeError:
                continue
        else:
            records = []
        return [r.as_dict() for r in records]


RECORDER = Recorder(config.raw_int(SIZE_ENV, 64))


def _user_frame(frames: list) -> Optional[dict]:
    """The innermost frame of the user's own code (not hvdlite's, not the standard library's)."""
    for f in reversed(frames):
        path = os.path.abspath(f["file"])
        if path.startswith(_PKG_DIR) or path.startswith(_STDLIB) or "site-packages" in path:
            continue
        return f
    return None


def thread_stacks() -> list[dict]:
    """Every thread's Python stack, outermost frame first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue  # the dumping thread itself says nothing about the hang
        frames = [{"file": fs.filename, "line": fs.lineno, "function": fs.name,
                   "code": (fs.line or "").strip()} for fs in traceback.extract_stack(frame)]
        out.append({"thread": names.get(ident, f"thread-{ident}"), "ident": ident,
                    "main": ident == threading.main_thread().ident, "stack": frames,
                    "user_frame": _user_frame(frames)})
    out.sort(key=lambda t: (not t["main"], t["thread"]))
    return out


def dump_dir() -> str:
    path = os.environ.get(DIR_ENV) or os.path.join(tempfile.gettempdir(),
                                                   f"hvdlite-flight-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


_dump_lock = threading.Lock()


def dump(reason: str) -> Optional[str]:
    """Write this rank's records and stacks; returns the file written (None on failure)."""
    rec = RECORDER
    data = {"rank": rec.rank, "size": rec.size, "host": rec.host, "pid": os.getpid(),
            "reason": reason, "time": time.time(), "records": rec.snapshot(),
            "threads": thread_stacks()}
    if rec.coordinator_view is not None:
        try:
            data["coordinator"] = rec.coordinator_view()
        except Exception as exc:  # the report is still worth writing
            data["coordinator"] = {"error": repr(exc)}
    try:
        with _dump_lock:
            path = os.path.join(dump_dir(), f"flight.rank{rec.rank}.json")
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, default=str)
            os.replace(tmp, path)
        return path
    except OSError as exc:
        log.warning("hvdlite flight recorder: could not write its dump: %s", exc)
        return None


def dump_async(reason: str) -> None:
    """Dump from a helper thread (callers are the engine's threads, which must not block)."""
    threading.Thread(target=dump, args=(reason,), name="hvdlite-flight-dump",
                     daemon=True).start()


_installed = False


def install(rank: int, host: str, settings: Any, size: int = 1) -> None:
    """Name this rank in dumps and dump on SIGUSR1 (when the main thread's handler is free)."""
    global _installed
    RECORDER.rank, RECORDER.size = rank, size
    if host:
        RECORDER.host = host
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGUSR1, lambda signum, frame: dump("SIGUSR1"))
            _installed = True
    except (ValueError, OSError, AttributeError):
        pass
