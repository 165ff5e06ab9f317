"""Admission: the handshake that lets a rank in (nonce authentication off the loop's thread,
its HELLO checked against the job), and the topology every rank gets back.
"""
from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time

from .. import straggler
from ..protocol import Msg
from ..rendezvous import server_handshake
from ..response_cache import CoordinatorCache
from ..wire import ProtocolError
from .state import Peer, SetState

log = logging.getLogger("hvdlite.common.controller")


class Admission:
    """Part of controller.core.Coordinator: admission (this module's docstring)."""

    # ------------------------------------------------------------------ handshake
    def _handshake(self) -> bool:
        deadline = time.monotonic() + self.settings.start_timeout_s
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        waiting: dict[int, Peer] = {}
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
                peer = Peer(channel)
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

    def _accept_hello(self, peer: Peer, msg) -> str | None:
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
