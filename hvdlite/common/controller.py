"""The coordinator: one thread in rank 0's process that every rank (rank 0 included) talks to.

It does Horovod's negotiation for every process set: collects requests by name, validates them
across ranks (negotiation.py), releases cached tensors by a bit-vector AND (response_cache.py), fuses
(fusion.py) and sends one ordered response stream. Because one coordinator orders the responses of
all process sets, every rank executes its collectives in one global order, so overlapping process
sets cannot deadlock. The event-driven loop answers as soon as a tensor is ready on every rank
instead of waiting for the next cycle.

Once a set is quiet and its tensors come back as cache hits, the coordinator hands the set to
the ranks ("D", steady.py): they release cached tensors among themselves, and the coordinator
sees the set again only for first sight, changes, errors, joins, stalls ("W") and shutdowns.
Messages are tagged with the sender's last steady epoch per set; one sent before the sender saw
the latest "D" goes back to it ("Y") instead of into the table, so the two ways of releasing a
set never interleave differently on different ranks.

A grouped call is released whole, and its ranks must pass the same members: each member is
counted as it arrives (groups.OpenGroup), and once every rank's part is here, counts or names
that differ fail the whole call on every rank with both sides (_note_group), even where no
member name is common to all ranks (an empty list takes part as one stand-in request,
ops._empty_group).
"""
from __future__ import annotations

import collections
import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from . import autotune, straggler
from .config import Settings
from .fusion import fuse_responses
from .messages import (ADD_PROCESS_SET, CACHEABLE_TYPES, ERROR, JOIN, REMOVE_PROCESS_SET,
                       TYPE_NAMES, Request, Response)
from .groups import OpenGroup
from .negotiation import construct_response
from .protocol import Item, Msg
from .rendezvous import server_handshake
from .response_cache import CoordinatorCache
from .stall import StallInspector
from .steady import COMPACT_WIDTH, gone_message, set_bits
from .wire import Channel, ProtocolError

log = logging.getLogger(__name__)

# Warn once per set when this many tensors the cache evicted for room came back: its capacity
# is below what a step submits (steps then never reach the steady state).
THRASH_WARN_RETURNS = 32


@dataclass
class SetState:
    """Negotiation state of one process set."""

    id: int
    ranks: list                                   # set rank -> global rank
    cache: CoordinatorCache
    table: dict = field(default_factory=dict)     # name -> {set rank: Request}
    first_seen: dict = field(default_factory=dict)
    pending_bits: list = field(default_factory=list)
    bit_seen: dict = field(default_factory=dict)  # bit -> first time a rank hit it
    joined: set = field(default_factory=set)
    last_joined: int = -1
    groups: dict = field(default_factory=dict)    # group -> [Response] released together
    gone: set = field(default_factory=set)        # set ranks that shut down
    epoch: int = 0                                # steady-state epochs handed out ("D")
    steady: bool = False                          # the ranks release cached tensors themselves
    unsteady: set = field(default_factory=set)    # set ranks that fell back from `epoch` ("U")
    waiting: dict = field(default_factory=dict)   # set rank -> (since, names) waiting in a round
    all_hits: bool = False                        # this round released only cache hits
    thrash_warned: bool = False                   # warned that the cache is too small
    # Groups whose ranks disagreed on their members (_fail_group): group -> (error, {set rank:
    # how many of its members' requests are still to be failed}).
    failed_groups: dict = field(default_factory=dict)
    # Grouped calls not yet released: group -> groups.OpenGroup (_note_group).
    open_groups: dict = field(default_factory=dict)

    def __post_init__(self):
        self.index = {g: i for i, g in enumerate(self.ranks)}
        self.pending_bits = [0] * len(self.ranks)


@dataclass
class _Peer:
    channel: Channel
    rank: int = -1
    hostname: str = ""
    pid: int = 0
    hello: dict | None = None


