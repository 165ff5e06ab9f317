"""The control plane's framing: length-prefixed pickles over TCP, each authenticated with HMAC.

A plain socket round trip costs ~30 µs here, against ~0.1-2 ms for a gloo collective, so
negotiation travels on its own sockets. Each frame's MAC covers a per-direction sequence number,
so a forged or replayed frame is rejected before anything is unpickled; a frame larger than
MAX_FRAME is refused from its header, before its payload is buffered. The key of a channel is a
per-connection key from the nonce handshake in rendezvous.py (server_handshake/client_handshake),
used by the driver's endpoint and the coordinator alike.
"""
from __future__ import annotations

import hashlib
import hmac
import pickle
import socket
import struct
import threading

from . import config
from .protocol import FRAME_TAGS

_HEADER = struct.Struct("!IQ")       # payload length, sequence number
_MAC_LEN = 32
# No control message comes near this; a header announcing more is refused before the payload is
# buffered, so a stranger cannot make a rank allocate gigabytes.
MAX_FRAME = config.raw_int("HVDLITE_MAX_FRAME_BYTES", 64 << 20)


class ProtocolError(ConnectionError):
    """A peer sent a frame that failed authentication or could not be parsed."""


def peer_name(sock: socket.socket) -> str:
    """"host:port" of the other end, for messages; "peer" once the socket is closed."""
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "peer"


class Channel:
    """One authenticated, ordered, bidirectional message stream over a connected socket."""

    def __init__(self, sock: socket.socket, key: bytes):
        self.sock = sock
        self.key = key
        self.send_seq = 0
        self.recv_seq = 0
        self._buf = bytearray()
        self._pending: list = []      # verified messages read ahead by recv_blocking
        self._send_lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _mac(self, header: bytes, payload: bytes) -> bytes:
        return hmac.new(self.key, header + payload, hashlib.sha256).digest()

    def send(self, obj) -> None:
        """Thread-safe: frames from different threads never interleave.

        `obj` is a frame: a tuple whose first item is a kind of protocol.py's schema, so a frame
        no peer would understand fails here, at its sender, instead of on the other end."""
        if type(obj) is not tuple or not obj or obj[0] not in FRAME_TAGS:
            raise ProtocolError(f"refused to send a frame that is not in the protocol schema "
                                f"(protocol.py): {str(obj)[:80]}")
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            header = _HEADER.pack(len(payload), self.send_seq)
            self.send_seq += 1
            self.sock.sendall(header + self._mac(header, payload) + payload)

    def feed(self) -> bool:
        """Read what the socket has (one recv). Returns False on EOF."""
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:          # a non-blocking socket another thread drained
            return True
        if not data:
            return False
        self._buf += data
        return True

    def messages(self) -> list:
        """Complete messages buffered so far, verified and unpickled, in order."""
        out, self._pending = self._pending, []
        buf = self._buf
        pos = 0
        hlen = _HEADER.size
        while len(buf) - pos >= hlen + _MAC_LEN:
            length, seq = _HEADER.unpack_from(buf, pos)
            if length > MAX_FRAME:
                raise ProtocolError(
                    f"rejected a control message from {self._peer()}: oversized frame "
                    f"({length} bytes announced, the cap is {MAX_FRAME}; HVDLITE_MAX_FRAME_BYTES)")
            end = pos + hlen + _MAC_LEN + length
            if len(buf) < end:
                break
            header = bytes(buf[pos:pos + hlen])
            mac = bytes(buf[pos + hlen:pos + hlen + _MAC_LEN])
            payload = bytes(buf[pos + hlen + _MAC_LEN:end])
            if seq != self.recv_seq or not hmac.compare_digest(mac, self._mac(header, payload)):
                raise ProtocolError(
                    f"rejected a control message from {self._peer()}: bad signature or replayed "
                    f"sequence number (expected {self.recv_seq}, got {seq})")
            self.recv_seq += 1
            out.append(pickle.loads(payload))
            pos = end
        if pos:
            del buf[:pos]
        return out

    def recv_blocking(self, timeout: float):
        """Wait for the next message (handshakes only); later ones that arrived with it stay
        for messages()."""
        self.sock.settimeout(timeout)
        try:
            while True:
                msgs = self.messages()
                if msgs:
                    self._pending = msgs[1:]
                    return msgs[0]
                if not self.feed():
                    raise ConnectionError(f"connection to {self._peer()} closed during handshake")
        finally:
            self.sock.settimeout(None)

    def _peer(self) -> str:
        return peer_name(self.sock)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
