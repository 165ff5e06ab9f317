"""The engine's timing windows: how long a thread polls or waits before it hands work on.

Module attributes read at each use, so a test may change one for a check.
"""
from __future__ import annotations

import threading

SHUT_DOWN_MESSAGE = ("Horovod has been shut down. This was caused by an exception on one of the "
                     "ranks or an attempt to allreduce, allgather or broadcast a tensor after one "
                     "of the ranks finished execution.")


# Collectives up to this size may be finished on the background thread (Engine._poll_inline).
INLINE_POLL_BYTES = 1 << 20
# How long a blocking caller on the express lane polls its own larger collective before the
# finisher thread takes it over (Engine._express says why).
BLOCKING_POLL_S = 0.02
# How long a caller waits for the drive lock before it leaves its collective to the background
# thread. That thread takes the lock for a few microseconds on each periodic wake-up (every 50
# ms in the steady state); a caller that found it taken and gave up at once went through the
# queue, a thread wake-up and the GIL's switch interval instead: ~5 ms for 2 of 30 16 MiB
# allreduces on 2 MPI ranks, ~0.3 ms a call on average. Bounded, so a thread holding the lock
# for a long time (the round waiter, a shutdown) still only delays the caller this much.
DRIVE_WAIT_S = 0.002
# How long a caller waiting on a round over the control connections reads them itself before
# it leaves them to the background thread (Engine._read_peers).
PEER_READ_S = 0.002


def drive_wait_s() -> float:
    """How long this thread may wait for the drive lock: DRIVE_WAIT_S on a caller's thread, 0
    (try once) on hvdlite's own threads ("hvdlite-..."), which may hold the lock themselves:
    a completion callback that submits another collective runs there."""
    return 0.0 if threading.current_thread().name.startswith("hvdlite-") else DRIVE_WAIT_S
