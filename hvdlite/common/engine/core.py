"""The engine object: its shared state and threads; its behaviour lives in the bases, one
concern each.
"""
from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from .. import collectives, straggler
from ..response_cache import RankCache
from ..buckets import BucketPlanner
from ..steady import RoundWaiter, SteadySet
from ..wire import Channel
from .handles import Completion, Entry
from .submission import Submission
from .caller import CallerRounds
from .express import ExpressLane
from .loop import BackgroundLoop
from .coordinator_client import CoordinatorClient
from .steady_lane import SteadyLane
from .peers import PeerConnections
from .execution import Execution

log = logging.getLogger("hvdlite.common.engine")



class Engine(Submission, CallerRounds, ExpressLane, BackgroundLoop, CoordinatorClient,
             SteadyLane, PeerConnections, Execution):
    """One process's engine: the state every part (the bases, one module each) shares, and the
    two threads that run it."""

    def __init__(self, *, rank: int, size: int, settings, channel: Channel,
                 comm_factory: Callable[..., Any], set_ranks: dict[int, list],
                 timeline=None, peer_listener: socket.socket | None = None,
                 key: bytes = b"", peers: dict | None = None, peer_nonce: bytes = b""):
        self.rank = rank
        self.size = size
        self.settings = settings
        self.channel = channel
        self.comm_factory = comm_factory
        self.set_ranks = dict(set_ranks)
        self.timeline = timeline
        self.cycle_s = max(settings.cycle_time_ms, 0.0) / 1000.0
        self.cache = RankCache()
        self.executor = collectives.Executor(timeline)
        self.executor.async_completion = getattr(settings, "async_completion", False)
        self.comms: dict[int, Any] = {}
        self.joined = False
        self._lock = threading.Lock()
        self._queue: deque[Entry] = deque()
        self._inflight: dict[tuple[int, str], Entry] = {}
        # Names stay taken from submission until the caller has waited for the result, so a
        # duplicate-name error does not depend on how fast the collective happened to finish
        # (which differs between ranks and would make their code paths diverge).
        self._reserved: set[tuple[int, str]] = set()
        # Names held by handles whose callers left by an exception (_orphan): a new call of
        # one of them waits for that handle instead of failing as a duplicate (_await_orphans).
        self._orphaned: dict[tuple[int, str], Completion] = {}
        self._closed: str | None = None
        self._stopping = False
        self._last_send = 0.0
        # The coordinator sends at least a heartbeat every second; silence far past the stall
        # shutdown time means rank 0 is hung (stopped) or unreachable.
        self._last_heard = time.monotonic()
        shutdown_s = getattr(settings, "stall_shutdown_s", 0) or 0
        self._silence_limit_s = shutdown_s + 10.0 if shutdown_s > 0 else 0.0
        # Launched collectives, in launch order, until the finisher completes them.
        self._transport: queue.Queue = queue.Queue(maxsize=64)
        self._in_transport: dict[int, list] = {}
        self._transport_seq = 0
        self._idle = threading.Condition(self._lock)
        self._idle_waiters = 0     # threads in _wait_transport_idle (notify only for them)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_pending = False      # a wake-up byte is on its way, not yet read (_wake)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(channel.sock, selectors.EVENT_READ, "hub")
        # The decentralised steady state (steady.py): per set, the state of its rounds; direct
        # connections to the other ranks (one we opened per destination, any number accepted).
        self.key = key
        self.peer_addrs = dict(peers or {})
        self._peer_nonce = peer_nonce                 # our listener's half of each peer key
        self._seen_client_nonces: set[bytes] = set()  # refuse a connection replayed to us
        self.steady: dict[int, SteadySet] = {}
        # set -> (epoch, rounds finished) of steady states this rank has left (fallback, a
        # departed member): its "S" message carries them with the current ones (_steady_gone).
        self._rounds_left: dict[int, tuple[int, int]] = {}
        # Why this rank leaves, told the coordinator at shutdown (basics.exit_reason: an
        # uncaught exception), and why others left, as their GONE items said.
        self.exit_reason: str | None = None
        self._gone_reasons: dict[int, str] = {}
        self.epochs: dict[int, int] = {}            # set -> last Item.STEADY epoch seen
        self._early: dict[tuple[int, int], list] = {}   # (set, epoch) -> ROUNDs before STEADY
        self._peer_out: dict[int, Channel] = {}
        self._listener = peer_listener
        if peer_listener is not None:
            peer_listener.setblocking(False)
            self._sel.register(peer_listener, selectors.EVENT_READ, "listen")
        self._releasing = False
        # Whoever holds the drive lock runs the engine's state machine: the background thread
        # for what it hears, a caller driving its own collective (enqueue, _drive_inline) or the
        # round waiter finishing a transport round. Taken before self._lock, never while holding
        # it (callers wait for it at most windows.DRIVE_WAIT_S).
        self._drive = threading.Lock()
        self._waiter: RoundWaiter | None = None
        # Gradient buckets (buckets.py): steady-state allreduces held back until their bucket
        # is complete, as (entry, set, bucket, deadline); a waiter sets _flush.
        self.buckets = BucketPlanner(settings.bucket_cap_bytes, settings.first_bucket_bytes,
                                     settings.cpu_whole_pass, settings.cpu_bucket_cap_bytes) \
            if settings.steady_state else BucketPlanner(0, 0)
        self._held: list = []
        self._flush = False
        self._submitted = 0               # entries enqueued so far (Entry.seq)
        self._wait_marks: collections.deque = collections.deque()  # _submitted at each wait
        self._observed_seq = 0            # seq of the last entry the planner saw
        self._report_after = max(0.05, min(1.0, settings.stall_warning_s / 4))
        # This rank's time to submit, for the straggler report (straggler.Pace; fed by ops).
        self.pace = straggler.Pace() if size > 1 and straggler.interval_from_env() > 0 \
            else None
        self.counters = {"coordinator_messages": 0, "coordinator_tensors": 0,
                         "steady_entered": 0, "steady_rounds": 0, "steady_released": 0,
                         "steady_groups": 0,
                         "steady_fallbacks": 0, "bounced": 0, "peer_messages": 0,
                         "transport_rounds": 0, "inline_driven": 0, "express": 0,
                         "round_payloads": 0, "caller_reads": 0, "caller_finished": 0}
        self.thread = threading.Thread(target=self._run, name="hvdlite-background", daemon=True)
        self.finisher = threading.Thread(target=self._finish_loop, name="hvdlite-finisher",
                                         daemon=True)
        self.finisher.start()
        self.thread.start()

    # ------------------------------------------------------------------ frontend side
    @property
    def closed_reason(self) -> str | None:
        return self._closed

    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def whole_pass(self) -> bool:
        """Whether this rank holds a step's CPU allreduces until the step has submitted them
        all, and sends them as one bucket (buckets.whole_pass_on_host)."""
        return self.buckets.enabled and self.buckets.cpu_whole_pass
