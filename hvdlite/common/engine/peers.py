"""Direct rank-to-rank connections for the steady state's rounds: opened on first use,
authenticated with a per-pair key (rendezvous.peer_session_key), read by the loop or a waiting
caller.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket

from .. import rendezvous
from ..protocol import Msg
from ..wire import Channel, ProtocolError, peer_name

log = logging.getLogger("hvdlite.common.engine")


class _PeerGreeting:
    """An accepted steady-state connection whose magic and client nonce are still arriving."""

    __slots__ = ("sock", "head")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.head = b""


class PeerConnections:
    """Part of engine.core.Engine: the peers (this module's docstring)."""

    def _peer_send(self, g: int, msg) -> None:
        ch = self._peer_out.get(g)
        if ch is None:
            hostname, addr, port, nonce = self.peer_addrs[g]
            if addr.startswith("127.") and hostname != self.peer_addrs[self.rank][0]:
                addr = self.channel.sock.getpeername()[0]     # rank 0's host, as seen from here
            try:
                sock = socket.create_connection((addr, port), timeout=30)
                sock.settimeout(None)
                # Our nonce goes first, in the clear; nothing waits for an answer (see
                # rendezvous.peer_session_key for why, and why that is still replay-proof).
                client_nonce = os.urandom(rendezvous.PEER_NONCE)
                sock.sendall(rendezvous.PEER_MAGIC + client_nonce)
                ch = Channel(sock, rendezvous.peer_session_key(
                    self.key, bytes.fromhex(nonce), client_nonce))
                ch.send((Msg.PEER_HELLO, self.rank))
            except OSError as exc:
                self._report_failure(
                    f"rank {self.rank} could not open a control connection to rank {g} at "
                    f"{addr}:{port} for the steady state: {exc}. Open the ports between the "
                    f"hosts, or set HVDLITE_STEADY_STATE=0 to keep every cycle on rank 0.")
                return
            self._peer_out[g] = ch
        self.counters["peer_messages"] += 1
        try:
            ch.send(msg)
        except OSError:
            pass   # the peer is gone; the coordinator reports why

    def _accept_peer(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        conn.setblocking(True)
        self._sel.register(conn, selectors.EVENT_READ, _PeerGreeting(conn))

    def _greet_peer(self, greeting: "_PeerGreeting") -> None:
        """Read an accepted connection's magic and client nonce (as they arrive: never blocks),
        then turn it into a channel keyed with both nonces."""
        sock = greeting.sock
        want = len(rendezvous.PEER_MAGIC) + rendezvous.PEER_NONCE
        try:
            data = sock.recv(want - len(greeting.head))   # select said readable: no wait
        except OSError:
            data = b""
        greeting.head += data
        problem = None
        if not data:
            problem = "closed before its greeting"
        elif not rendezvous.PEER_MAGIC.startswith(greeting.head[:len(rendezvous.PEER_MAGIC)]):
            problem = "not an hvdlite steady-state connection"
        elif len(greeting.head) < want:
            return
        else:
            client_nonce = greeting.head[len(rendezvous.PEER_MAGIC):]
            if client_nonce in self._seen_client_nonces:
                problem = "replayed a connection (its nonce was used before)"
            else:
                self._seen_client_nonces.add(client_nonce)
                sock.setblocking(False)
                ch = Channel(sock, rendezvous.peer_session_key(self.key, self._peer_nonce,
                                                               client_nonce))
                self._sel.modify(sock, selectors.EVENT_READ, ch)
                return
        if data:
            log.error("hvdlite: rejected a steady-state connection from %s: %s",
                      peer_name(sock), problem)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _on_peer_readable(self, ch) -> None:
        if isinstance(ch, _PeerGreeting):
            self._greet_peer(ch)
            return
        try:
            alive = ch.feed()
            msgs = ch.messages()
        except ProtocolError as exc:
            log.error("hvdlite: rejected a steady-state connection: %s", exc)
            alive, msgs = False, []
        except OSError:
            alive, msgs = False, []
        for msg in msgs:
            if msg[0] == Msg.ROUND:
                self._on_steady_msg(msg)
        if not alive:
            try:
                self._sel.unregister(ch.sock)
            except (KeyError, ValueError):
                pass
            ch.close()

    # ------------------------------------------------------------------ execution
