"""Names for unnamed collectives, written once for every frontend and add-on.

The engine matches tensors across ranks by name, so a name must be identical on every rank.
Horovod named unnamed calls by a global handle counter, which breaks as soon as ranks interleave
calls differently; hvdlite names them by the user's calling line instead.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_counters: dict[tuple, int] = {}
_claimed: set[tuple[str, int]] = set()     # (name, set id) of blocking calls in progress
_lock = threading.Lock()
_skip_cache: tuple | None = None
# Per tuple of skipped directories: file name -> None where it lies in one of them, else its
# base name. os.path.abspath per frame cost ~0.75 us, four frames deep for each unnamed
# hvd.allreduce_ (~3 us of ~17).
_inside: dict[tuple, dict[str, Optional[str]]] = {}


def _framework_dirs() -> tuple:
    """hvdlite's own directory plus those of TensorFlow/Keras when they are loaded: frames in
    them are library code, never the user's call site."""
    global _skip_cache
    dirs = [_PKG_DIR + os.sep]
    for mod in ("tensorflow", "keras", "tf_keras"):
        m = sys.modules.get(mod)
        f = getattr(m, "__file__", None) if m is not None else None
        if f:
            dirs.append(os.path.dirname(os.path.abspath(f)))
    if len(dirs) == 1:
        return tuple(dirs)
    _skip_cache = tuple(dirs)
    return _skip_cache


def call_site(frameworks: bool = False) -> tuple[str, int] | None:
    """(file basename, line) of the first frame outside hvdlite (and, with `frameworks`, outside
    TensorFlow and Keras), or None when there is none."""
    skip = (_skip_cache or _framework_dirs()) if frameworks else (_PKG_DIR + os.sep,)
    inside = _inside.get(skip)
    if inside is None:
        inside = _inside[skip] = {}
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path not in inside:
            inside[path] = None if os.path.abspath(path).startswith(skip) \
                else os.path.basename(path)
        base = inside[path]
        if base is not None:
            return base, frame.f_lineno
        frame = frame.f_back
    return None


def auto_name(op: str, set_id: int = 0) -> str:
    """A per-call name: the calling line plus how many times that line has run for this process
    set (calls from one line may overlap, so each gets its own name; not cacheable)."""
    site = call_site() or ("?", 0)
    key = (op, set_id) + site
    with _lock:
        n = _counters.get(key, 0)
        _counters[key] = n + 1
    return f"{_site_base(op, site)}.{n}"


def _site_base(op: str, site: tuple[str, int]) -> str:
    return f"{op}.noname.{site[0]}:{site[1]}"


class claimed_site:
    """For a blocking call without a name, while it runs (`with claimed_site(op, set) as
    name:`): a stable name, `op.noname.file:line`, the same every time that line runs, so the
    response cache (and the steady state) serves it. None when not `wanted`, where the call
    site is unknown (called from C++, as autograd's backward), or where another thread is in
    the same call from the same line right now: the caller then names it by `auto_name`.

    Why: a per-call counter made every unnamed call a cache miss. In the steady state a miss
    sends the whole set back to the coordinator, so one `hvd.allreduce(loss)` per step took a
    step of ten cached gradient allreduces from ~0.7 to ~3.2 ms on 2 ranks. Blocking calls from
    one line follow each other on every rank, so the k-th call still meets the k-th call of the
    other ranks, as with the counter. (A class, not a generator: the call site is read where
    the object is made, in hvdlite's frames, not inside contextlib's.)"""

    __slots__ = ("_key",)

    def __init__(self, op: str, set_id: int = 0, wanted: bool = True):
        site = call_site() if wanted else None
        self._key = None
        if site is not None:
            key = (_site_base(op, site), set_id)
            with _lock:
                if key not in _claimed:
                    _claimed.add(key)
                    self._key = key

    def __enter__(self) -> str | None:
        return None if self._key is None else self._key[0]

    def __exit__(self, *exc) -> None:
        if self._key is not None:
            with _lock:
                _claimed.discard(self._key)
            self._key = None


class blocking_name(claimed_site):
    """`with blocking_name(op, name, set) as wire:` the name a blocking collective goes by:
    `name` when the caller gave one; else its line alone (claimed_site), so it is cached like a
    named call; else None (the line is unknown or in use by another thread right now), which
    the op layer turns into a per-call name (auto_name). Enter it in the frontend's public
    function, before autograd's `apply`: from inside a Function's forward the first frame
    outside hvdlite is torch's, the same line for every op.

    Why: an unnamed call is never cached, and in the steady state one uncached call sends the
    whole set back to the coordinator. One unnamed `hvd.grouped_allreduce`, `hvd.allgather` or
    `hvd.broadcast` per step of ten cached gradient allreduces (2 ranks, gloo) took the step
    from 1.1-1.2 ms to 4.3-4.5 ms; the same call named kept it at 1.1-1.2 ms."""

    __slots__ = ("_name",)

    def __init__(self, op: str, name: Optional[str], set_id: int = 0):
        super().__init__(op, set_id, wanted=name is None)
        self._name = name

    def __enter__(self) -> str | None:
        return self._name if self._name is not None else super().__enter__()


def site_name(prefix: str) -> str:
    """A stable name: `prefix@file:line` (no counter, so the response cache serves it every
    step). Only for synchronous calls, which never overlap with themselves."""
    site = call_site()
    return prefix if site is None else f"{prefix}@{site[0]}:{site[1]}"


def framework_site() -> str:
    """`file:line` of the user's line outside hvdlite, TensorFlow and Keras (stable per step)."""
    site = call_site(frameworks=True)
    return "unknown" if site is None else f"{site[0]}:{site[1]}"


def reset() -> None:
    """Restart every call-site counter (a new elastic round: joiners must count as survivors)."""
    with _lock:
        _counters.clear()
