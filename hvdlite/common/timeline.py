"""Timeline: a Chrome-trace / Perfetto JSON file of every tensor's life, written by rank 0.

Each tensor is a "process" in the trace; its rows show NEGOTIATE_<OP> (with a tick per rank as it
reports ready), then the operation with QUEUE, MEMCPY_IN_FUSION_BUFFER, the transport call and
MEMCPY_OUT_FUSION_BUFFER nested inside.
"""
from __future__ import annotations

import json
import os
import threading
import time


class Timeline:
    def __init__(self, path: str | None = None, mark_cycles: bool = False):
        self._lock = threading.Lock()
        self._file = None
        self._pids: dict[str, int] = {}
        self._t0 = time.monotonic()
        self.mark_cycles = mark_cycles
        if path:
            self.start(path, mark_cycles)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def start(self, path: str, mark_cycles: bool = False) -> None:
        with self._lock:
            self._close_locked()
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "w", buffering=1 << 16)
            self._file.write("[\n")
            self._pids = {}
            self.mark_cycles = mark_cycles

    def stop(self) -> None:
        with self._lock:
            self._close_locked()

    def control(self, action: str, path: str | None = None, mark_cycles: bool = False) -> None:
        if action == "start" and path:
            self.start(path, mark_cycles)
        elif action == "stop":
            self.stop()

    def _close_locked(self) -> None:
        if self._file is not None:
            self._file.write('{"name": "end", "ph": "i", "ts": %d, "pid": 0, "s": "g"}\n]\n'
                             % self._ts())
            self._file.close()
            self._file = None

    def _ts(self) -> int:
        return int((time.monotonic() - self._t0) * 1e6)

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._file.write(json.dumps({"name": "process_name", "ph": "M", "pid": pid,
                                         "args": {"name": name}}) + ",\n")
            self._file.write(json.dumps({"name": "process_sort_index", "ph": "M", "pid": pid,
                                         "args": {"sort_index": pid}}) + ",\n")
        return pid

    def _event(self, name: str, ph: str, label: str | None = None, args: dict | None = None,
               tid: int = 0) -> None:
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            ev = {"ph": ph, "ts": self._ts(), "pid": self._pid(name), "tid": tid}
            if label is not None:
                ev["name"] = label
            if args:
                ev["args"] = args
            if ph == "X":
                ev["dur"] = 0
            self._file.write(json.dumps(ev) + ",\n")

    # coordinator side
    def negotiate_start(self, name: str, op: str) -> None:
        self._event(name, "B", f"NEGOTIATE_{op}")

    def negotiate_rank(self, name: str, rank: int) -> None:
        self._event(name, "X", str(rank))

    def negotiate_end(self, name: str) -> None:
        self._event(name, "E")

    # executing rank side
    def start_op(self, names: list, op: str, args: dict | None = None) -> None:
        for n in names:
            self._event(n, "B", op, args)

    def end_op(self, names: list) -> None:
        for n in names:
            self._event(n, "E")

    def activity(self, names: list, label: str) -> None:
        """Start a nested activity (ends the previous one)."""
        for n in names:
            self._event(n, "B", label, tid=0)

    def activity_end(self, names: list) -> None:
        for n in names:
            self._event(n, "E", tid=0)

    def cycle(self) -> None:
        if self.mark_cycles and self._file is not None:
            with self._lock:
                if self._file is not None:
                    self._file.write('{"name": "CYCLE_START", "ph": "i", "ts": %d, "pid": 0, '
                                     '"s": "g"},\n' % self._ts())

    def close(self) -> None:
        self.stop()