class Coordinator:
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
        self.peers: dict[int, _Peer] = {}          # global rank -> peer
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

    # ------------------------------------------------------------------ handshake
    def _handshake(self) -> bool:
        deadline = time.monotonic() + self.settings.start_timeout_s
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        waiting: dict[int, _Peer] = {}
        while len(self.peers) < self.size:
            left = deadline - time.monotonic()
            if self._stop.is_set():
                return False
            if left <= 0:
                missing = sorted(set(range(self.size)) - set(self.peers))
                self._fail_handshake(
                    f"ranks {missing} did not connect to the coordinator on rank 0 within "
                    f"{self.settings.start_timeout_s:.0f} s (HVDLITE_START_TIMEOUT). Check that "
                    f"every rank was started, runs the same script and reaches rank 0's host.")
                return False
            if self.abort_check is not None:
                why = self.abort_check()
                if why:
                    self._fail_handshake(why)
                    return False
            for key, _ in self.sel.select(timeout=min(left, 0.25)):
                if key.data == "listen":
                    self._accept_connection()
                elif key.data == "wake":
                    self._wake_r.recv(4096)
                else:
                    peer = key.data
                    try:
                        alive = peer.channel.feed()
                        msgs = peer.channel.messages() if alive else []
                    except (OSError, ProtocolError) as exc:
                        log.warning("hvdlite coordinator: rejected a connection: %s", exc)
                        alive, msgs = False, []
                    if not alive:
                        self.sel.unregister(peer.channel.sock)
                        waiting.pop(peer.channel.fileno(), None)
                        peer.channel.close()
                        continue
                    for msg in msgs:
                        error = self._accept_hello(peer, msg)
                        if error:
                            self._fail_handshake(error)
                            return False
            while True:
                try:
                    channel, hello = self._arrivals.get_nowait()
                except queue.Empty:
                    break
                peer = _Peer(channel)
                waiting[channel.fileno()] = peer
                self.sel.register(channel.sock, selectors.EVENT_READ, peer)
                error = self._accept_hello(peer, hello)
                if error:
                    self._fail_handshake(error)
                    return False
        self._send_topology()
        return True

    # ------------------------------------------------------------------ authentication
    def _accept_connection(self) -> None:
        try:
            conn, addr = self.listener.accept()
        except (BlockingIOError, OSError):
            return
        conn.setblocking(True)
        threading.Thread(target=self._authenticate, args=(conn, f"{addr[0]}:{addr[1]}"),
                         name="hvdlite-coordinator-auth", daemon=True).start()

    def _authenticate(self, conn: socket.socket, peer: str) -> None:
        """The nonce handshake of the driver's endpoints (rendezvous.server_handshake): a frame
        recorded on another connection, a forged or oversized one, or a truncated handshake is
        refused and logged; the job goes on."""
        try:
            channel, hello = server_handshake(conn, self.key, 10.0)
        except (OSError, ConnectionError, ValueError, EOFError) as exc:
            self.refused += 1
            log.warning("hvdlite coordinator: refused a connection from %s: %s (the job goes on)",
                        peer, exc or type(exc).__name__)
            try:
                conn.close()
            except OSError:
                pass
            return
        except Exception as exc:  # an unpicklable payload that passed the MAC: still refused
            self.refused += 1
            log.warning("hvdlite coordinator: refused a connection from %s: %r (the job goes on)",
                        peer, exc)
            conn.close()
            return
        self._arrivals.put((channel, hello))
        try:
            self._wake_w.send(b"a")
        except OSError:
            channel.close()

    def _refuse_late_arrivals(self) -> None:
        """Every rank has joined: a later connection, even an authenticated one, has no place."""
        while True:
            try:
                channel, hello = self._arrivals.get_nowait()
            except queue.Empty:
                return
            self.refused += 1
            who = hello[1].get("rank") if isinstance(hello, tuple) and len(hello) > 1 and \
                isinstance(hello[1], dict) else "?"
            log.warning("hvdlite coordinator: refused a connection from %s claiming rank %s: "
                        "every rank has already joined (the job goes on)", channel._peer(), who)
            channel.close()

    def _accept_hello(self, peer: _Peer, msg) -> str | None:
        if not (isinstance(msg, tuple) and msg and msg[0] == Msg.HELLO):
            return "a rank sent an unexpected first message to the coordinator"
        hello = msg[1]
        rank, size = hello["rank"], hello["size"]
        if size != self.size:
            return (f"rank {rank} was started with size {size} but rank 0 with size {self.size}; "
                    f"all ranks must belong to the same job.")
        if not 0 <= rank < self.size:
            return f"a rank reported rank {rank}, outside 0..{self.size - 1}"
        if rank in self.peers:
            return (f"two processes both claim rank {rank} (pids {self.peers[rank].pid} and "
                    f"{hello['pid']}); check HOROVOD_RANK/RANK in their environments.")
        peer.rank, peer.hostname, peer.pid, peer.hello = rank, hello["hostname"], hello["pid"], hello
        self.peers[rank] = peer
        return None

    def _fail_handshake(self, message: str) -> None:
        self.fatal = message
        self._broadcast_fatal(message)

    def _send_topology(self) -> None:
        hellos = [self.peers[r].hello for r in range(self.size)]
        # Process sets registered at init must be the same everywhere.
        first_sets = hellos[0]["process_sets"]
        for h in hellos[1:]:
            if h["process_sets"] != first_sets:
                self._fail_handshake(
                    f"init(process_sets=...) differs between ranks: rank 0 passed {first_sets} "
                    f"but rank {h['rank']} passed {h['process_sets']}. Pass the same list on "
                    f"every rank.")
                self._stop.set()
                return
        self.dynamic = any(h["dynamic"] for h in hellos)
        self.sets[0] = SetState(0, list(range(self.size)),
                                CoordinatorCache(self.settings.cache_capacity))
        set_ids = []
        for ranks in first_sets:
            sid = self.next_set_id
            self.next_set_id += 1
            self.sets[sid] = SetState(sid, list(ranks),
                                      CoordinatorCache(self.settings.cache_capacity))
            set_ids.append(sid)
        # Topology: hosts in order of their lowest rank.
        hosts: dict[str, list[int]] = {}
        for h in hellos:
            hosts.setdefault(h["hostname"], []).append(h["rank"])
        host_order = list(hosts)
        local_sizes = [len(hosts[name]) for name in host_order]
        peers = {}
        for r in range(self.size):
            try:
                addr = self.peers[r].channel.sock.getpeername()[0]
            except OSError:
                addr = "127.0.0.1"
            hello = self.peers[r].hello
            peers[r] = (self.peers[r].hostname, addr, hello.get("peer_port", 0),
                        hello.get("peer_nonce", ""))
        for h in hellos:
            members = hosts[h["hostname"]]
            local_rank = members.index(h["rank"])
            with_slot = [name for name in host_order if len(hosts[name]) > local_rank]
            topo = {
                "local_rank": local_rank,
                "local_size": len(members),
                "cross_rank": with_slot.index(h["hostname"]),
                "cross_size": len(with_slot),
                "homogeneous": len(set(local_sizes)) == 1,
                "process_set_ids": set_ids,
                "hosts": {r: self.peers[r].hostname for r in range(self.size)},
                "peers": peers,
            }
            self.peers[h["rank"]].channel.send((Msg.TOPOLOGY, topo))
        interval = straggler.interval_from_env()
        if interval > 0 and self.size > 1:
            self.straggler = straggler.Tracker(
                self.size, interval, {r: p.hostname for r, p in self.peers.items()},
                time.monotonic())

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

    def _lost(self, peer: _Peer, out: dict) -> None:
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

    def _sent_before_steady(self, rank: int, set_id: int, tags: dict) -> bool:
        """True for a message sent before its sender saw the set's latest "D"."""
        s = self.sets.get(set_id)
        return s is not None and s.epoch > 0 and tags.get(set_id, 0) < s.epoch \
            and rank in s.index

    def _set_for(self, rank: int, set_id: int, name: str, out: dict) -> SetState | None:
        s = self.sets.get(set_id)
        if s is None or rank not in s.index:
            self._send_error(rank, set_id, [name],
                             f"rank {rank} submitted tensor '{name}' to process set {set_id}, "
                             f"which {'does not exist' if s is None else 'it is not a member of'}.",
                             out)
            return None
        return s

    def _send_error(self, rank: int, set_id: int, names: list, message: str, out: dict,
                    gone: bool = False) -> None:
        """Fail `names` on `rank`; `gone`: because a member left (the frontends report that as
        a broken job, not as ranks that disagreed: TensorFlow's UnknownError, as Horovod's
        "Horovod has been shut down")."""
        out.setdefault(rank, []).append((Item.RESPONSE, Response(type=ERROR, names=list(names),
                                                       process_set_id=set_id, error=message,
                                                       gone=gone)))

    def _on_request(self, rank: int, req: Request, ready: list, out: dict) -> None:
        s = self._set_for(rank, req.process_set_id, req.name, out)
        if s is None:
            return
        idx = s.index[rank]
        if s.gone:
            gone = sorted(s.ranks[i] for i in s.gone)
            self._send_error(rank, s.id, [req.name], self._gone_message(gone, repr(req.name)), out,
                             gone=True)
            return
        if req.type == JOIN:
            self._on_join(s, idx, rank, ready)
            return
        entry = s.cache.invalidate(req.name)
        if entry is not None:
            # Parameters changed: everyone's pending hit on the old bit becomes a full request.
            self._retire_bits(s, [entry.bit], ready)
        self._add_to_table(s, idx, req, ready)

    def _retire_bits(self, s: SetState, bits: list, ready: list) -> None:
        """Bits left the cache: pending hits on them become full requests again, and every rank
        of the set is told (after this round's responses, which may have introduced them)."""
        for bit in bits:
            s.bit_seen.pop(bit, None)
            entry = s.cache.lookup_bit(bit)
            for j in range(len(s.ranks)):
                if s.pending_bits[j] >> bit & 1:
                    s.pending_bits[j] &= ~(1 << bit)
                    self._add_to_table(s, j, entry.requests[j], ready)
        self._evicted.append((s, list(bits)))

    def _add_to_table(self, s: SetState, idx: int, req: Request, ready: list) -> None:
        reqs = s.table.get(req.name)
        if reqs is None:
            reqs = s.table[req.name] = {}
            s.first_seen[req.name] = time.monotonic()
            if self.timeline is not None:
                self.timeline.negotiate_start(req.name, TYPE_NAMES[req.type])
        reqs[idx] = req
        if self.timeline is not None:
            self.timeline.negotiate_rank(req.name, s.ranks[idx])
        if req.group is not None:
            self._note_group(s, idx, req.group, req.group_size, req.name, req.type, ready)
        self._checks.append((s, req.name, ready))
        if self._checking:
            return
        # Checked from a worklist, not by recursion: a response put in the cache may evict a
        # bit, whose pending hits come back here as requests, whose responses may evict the
        # next bit, and so on. Recursing, a step of more named tensors than the cache holds
        # (~1,100 against the default 1,024) went ~3 frames deeper per eviction until the
        # coordinator died of RecursionError and the job with it.
        self._checking = True
        try:
            while self._checks:
                self._check_ready(*self._checks.popleft())
        finally:
            self._checking = False
            self._checks.clear()

    def _check_ready(self, s: SetState, name: str, ready: list) -> None:
        reqs = s.table.get(name)        # (None: released meanwhile, by a check queued first)
        if reqs is None:
            return
        if s.failed_groups:
            group = next(iter(reqs.values())).group
            if group in s.failed_groups:
                self._fail_member(s, group, name, ready)
                return
        if len(reqs) + len(s.joined - set(reqs)) < len(s.ranks):
            return
        del s.table[name]
        s.first_seen.pop(name, None)
        resp = construct_response(name, reqs, s.ranks, frozenset(s.joined))
        if self.timeline is not None:
            self.timeline.negotiate_end(name)
        groups = {(r.group, r.group_size) for r in reqs.values()}
        if len(groups) > 1:
            self._fail_group(s, name, reqs, resp.error, ready)
            return
        if resp.group is not None:
            self._group_sizes[(s.id, resp.group)] = max(r.group_size for r in reqs.values())
        if resp.type == ADD_PROCESS_SET:
            self._add_process_set(resp)
        elif resp.type == REMOVE_PROCESS_SET:
            self._remove_process_set(resp)
        cacheable = (resp.type in CACHEABLE_TYPES and not s.joined
                     and self.settings.cache_capacity > 0
                     and all(r.cacheable for r in reqs.values()))
        resp.cache_bits = [-1]
        if cacheable:
            bit, evicted = s.cache.put(resp, reqs)
            resp.cache_bits = [bit]
            self._fresh.add((s.id, bit))
            ready.append((s, resp))
            if evicted:
                self._retire_bits(s, evicted, ready)
            if s.cache.returned >= THRASH_WARN_RETURNS and not s.thrash_warned:
                s.thrash_warned = True
                log.warning(
                    "process set %d: the response cache (HOROVOD_CACHE_CAPACITY=%d tensors) is "
                    "smaller than the set of tensors the job keeps submitting: %d tensors it "
                    "evicted to make room were submitted again. Each step then "
                    "negotiates them through the coordinator on rank 0, and the set never "
                    "reaches the steady state. Set HOROVOD_CACHE_CAPACITY (or "
                    "HVDLITE_CACHE_CAPACITY) above the number of named collectives one step "
                    "submits.", s.id, s.cache.capacity, s.cache.returned)
            return
        ready.append((s, resp))

    def _fail_group(self, s: SetState, name: str, reqs: dict, error: str, ready: list) -> None:
        """The ranks put tensor `name` in different groups, or in groups of different sizes
        (construct_response's error): fail it and every member of those groups, now and as the
        rest arrive, on every rank.

        Why: a grouped response is held until its whole group is ready, and a member that only
        some ranks submit (a rank whose group has more tensors) is never ready. The job waited
        until the stall shutdown (600 s by default), whose report then named a healthy rank as
        hung."""
        s.table[name] = reqs                     # (failed below with the others)
        for group in {r.group for r in reqs.values()} - {None}:
            self._group_sizes.pop((s.id, group), None)
            # Each rank's call has its own count of members, every one of them a request
            # (this one's among them): the group is forgotten once all are failed, so that a
            # member arriving late still fails, and the name may be used alike afterwards.
            s.failed_groups.setdefault(group, (error, {
                idx: max(r.group_size, 1) for idx, r in reqs.items() if r.group == group}))
            s.open_groups.pop(group, None)
            for other in [n for n, rs in s.table.items()
                          if any(r.group == group for r in rs.values())]:
                self._fail_member(s, group, other, ready)
        # (`name` is among them: the (group, size) pairs differ, so some rank put it in one.)

    def _note_group(self, s: SetState, idx: int, group: str, size: int, name: str,
                    rtype: int, ready: list) -> None:
        """Set rank `idx` submitted member `name` of its call of `group`, a call of `size`
        members (0: an empty list's stand-in, ops._empty_group): counted in the call's
        OpenGroup, which fails the call on every rank once the ranks' counts or names are
        certain to differ (groups.py says why and when). Members that arrive as cache hits
        are counted too: those pending when a call opens, and those that arrive while it is
        open (_grouped_hits)."""
        if group in s.failed_groups:
            return
        og = s.open_groups.get(group)
        opened = og is None
        if opened:
            og = s.open_groups[group] = OpenGroup()
            for j, bits in enumerate(s.pending_bits):
                for bit in set_bits(bits):
                    entry = s.cache.by_bit.get(bit)
                    if entry is not None and entry.template.group == group:
                        og.add(j, entry.group_size, entry.template.names[0])
        if og.add(idx, size, name) or opened:
            error = og.verdict(s.ranks, s.joined, rtype, group)
            if error is not None:
                self._fail_open_group(s, group, error, ready)

    def _fail_open_group(self, s: SetState, group: str, error: str, ready: list) -> None:
        """Fail the open call of `group` (_note_group) on every rank: its members here (in the
        table, or pending as cache hits) now, and those still to come as they arrive
        (failed_groups). Members every rank submitted and that are ready already (the names
        differ elsewhere) are released as they are; each rank's call fails all the same."""
        og = s.open_groups.pop(group)
        self._group_sizes.pop((s.id, group), None)
        # Requests still to fail per rank (an empty list's stand-in is one request).
        owed = {j: max(n, 1) for j, (n, _) in og.calls.items()}
        s.failed_groups[group] = (error, owed)
        held = s.groups.pop(group, [])
        for resp in held + [r for t, r in ready if t is s and r.group == group]:
            for j in owed:
                owed[j] = max(owed[j] - len(resp.names), 0)
        ready.extend((s, resp) for resp in held)  # (alone: its group's size is forgotten)
        for other in [n for n, rs in s.table.items()
                      if any(r.group == group for r in rs.values())]:
            self._fail_member(s, group, other, ready)
        for j, bits in enumerate(s.pending_bits):
            for bit in set_bits(bits):
                entry = s.cache.by_bit.get(bit)
                if entry is not None and entry.template.group == group \
                        and group in s.failed_groups:
                    s.pending_bits[j] &= ~(1 << bit)
                    if not any(p >> bit & 1 for p in s.pending_bits):
                        s.bit_seen.pop(bit, None)
                    self._add_to_table(s, j, entry.requests[j], ready)
        if group in s.failed_groups and not any(owed.values()):
            del s.failed_groups[group]

    def _fail_member(self, s: SetState, group: str, name: str, ready: list) -> None:
        """Fail `name`, a member of the failed `group` (_fail_group), on every rank; the
        group is forgotten once every rank's members are failed."""
        reqs = s.table.pop(name, None)
        if reqs is None:
            return
        s.first_seen.pop(name, None)
        error, owed = s.failed_groups[group]
        # (No group on the response: it is released at once, not held for its group.)
        ready.append((s, Response(type=ERROR, names=[name], process_set_id=s.id, error=error)))
        for idx, r in reqs.items():
            if r.group == group and owed.get(idx, 0) > 0:
                owed[idx] -= 1
        if not any(owed.values()):
            del s.failed_groups[group]

    def _on_hits(self, rank: int, set_id: int, mask: int, ready: list, out: dict) -> None:
        s = self.sets.get(set_id)
        if s is None or rank not in s.index:
            return
        idx = s.index[rank]
        if s.gone:
            # As for full requests (_on_request): a member already shut down, so these can never
            # be released. Without this, a cache hit sent after the shutdown waited forever.
            names = self._bit_names(s, mask)
            gone = sorted(s.ranks[i] for i in s.gone)
            self._send_error(rank, s.id, names,
                             self._gone_message(gone, ", ".join(repr(n) for n in names[:6])), out,
                             gone=True)
            return
        stale = mask & ~s.cache.valid_mask
        mask &= s.cache.valid_mask
        if s.open_groups or s.failed_groups:
            mask = self._grouped_hits(s, idx, mask, ready)
        now = time.monotonic()
        for bit in set_bits(mask & ~s.pending_bits[idx]):
            s.bit_seen.setdefault(bit, now)
        # The live bits are pending before the stale ones below are handled: a stale bit's
        # request may complete a tensor whose new cache entry evicts one of these bits, and
        # _retire_bits turns only pending bits back into requests. (Added after, an evicted
        # bit stayed pending for a tensor the cache no longer had: with more tensors per step
        # than HOROVOD_CACHE_CAPACITY the job hung within a few steps.)
        s.pending_bits[idx] |= mask
        if stale:
            # The rank used a bit the coordinator has since retired: treat it as a full request,
            # or, once the retired entry is forgotten too, ask the rank to send it in full.
            resend = []
            for bit in set_bits(stale):
                entry = s.cache.lookup_bit(bit)
                if entry is None:
                    resend.append(bit)
                else:
                    self._add_to_table(s, idx, entry.requests[idx], ready)
            if resend:
                out.setdefault(rank, []).append((Item.RESEND, set_id, resend))
        self._release_bits(s, ready)

    def _grouped_hits(self, s: SetState, idx: int, mask: int, ready: list) -> int:
        """`mask` less the hits of set rank `idx` on members of a failed group, which fail
        (as its full requests would, _fail_member); hits on an open group's members are
        counted (_note_group), and fail too where that call fails.

        All of them are counted before any is failed: the verdict may come on the last hit
        of a call (its names compared once all are here), and then every hit of the call
        fails, the ones counted before it too. (Failed as they were counted, only the last
        one was: the others stayed pending for a call the other ranks had already been told
        had failed, and their rank waited for the stall shutdown.)"""
        fresh = [(bit, s.cache.by_bit[bit]) for bit in set_bits(mask & ~s.pending_bits[idx])]
        for bit, entry in fresh:
            group = entry.template.group
            if group is not None and group in s.open_groups:
                self._note_group(s, idx, group, entry.group_size, entry.template.names[0],
                                 entry.template.type, ready)
        for bit, entry in fresh:
            group = entry.template.group
            if group is not None and group in s.failed_groups:
                mask &= ~(1 << bit)
                self._add_to_table(s, idx, entry.requests[idx], ready)
        return mask

    def _release_bits(self, s: SetState, ready: list) -> None:
        common = -1
        active = False
        for j, bits in enumerate(s.pending_bits):
            if j not in s.joined:
                common &= bits
                active = True
        if not active or common <= 0:
            return
        for j in range(len(s.pending_bits)):
            s.pending_bits[j] &= ~common
        joined = tuple(sorted(s.joined))
        for bit in set_bits(common):
            s.bit_seen.pop(bit, None)
            entry = s.cache.by_bit[bit]
            s.cache.touch(entry)
            t = entry.template
            if t.group is not None:
                # A grouped op's hit: _release_ready holds it until its whole group is here.
                self._group_sizes[(s.id, t.group)] = entry.group_size
            resp = Response(type=t.type, names=list(t.names), process_set_id=s.id, dtype=t.dtype,
                            shapes=list(t.shapes), reduce_op=t.reduce_op, prescale=t.prescale,
                            postscale=t.postscale, root_rank=t.root_rank, device=t.device,
                            rank_dims=list(t.rank_dims) if t.rank_dims is not None else None,
                            cache_bits=[bit], joined=joined, group=t.group)
            ready.append((s, resp))

    def _on_join(self, s: SetState, idx: int, rank: int, ready: list) -> None:
        s.joined.add(idx)
        s.last_joined = rank
        for name in list(s.table):
            self._check_ready(s, name, ready)
        if len(s.joined) == len(s.ranks):
            ready.append((s, Response(type=JOIN, names=["join.noname"], process_set_id=s.id,
                                      last_joined_rank=s.last_joined)))
            s.joined.clear()
            s.last_joined = -1
        else:
            self._release_bits(s, ready)

    def _on_shutdown(self, rank: int, out: dict, rounds: dict) -> None:
        """`rounds`: set -> (epoch, steady rounds the rank finished), from its "S" message."""
        self._shut_down_ranks.add(rank)
        for s in self.sets.values():
            if rank not in s.index:
                continue
            s.gone.add(s.index[rank])
            if s.steady:
                # Ranks still steady fail what waits on the gone rank themselves, once the
                # rounds it finished are over there too (engine.Engine._steady_gone).
                epoch, done = rounds.get(s.id, (None, None))
                for other in s.ranks:
                    if other != rank:
                        reason = self._gone_reasons.get(rank)
                        out.setdefault(other, []).append(
                            (Item.GONE, s.id, [rank], epoch, done) + ((reason,) if reason else ()))
            bits = 0
            for b in s.pending_bits:
                bits |= b
            names = list(s.table) + self._bit_names(s, bits)
            if names:
                message = self._gone_message([rank], ", ".join(repr(n) for n in names[:6]))
                for other in s.ranks:
                    if other != rank:
                        self._send_error(other, s.id, names, message, out, gone=True)
                s.table.clear()
                s.first_seen.clear()
                s.pending_bits = [0] * len(s.ranks)
                s.bit_seen.clear()

    @staticmethod
    def _bit_names(s: SetState, bits: int) -> list:
        """The tensor names behind a mask of cache bits (bits the cache forgot are skipped)."""
        names = []
        for bit in set_bits(bits):
            entry = s.cache.lookup_bit(bit)
            if entry is not None:
                names.append(entry.template.names[0])
        return names

    def _gone_message(self, gone: list, what: str) -> str:
        return gone_message(gone, what, self._gone_reasons)

    # ------------------------------------------------------------------ process sets
    def _add_process_set(self, resp: Response) -> None:
        ranks = list(resp.extra)
        error = None
        if not self.dynamic:
            error = ("add_process_set() needs dynamic process sets: call "
                     "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1.")
        elif not ranks or sorted(set(ranks)) != ranks or ranks[0] < 0 or ranks[-1] >= self.size:
            error = (f"add_process_set({ranks}): ranks must be distinct, sorted and within "
                     f"0..{self.size - 1}.")
        elif any(s.ranks == ranks for s in self.sets.values()):
            error = f"add_process_set({ranks}): a process set with these ranks already exists."
        if error:
            resp.type, resp.error = ERROR, error
            return
        sid = self.next_set_id
        self.next_set_id += 1
        self.sets[sid] = SetState(sid, ranks, CoordinatorCache(self.settings.cache_capacity))
        resp.extra = (sid, tuple(ranks))

    def _remove_process_set(self, resp: Response) -> None:
        sid = resp.extra
        s = self.sets.get(sid)
        error = None
        if not self.dynamic:
            error = ("remove_process_set() needs dynamic process sets: call "
                     "hvd.init(process_sets='dynamic').")
        elif sid == 0:
            error = "the global process set cannot be removed."
        elif s is None:
            error = f"remove_process_set: process set {sid} does not exist."
        elif s.table or any(s.pending_bits):
            error = (f"remove_process_set: process set {sid} still has collectives in flight "
                     f"({sorted(s.table)[:6]}); synchronize them first.")
        if error:
            resp.type, resp.error = ERROR, error
            return
        del self.sets[sid]

    # ------------------------------------------------------------------ release
    def _announce_evictions(self, s: SetState, bits: list, out: dict) -> None:
        for g in s.ranks:
            out.setdefault(g, []).append((Item.EVICT, s.id, list(bits)))

    def _release(self, ready: list, out: dict) -> None:
        self._release_ready(ready, out)
        # Evictions go after the responses: a bit introduced and retired in the same round must
        # reach the ranks as introduced, then retired.
        for s, bits in self._evicted:
            self._announce_evictions(s, bits, out)
        self._evicted = []
        # A grouped member held for the rest of its group keeps its bit fresh until it is
        # released: the ranks learn a bit from the full response only (sent compact, a later
        # round's release named a bit no rank knew).
        self._fresh = {(s.id, b) for s in self.sets.values() if s.groups
                       for held in s.groups.values() for resp in held
                       for b in (resp.cache_bits or ()) if (s.id, b) in self._fresh} \
            if self._fresh else self._fresh
        self._maybe_enter_steady(out)

    def _maybe_enter_steady(self, out: dict) -> None:
        """Hand quiet sets whose tensors come back as cache hits to the ranks (steady.py).

        Not while autotune tunes the coordinator's cycle, nor while a timeline records: the
        timeline's NEGOTIATE phases (who submitted when, who was last) are seen only here."""
        if not self.settings.steady_state or self.autotune is not None:
            return
        if self.timeline is not None and self.timeline.enabled:
            return
        for s in self.sets.values():
            if not s.all_hits:
                continue
            s.all_hits = False
            if (s.steady or s.table or any(s.pending_bits) or s.joined
                    or s.groups or s.failed_groups or s.gone or self.fatal):
                continue
            s.epoch += 1
            s.steady = True
            s.unsteady.clear()
            s.waiting.clear()
            # The rounds' width: every bit the set's tensors can carry until its next fallback
            # (new bits need the coordinator). 0 keeps rounds on the control connections.
            width = s.cache.next_bit if self.settings.steady_rounds == "auto" else 0
            slots = None
            if width > COMPACT_WIDTH:
                # Bits are never reused, so a name whose signature keeps changing (say, an
                # allgather of a varying batch) hands out a new one each time; the rounds then
                # carry only the live ones, numbered 0.. in this order (steady.TransportRound).
                slots = tuple(sorted(s.cache.by_bit))
                width = max(len(slots), 1)
            for g in s.ranks:
                out.setdefault(g, []).append((Item.STEADY, s.id, s.epoch, width, slots))

    def _release_ready(self, ready: list, out: dict) -> None:
        if not ready:
            return
        # Hold grouped responses until the whole group is ready.
        released: list[tuple[SetState, Response]] = []
        for s, resp in ready:
            if resp.group is None:
                released.append((s, resp))
                continue
            members = s.groups.setdefault(resp.group, [])
            members.append(resp)
            size = self._group_size(s, resp)
            if len(members) >= size:
                del s.groups[resp.group]
                self._group_sizes.pop((s.id, resp.group), None)
                s.open_groups.pop(resp.group, None)
                released.extend((s, m) for m in members)
        if not released:
            return
        by_id = {s.id: s for s, _ in released}
        threshold = (self.settings.fusion_threshold if self.autotune is None
                     else self.autotune.fusion_threshold)
        fused = fuse_responses([r for _, r in released], threshold,
                               group_fusion=not self.settings.disable_group_fusion)
        if self.autotune is not None:
            # Autotune hook: score what was released; a new cycle time goes to every rank ahead
            # of these responses (the engine applies Item.CYCLE_TIME items).
            cycle_ms = self.autotune.observe(fused)
            if cycle_ms is not None:
                for g in self.peers:
                    out.setdefault(g, []).append((Item.CYCLE_TIME, cycle_ms))
        hits_only: dict[int, bool] = {}
        for resp in fused:
            s = by_id[resp.process_set_id]
            bits = resp.cache_bits or []
            compact = (resp.type in CACHEABLE_TYPES and bits and all(b >= 0 for b in bits)
                       and not any((s.id, b) in self._fresh for b in bits))
            item = ((Item.CACHED, s.id, tuple(bits), resp.joined) if compact
                    else (Item.RESPONSE, resp))
            hits_only[s.id] = hits_only.get(s.id, True) and compact and not resp.joined
            for g in s.ranks:
                out.setdefault(g, []).append(item)
        for sid, hits in hits_only.items():
            by_id[sid].all_hits = hits

    def _group_size(self, s: SetState, resp: Response) -> int:
        return self._group_sizes.get((s.id, resp.group), 1)

    # ------------------------------------------------------------------ stalls
    def _check_stalls(self, now: float) -> None:
        if self.settings.stall_check_disable:
            return
        fatal = self.stall.check(self.sets, now)
        if self.stall.missing and not self._dump_asked:
            # A stall is reported: every rank dumps its flight recorder and stacks now, while
            # the picture is fresh (flight_recorder.py); the hung rank cannot, and the
            # coordinator's own view of it goes into rank 0's dump.
            self._dump_asked = True
            for peer in list(self.peers.values()):
                try:
                    peer.channel.send((Msg.DUMP, "stall reported"))
                except OSError:
                    pass
        if fatal and self._still_starting(list(self.stall.missing)):
            fatal = None
        if fatal:
            hung = list(self.stall.missing)
            out: dict = {}
            self._stop_with(self._hang_message(hung, now) + "\n" + fatal, out,
                            {"hung": hung, "dump": "stall shutdown"})

    def _still_starting(self, hung: list) -> bool:
        """Ranks that have sent no collective yet, before any collective was released, are still
        starting (the steady state sends the coordinator nothing, so a hung rank's silence alone
        does not tell): a worker that joins an
        elastic job imports what its first steps need (torch's optimizers pull in torch._dynamo)
        and can take longer than a short stall shutdown time on a busy host. They get the start
        timeout (HVDLITE_START_TIMEOUT) instead; a rank hung after its first collective does not."""
        if getattr(self, "_released_any", False):
            return False   # a collective was released: every rank of it had started
        grace = max(self.settings.start_timeout_s, self.settings.stall_shutdown_s)
        return bool(hung) and all(self._last_seen.get(g) is None for g in hung) \
            and self.stall.oldest < grace

    def _heartbeat(self) -> None:
        """Once a second: lets every rank tell a quiet coordinator from a hung one (a stopped
        rank 0 stops its coordinator too; see Engine._check_coordinator)."""
        for peer in list(self.peers.values()):
            try:
                peer.channel.send((Msg.HEARTBEAT,))
            except OSError:
                pass

    def _describe_last(self, rank: int, now: float) -> str:
        seen = self._last_seen.get(rank)
        if seen is None:
            return "it has not sent the coordinator any collective yet"
        names = self._names_of(seen[1], seen[2])
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        return f"the last collectives it submitted were {shown or '(none)'}, {now - seen[0]:.1f} s ago"

    def _names_of(self, requests, hits) -> list:
        names = [r.name for r in requests]
        for set_id, mask in hits:
            s = self.sets.get(set_id)
            if s is not None:
                names += self._bit_names(s, mask)
        return names

    def _hang_message(self, hung: list, now: float) -> str:
        """One line per hung rank: who, where, what it last did, what the others wait for."""
        lines = []
        for g in hung:
            peer = self.peers.get(g)
            where = f"host {peer.hostname}, pid {peer.pid}" if peer else "connection lost"
            waiting = self.stall.waiting_for.get(g, [])
            others = sorted(r for r in self.peers if r not in hung)
            lines.append(
                f"rank {g} ({where}) stopped making progress (hung): ranks {others} have waited "
                f"{self.stall.oldest:.0f} s for it to submit {waiting[:4]}; "
                f"{self._describe_last(g, now)}.")
        return "\n".join(lines)

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
