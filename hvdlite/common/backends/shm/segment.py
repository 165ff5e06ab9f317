"""Segment set-up: the file in /dev/shm every rank of a communicator maps, the FIFOs, and the
collective decision to use it.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
from typing import Callable, Optional

import numpy as np

from ...threads import local_ranks, usable_cores
from .settings import (SHM_DIR, INLINE_POLL_S, header_bytes, mode, slot_bytes)
from .channel import ShmChannel

log = logging.getLogger("hvdlite.common.backends.shm")


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _fit_slot(wanted: int, size: int) -> int:
    """The slot size that fits /dev/shm: at most a quarter of its free space for the whole
    segment (so several communicators and other programs fit beside it)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    free = st.f_bavail * st.f_frsize
    fit = (free // 4 - header_bytes(size)) // (size + 1) // 4096 * 4096
    return min(wanted, fit)


MIN_SLOT = 64 * 1024


def connect(store, rank: int, size: int, timeout_s: float,
            agree: Callable[[bool], bool]) -> Optional[ShmChannel]:
    """Collective over the communicator's ranks: a ShmChannel, or None on every rank when any
    rank cannot share memory with all the others (or HVDLITE_SHM=0).

    `store` is a c10d store private to this communicator; `agree(ok)` must return True only
    when `ok` is True on every rank (the caller runs one allreduce on its transport). Every rank
    must call this, even with the path turned off, so the agreement pairs up.
    """
    wanted = mode() == "on" and size > 1
    base = os.path.join(SHM_DIR, f"hvdlite-{os.getpid()}-{secrets.token_hex(6)}")
    seg_path, fifo_path = base + ".seg", base + ".fifo"
    seg: Optional[mmap.mmap] = None
    fifo_r = -1
    pids: dict[int, int] = {}
    fifo_w: dict[int, int] = {}
    why = "" if wanted else "HVDLITE_SHM=0"
    slot = 0
    try:
        if rank == 0:
            entry = "-"
            if wanted:
                slot = _fit_slot(slot_bytes(), size)
                if slot < min(slot_bytes(), MIN_SLOT):
                    why = f"{SHM_DIR} is missing or nearly full"
                else:
                    try:
                        fd = os.open(seg_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                        try:
                            os.posix_fallocate(fd, 0, header_bytes(size) + (size + 1) * slot)
                            seg = mmap.mmap(fd, header_bytes(size) + (size + 1) * slot)
                        finally:
                            os.close(fd)
                        token = secrets.randbits(62)
                        np.ndarray((1,), dtype=np.int64, buffer=seg)[0] = token
                        entry = f"{seg_path}|{slot}|{token}"
                    except OSError as exc:
                        why = f"rank 0 could not create {seg_path} ({exc})"
            store.set("seg", entry)
        entry = store.get("seg").decode()
        if not why and entry == "-":
            why = "rank 0 has no shared-memory segment"
        if not why and wanted:
            try:
                if rank != 0:
                    path, slot_s, token_s = entry.split("|")
                    slot = int(slot_s)
                    fd = os.open(path, os.O_RDWR)
                    try:
                        seg = mmap.mmap(fd, header_bytes(size) + (size + 1) * slot)
                    finally:
                        os.close(fd)
                    if int(np.ndarray((1,), dtype=np.int64, buffer=seg)[0]) != int(token_s):
                        why = "the segment holds another token: another host?"
                if not why:
                    os.mkfifo(fifo_path, 0o600)
                    # Read end first (a writer's open fails until it exists); our own write end
                    # too, so the FIFO never reads EOF when peers close theirs.
                    fifo_r = os.open(fifo_path, os.O_RDONLY | os.O_NONBLOCK)
                    fifo_w[rank] = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)
            except (OSError, ValueError) as exc:
                why = f"rank {rank} cannot map rank 0's segment ({exc}): another host?"
        store.set(f"fifo/{rank}", "-" if why else f"{fifo_path}|{os.getpid()}|{_pid_ns()}")
        if not why:
            for r in range(size):
                if r == rank:
                    continue
                peer = store.get(f"fifo/{r}").decode()
                if peer == "-":
                    why = f"rank {r} cannot share memory"
                    break
                p_fifo, p_pid, p_ns = peer.split("|", 2)
                # A pid means something here only in the same pid namespace (containers may
                # share /dev/shm but not pids); 0 = cannot check, the timeout still bounds it.
                pids[r] = int(p_pid) if p_ns == _pid_ns() else 0
                try:
                    fifo_w[r] = os.open(p_fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as exc:
                    why = f"rank {r}'s FIFO is not reachable ({exc})"
                    break
        ok = agree(not why)
    finally:
        for path in (seg_path, fifo_path):    # everyone mapped (or gave up): nothing to leak
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if ok and not why:
        own_w = fifo_w.pop(rank)             # held open, never written: no EOF on our FIFO
        # Spin only while every rank of this host has a core of its own: a spinning rank
        # would otherwise take the core from the one it waits for. Decided together (every
        # rank is here, since `ok` was agreed), as it also decides where the steady state's
        # rounds run (GlooCommunicator.agreement), and every rank of a set must run them alike
        # (a rank pinned to fewer cores says no).
        spin = agree(local_ranks(size) <= usable_cores())
        channel = ShmChannel(rank, size, timeout_s, slot, seg, pids, fifo_r, fifo_w, own_w,
                             INLINE_POLL_S if spin else 0.0)
        try:
            channel.settle_chunk()
        except BaseException:
            channel.close()
            raise
        return channel
    if wanted:
        log.info("shared-memory data path off for this communicator (%s); gloo carries it",
                 why or "another rank could not share memory with all the others")
    if seg is not None:
        try:
            seg.close()
        except (BufferError, ValueError):
            pass
    for f in [fifo_r, *fifo_w.values()]:
        if f >= 0:
            try:
                os.close(f)
            except OSError:
                pass
    return None
