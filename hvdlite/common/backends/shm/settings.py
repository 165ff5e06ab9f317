"""The channel's settings and the segment's layout: sizes, modes, and what a process
already measured.
"""
from __future__ import annotations

import logging
import platform
from typing import Callable, Iterator, Optional

import torch

from ... import config
from ...messages import MAX, MIN, PRODUCT, SUM
from ...protocol import INLINE_FLOATS    # a round's payload (ShmAgreement)

log = logging.getLogger("hvdlite.common.backends.shm")


SHM_DIR = "/dev/shm"
# The widest steady-state round (cache bits) the segment's agreement area carries; a wider one
# (a response cache over 4096 entries) runs its rounds over the control connections instead.
AGREE_BITS = 4096
_AGREE_WORDS = 1 + AGREE_BITS // 64            # the fallback word, then the bits
_WORD = (1 << 64) - 1                           # one agreement word's bits
# One round's words: the fallback word, the bits, the tag word, then the payload.
_PARITY_WORDS = _AGREE_WORDS + 1 + INLINE_FLOATS // 2
# Per rank: its round counter on a cache line of its own, then two rounds' words.
_AGREE_STRIDE = (64 + 2 * _PARITY_WORDS * 8 + 63) // 64 * 64
# An allreduce this small is reduced whole by every rank (ShmChannel._allreduce_direct).
DIRECT_BYTES = 64 << 10
# A collective this small may run on the thread that submits it (ShmChannel._submit).
INLINE_BYTES = 1 << 20
# How long that thread spins for its peers before the worker thread takes the collective over;
# also how long each of the worker's waits spins before it sleeps (ShmChannel._wait).
INLINE_POLL_S = 250e-6
# While every rank has a core (the channel spins), a large collective runs in chunks of at most
# this many bytes instead of whole slots: a chunk's copies and its share of the reduction stay
# in the cores' caches, and the peers, working through the same chunks in step, are caught by
# the waits' spin (_wait) instead of a FIFO wake-up each. When ranks outnumber cores the waits
# sleep, each wake-up costs ~50 us or more, and whole slots keep them few. Which wins depends
# on the machine (benchmarks/HISTORY.md, "the shared-memory channel's chunk size"), so the
# channel measures both at set-up (ShmChannel.settle_chunk) unless HVDLITE_SHM_CHUNK_MB says
# which.
SPIN_CHUNK_BYTES = 2 << 20
# The allreduce that settle_chunk times, of a float32 tensor this large, both ways, in
# rounds that alternate which goes first; so many rounds of each (~40 ms at set-up on 2 ranks,
# once a process).
CALIBRATE_BYTES = 8 << 20
CALIBRATE_ROUNDS = 5
# What this process's channels settled on by measuring, by (ranks, slot): later communicators
# of the same shape agree on it instead of measuring again.
_settled: dict[tuple[int, int], int] = {}


# A collective's phases (ShmChannel's collectives): (counter target, what) at each wait.
Waits = Iterator[tuple[int, str]]


def header_bytes(size: int) -> int:
    """Token, then one counter per rank on its own cache line, then each rank's agreement area
    (ShmAgreement); whole pages, so slots stay aligned."""
    return (64 * (size + 1) + _AGREE_STRIDE * size + 4095) // 4096 * 4096
_FNS: dict[int, Callable] = {SUM: torch.add, MIN: torch.minimum, MAX: torch.maximum,
                             PRODUCT: torch.mul}
_REDUCIBLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64}
_RECHECK_S = 0.2                    # a select() never sleeps longer than this
_LIVENESS_S = 1.0                   # how often a long wait checks that peers are alive


def mode() -> str:
    """'on' or 'off' for this process: HVDLITE_SHM = auto (default) | 1 | 0."""
    choice = config.choice("SHM")
    if choice in ("0", "off", "false", "no"):
        return "off"
    if choice in ("1", "on", "true", "yes"):
        return "on"
    return "on" if platform.machine().lower() in ("x86_64", "amd64") else "off"


def chunk_setting() -> Optional[int]:
    """HVDLITE_SHM_CHUNK_MB: None for `auto` (the default), else bytes per chunk of a large
    collective (0: whole slots)."""
    value = config.choice("SHM_CHUNK_MB")
    if value == "auto":
        return None
    mb = float(value)
    return 0 if mb == 0 else max(4096, int(mb * 1024 * 1024) // 4096 * 4096)


def slot_bytes() -> int:
    mb = config.env_float("SHM_SLOT_MB", 8.0)
    if mb <= 0:
        raise ValueError(f"HVDLITE_SHM_SLOT_MB={mb}: must be > 0")
    return max(4096, int(mb * 1024 * 1024) // 4096 * 4096)
