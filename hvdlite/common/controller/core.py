"""The coordinator object: its state, its thread and the dispatcher that hands each frame to
the part that owns it (admission, the request table, release, the stall watch).
"""
from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time

from .. import autotune
from ..config import Settings
from ..messages import (Response)
from ..protocol import Item, Msg
from ..stall import StallInspector
from ..steady import set_bits
from ..wire import ProtocolError
from .state import Peer, SetState
from .admission import Admission
from .requests import RequestTable
from .release import Release
from .stall_watch import StallWatch

log = logging.getLogger("hvdlite.common.controller")


class Coordinator(Admission, RequestTable, Release, StallWatch):
    """Serves negotiation for one job generation; started by rank 0's `init()`."""

    def __init__(self, size: int, key: bytes, settings: Settings, timeline=None,
                 bind_host: str = "0.0.0.0"):
        self.size = size
        self.key = key
        self.settings = settings
        # Names whose readiness _add_to_table has still to check, and whether a check is
        # running (it says why there is a list).
        self._checks: collections.deque = collections.deque()
        self._checking = False
        # rank -> why it left, where its SHUTDOWN said (an uncaught exception): gone_message.
        self._gone_reasons: dict[int, str] = {}
        self.timeline = timeline
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((bind_host, 0))
        self.listener.listen(max(128, size))
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.peers: dict[int, Peer] = {}          # global rank -> peer
        self.sets: dict[int, SetState] = {}
        self.next_set_id = 1
        self.dynamic = False
        self.stall = StallInspector(settings)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self.thread = threading.Thread(target=self._run, name="hvdlite-coordinator", daemon=True)
        self.fatal: str | None = None
        self._fatal_sent = False
        # Connections that passed the nonce handshake (authenticated off the loop's thread,
        # so a silent stranger cannot hold the coordinator up): (channel, first message).
        self._arrivals: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.refused = 0                            # connections refused (for tests and logs)
        self._last_seen: dict[int, tuple] = {}      # rank -> (time, requests, hits) of its last Q
        self._dump_asked = False
        self._released_any = False                  # a response went out (StallWatch)
        self._fatal_extra: dict | None = None
        self.straggler = None                       # straggler.Tracker when reports are on
        self._shut_down_ranks: set[int] = set()
        self._evicted: list = []                    # (set, bits) retired while releasing
        self._fresh: set[tuple[int, int]] = set()   # (set id, bit) announced in this round
        self._group_sizes: dict[tuple[int, str], int] = {}
        self.messages_handled = 0                   # every message from a rank (benchmarks)
        # Autotune hook: None unless HOROVOD_AUTOTUNE=1 (see autotune.py).
        self.autotune = autotune.create(settings)
        # Elastic init: returns a reason when the driver aborted this round (a member died).
        self.abort_check = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.thread.start()

    def stop(self, reason: str | None = None) -> None:
        if reason and self.fatal is None:
            self.fatal = reason
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)

    def finish(self, grace_s: float) -> None:
        """Stop once every rank has shut down or disconnected, or after grace_s."""
        if threading.current_thread() is not self.thread:
            self.thread.join(grace_s)
        self.stop()

    def _run(self) -> None:
        try:
            if self._handshake():
                self._serve()
        except Exception as exc:  # a bug here must not leave ranks waiting forever
            log.exception("hvdlite coordinator failed")
            self._broadcast_fatal(f"the hvdlite coordinator on rank 0 failed: {exc!r}")
        finally:
            if self.fatal:
                self._broadcast_fatal(self.fatal)
            for peer in list(self.peers.values()):
                peer.channel.close()
            if self.autotune is not None:
                self.autotune.close()
            self.sel.close()
            self.listener.close()
            self._wake_r.close()
            self._wake_w.close()

    # ------------------------------------------------------------------ main loop
    def _serve(self) -> None:
        next_check = time.monotonic() + 1.0
        while not self._stop.is_set():
            events = self.sel.select(timeout=0.5)
            out: dict[int, list] = {}
            for key, _ in events:
                if key.data == "wake":
                    self._wake_r.recv(4096)
                    self._refuse_late_arrivals()
                    continue
                if key.data == "listen":
                    self._accept_connection()
                    continue
                peer = key.data
                try:
                    alive = peer.channel.feed()
                    msgs = peer.channel.messages()
                except ProtocolError as exc:
                    log.error("hvdlite coordinator: %s (message dropped, connection closed)", exc)
                    alive, msgs = False, []
                except OSError:
                    alive, msgs = False, []
                for msg in msgs:
                    self._handle(peer.rank, msg, out)
                if not alive:
                    self._lost(peer, out)
                if self._stop.is_set():
                    break
            self._flush(out)
            now = time.monotonic()
            if now >= next_check and not self._stop.is_set():
                next_check = now + 1.0
                self._check_stalls(now)
                if self.straggler is not None:
                    self.straggler.maybe_report(now)
                self._heartbeat()
            if not self.peers:
                break

    def _lost(self, peer: Peer, out: dict) -> None:
        self.sel.unregister(peer.channel.sock)
        peer.channel.close()
        self.peers.pop(peer.rank, None)
        if peer.rank in self._shut_down_ranks:
            return
        self._stop_with(
            f"rank {peer.rank} (host {peer.hostname}, pid {peer.pid}) lost its connection to the "
            f"coordinator: the process exited or crashed without calling hvd.shutdown(). Its "
            f"own output says why; every other rank stops with this error.", out)

    def _stop_with(self, message: str, out: dict, extra: dict | None = None) -> None:
        self._flush(out)
        out.clear()
        self.fatal = message
        self._fatal_extra = extra
        self._broadcast_fatal(message)
        self._stop.set()

    def _broadcast_fatal(self, message: str) -> None:
        if self._fatal_sent:
            return
        self._fatal_sent = True
        msg = (Msg.FATAL, message) if not self._fatal_extra else \
            (Msg.FATAL, message, self._fatal_extra)
        for peer in list(self.peers.values()):
            try:
                peer.channel.send(msg)
            except OSError:
                pass

    def _flush(self, out: dict) -> None:
        for rank, items in out.items():
            peer = self.peers.get(rank)
            if peer is None or not items:
                continue
            self._released_any = True
            try:
                peer.channel.send((Msg.RESPONSES, items))
            except OSError:
                pass  # its loss shows up as EOF on the next select
        out.clear()

    # ------------------------------------------------------------------ messages
    def _handle(self, rank: int, msg, out: dict) -> None:
        kind = msg[0]
        self.messages_handled += 1
        if kind == Msg.QUERY:
            requests, hits = msg[1], msg[2]
            tags = msg[3] if len(msg) > 3 else {}
            now = time.monotonic()
            self._last_seen[rank] = (now, requests, hits)
            ready: list[tuple[SetState, Response]] = []
            bounced: dict[int, tuple[list, list]] = {}
            for req in requests:
                if self._sent_before_steady(rank, req.process_set_id, tags):
                    bounced.setdefault(req.process_set_id, ([], []))[0].append(req.name)
                    continue
                self._on_request(rank, req, ready, out)
            for set_id, mask in hits:
                if self._sent_before_steady(rank, set_id, tags):
                    bounced.setdefault(set_id, ([], []))[1].extend(set_bits(mask))
                    continue
                self._on_hits(rank, set_id, mask, ready, out)
            for set_id, (names, bits) in bounced.items():
                out.setdefault(rank, []).append((Item.TAKE_BACK, set_id, names, bits))
            self._release(ready, out)
        elif kind == Msg.STEADY_LEFT:
            s = self.sets.get(msg[1])
            if s is not None and s.steady and msg[2] == s.epoch and rank in s.index:
                s.unsteady.add(s.index[rank])
                s.waiting.pop(s.index[rank], None)
                if len(s.unsteady) == len(s.ranks):
                    s.steady = False
                    s.unsteady.clear()
                    s.waiting.clear()
        elif kind == Msg.STEADY_WAIT:
            s = self.sets.get(msg[1])
            if s is not None and s.steady and msg[2] == s.epoch and rank in s.index:
                if msg[3]:
                    s.waiting[s.index[rank]] = (time.monotonic() - msg[4], list(msg[3]))
                else:
                    s.waiting.pop(s.index[rank], None)
        elif kind == Msg.SHUTDOWN:
            rounds = msg[1] if len(msg) > 1 and isinstance(msg[1], dict) else {}
            if len(msg) > 2 and isinstance(msg[2], str):
                self._gone_reasons[rank] = msg[2]        # it exited after an exception
            self._on_shutdown(rank, out, rounds)
        elif kind == Msg.FAILED:
            self._stop_with(f"rank {rank} failed while running a collective: {msg[1]}", out)
        elif kind == Msg.PACE:
            if self.straggler is not None:
                self.straggler.add(rank, msg[1], msg[2])
        elif kind == Msg.TIMELINE:
            if self.timeline is not None:
                self.timeline.control(*msg[1:])

    def view(self) -> dict:
        """What this coordinator last saw from every rank (for the flight-recorder report)."""
        now = time.monotonic()
        out = {}
        peers, last_seen = dict(self.peers), dict(self._last_seen)  # another thread's dicts
        for g in range(self.size):
            peer = peers.get(g)
            seen = last_seen.get(g)
            out[str(g)] = {
                "host": peer.hostname if peer else None, "pid": peer.pid if peer else None,
                "connected": peer is not None,
                "last_submitted": self._names_of(seen[1], seen[2])[:6] if seen else [],
                "last_submitted_age_s": round(now - seen[0], 3) if seen else None,
                "missing_from_stall": self.stall.waiting_for.get(g, [])}
        return out
