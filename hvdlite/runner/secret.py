"""Per-job secret: payloads that travel through the rendezvous store are signed with it.

The store listens on a TCP port that any local user (and, for multi-host jobs, the network) can
reach, and it holds pickles. Signing with a key that only reaches workers through their
environment (never a command line) keeps a stranger from making a worker or the driver unpickle
data it did not write. Horovod does the same with `_HOROVOD_SECRET_KEY`; hvdlite's engine reads
the same variable (`HVDLITE_SECRET`, hex) to sign its control messages.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_ENV = "HVDLITE_SECRET"
_DIGEST = hashlib.sha256
_MAC_LEN = _DIGEST().digest_size


def make_key() -> bytes:
    return secrets.token_bytes(32)


def sign(key: bytes, data: bytes) -> bytes:
    """`data` prefixed with its HMAC-SHA256."""
    return hmac.new(key, data, _DIGEST).digest() + data


def verify(key: bytes, blob: bytes) -> bytes:
    """The signed data, or ValueError when the signature does not match this job's key."""
    mac, data = blob[:_MAC_LEN], blob[_MAC_LEN:]
    if len(mac) != _MAC_LEN or not hmac.compare_digest(mac, hmac.new(key, data, _DIGEST).digest()):
        raise ValueError("payload in the rendezvous store is not signed with this job's secret")
    return data
