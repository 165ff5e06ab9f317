"""The elastic driver's control endpoint: where workers ask for rounds and hear host updates.

Every connection starts with the handshake of hvdlite/common/rendezvous.py: the session key is
derived from the job secret and two fresh nonces, and every frame is HMAC-signed with a sequence
number (wire.Channel). A connection whose first frame does not verify (a stranger, or bytes
recorded from another connection) is logged, closed, and otherwise ignored: the job goes on.
"""
from __future__ import annotations

import socket
import threading
from typing import Any, Callable

from hvdlite.common.rendezvous import server_handshake
from hvdlite.common.wire import Channel, ProtocolError

HANDSHAKE_TIMEOUT_S = 10.0


class WorkerConnection:
    """One authenticated worker connection."""

    def __init__(self, channel: Channel, worker_id: str, spawn_id: str, pid: int,
                 peer: str) -> None:
        self.channel = channel
        self.worker_id = worker_id
        self.spawn_id = spawn_id
        self.pid = pid
        self.peer = peer
        self._lock = threading.Lock()
        self.closed = False

    def send(self, msg: Any) -> bool:
        """False when the worker is gone (its exit is reported separately)."""
        with self._lock:
            if self.closed:
                return False
            try:
                self.channel.send(msg)
                return True
            except OSError:
                return False

    def close(self) -> None:
        with self._lock:
            self.closed = True
        try:
            self.channel.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.channel.close()


class ControlServer:
    """Accepts worker connections; reports ("hello", conn), ("msg", conn, msg), ("lost", conn)
    and ("rejected", text) through `on_event` (called from its threads)."""

    def __init__(self, key: bytes, on_event: Callable[[tuple], None], bind: str = "0.0.0.0"):
        self.key = key
        self.on_event = on_event
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: set[WorkerConnection] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="hvdlite-control", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name="hvdlite-control-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            channel, hello = server_handshake(sock, self.key, HANDSHAKE_TIMEOUT_S)
        except ProtocolError as exc:
            self.on_event(("rejected", f"rejected a control connection from {peer}: {exc}"))
            _close(sock)
            return
        except (OSError, ConnectionError, ValueError):
            _close(sock)  # a port scanner or a worker that died mid-handshake: nothing to say
            return
        if not (isinstance(hello, tuple) and len(hello) == 5 and hello[0] == "HELLO"):
            self.on_event(("rejected", f"rejected a control connection from {peer}: "
                                       f"unexpected first message"))
            channel.close()
            return
        conn = WorkerConnection(channel, str(hello[1]), str(hello[2]), int(hello[3]), peer)
        with self._lock:
            if self._closed.is_set():
                conn.close()
                return
            self._conns.add(conn)
        self.on_event(("hello", conn))
        try:
            while True:
                if not channel.feed():
                    break
                for msg in channel.messages():
                    self.on_event(("msg", conn, msg))
        except ProtocolError as exc:
            self.on_event(("rejected", f"{exc}; closed that connection"))
        except (OSError, ValueError):
            pass
        with self._lock:
            self._conns.discard(conn)
        conn.close()
        self.on_event(("lost", conn))

    def close(self) -> None:
        self._closed.set()
        _close(self.sock)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
