"""Point-to-point messages between two ranks, on the engine.

The engine has collectives only, so a message from rank a to rank b is a collective on the
two-rank process set {a, b}, named after the message (direction, micro-batch, ...): messages pair
by name, never by arrival order, and a message nobody sends shows up in the stall inspector under
its name.

One message is one ALLGATHER on the pair: the sender contributes a self-describing byte buffer
(header + payload), the receiver an empty one, so the receiver does not need to know the shape,
dtype or even the number of tensors in advance. The header carries, for every tensor, its dtype,
shape and requires_grad flag, plus a checksum of the message name; the receiver rebuilds the
tensors as views of the received buffer and checks what it expected. Payloads above
`HVDLITE_P2P_INLINE_BYTES` (default 512 KiB) travel in a second, BROADCAST collective rooted at the
sender, whose size the receiver learns from the header: an allgather moves the buffer both ways, a
broadcast one way, which wins once transfer time dominates (measured on the 2-core dev machine:
the one-collective form is faster up to ~512 KiB, the broadcast from ~1 MiB).

    pairs = p2p.connect([(0, 1)])                    # collective: every rank, same list
    if rank == 0:
        p2p.send((x, y), dst=1, name="step3.acts").wait()
    else:
        x, y = p2p.recv(src=0, name="step3.acts")

A message may be a tensor, None, or a (possibly nested once) tuple/list of tensors and None.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Optional, Sequence

import torch

from .. import mpi_ops
from ...common import basics as _basics
from ...common import config
from . import _comm
from .groups import ensure_process_sets, find_process_set

_MAGIC = 0x6876646C70327030            # "hvdlp2p0"
_VERSION = 1
_ALIGN = 16                    # bytes; every tensor (and the payload) starts on this boundary

_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.complex64,
           torch.complex128]
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}

# Value kinds in the header.
_NONE, _TENSOR = -2, -1          # k >= 0: a tuple of k entries (tensors or None)
_TOP_TENSOR, _TOP_TUPLE, _TOP_LIST, _TOP_NONE = 0, 1, 2, 3


class P2PError(RuntimeError):
    """A message did not look like what the receiver expected (or was not a message)."""


def inline_limit() -> int:
    raw = config.raw("HVDLITE_P2P_INLINE_BYTES")
    if raw is None:
        return 512 * 1024
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"HVDLITE_P2P_INLINE_BYTES={raw!r} is not an integer") from None


def name_tag(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------- encoding
def _flatten(obj) -> tuple[int, list]:
    """(top kind, values) where each value is None, a tensor, or a tuple of tensors/None."""
    if obj is None:
        return _TOP_NONE, []
    if isinstance(obj, torch.Tensor):
        return _TOP_TENSOR, [obj]
    if isinstance(obj, (tuple, list)):
        values = []
        for i, v in enumerate(obj):
            if v is None or isinstance(v, torch.Tensor):
                values.append(v)
            elif isinstance(v, (tuple, list)):
                for j, w in enumerate(v):
                    if w is not None and not isinstance(w, torch.Tensor):
                        raise TypeError(f"message item {i}[{j}] is a {type(w).__name__}; "
                                        f"messages carry tensors (or None), in at most two "
                                        f"levels of tuples")
                values.append(tuple(v))
            else:
                raise TypeError(f"message item {i} is a {type(v).__name__}; messages carry "
                                f"tensors, None, or tuples of them")
        return (_TOP_TUPLE if isinstance(obj, tuple) else _TOP_LIST), values
    raise TypeError(f"a message is a tensor, None, or a tuple/list of them, not "
                    f"{type(obj).__name__}")


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def encode(obj, name: str) -> tuple[list[int], list[torch.Tensor], int]:
    """Header words, the tensors in payload order, and the payload size in bytes."""
    top, values = _flatten(obj)
    words = [_MAGIC, _VERSION, 0, name_tag(name), 0, top, len(values)]
    tensors: list[torch.Tensor] = []
    payload = 0

    def describe(t: Optional[torch.Tensor]) -> None:
        nonlocal payload
        if t is None:
            words.append(-1)
            return
        code = _CODES.get(t.dtype)
        if code is None:
            raise TypeError(f"dtype {t.dtype} cannot be sent (supported: "
                            f"{', '.join(str(d) for d in _DTYPES)})")
        words.extend([code, int(t.requires_grad), t.dim(), *t.shape])
        tensors.append(t)
        payload += _padded(_tensor_nbytes(t))

    for v in values:
        if v is None:
            words.append(_NONE)
        elif isinstance(v, torch.Tensor):
            words.append(_TENSOR)
            describe(v)
        else:
            words.append(len(v))
            for t in v:
                describe(t)
    if len(words) % 2:
        words.append(0)            # keep the payload 16-byte aligned
    words[2] = len(words)
    words[4] = payload
    return words, tensors, payload


def _write_payload(buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    off = 0
    for t in tensors:
        n = _tensor_nbytes(t)
        if n:
            src = t.detach()
            if not src.is_contiguous():
                src = src.contiguous()
            buf[off:off + n].copy_(src.reshape(-1).view(torch.uint8))
        off += _padded(n)


def _parse_header(buf: torch.Tensor, name: str, src: int) -> tuple[list[int], int]:
    if buf.dim() != 1 or buf.numel() < 7 * 8:
        raise P2PError(f"message {name!r} from rank {src}: {buf.numel()} bytes is too short to "
                       f"be a hvdlite message (was a plain allgather sent under this name?)")
    if buf.storage_offset() % _ALIGN:
        buf = buf.clone()
    head = buf[:7 * 8].view(torch.int64).tolist()
    if head[0] != _MAGIC or head[1] != _VERSION:
        raise P2PError(f"message {name!r} from rank {src} does not start with a hvdlite p2p "
                       f"header (version {_VERSION}); did another collective use this name?")
    n_words = head[2]
    words = buf[:n_words * 8].view(torch.int64).tolist()
    if words[3] != name_tag(name):
        raise P2PError(f"message {name!r} from rank {src} carries the header of another message "
                       f"(name checksum {words[3]} != {name_tag(name)})")
    return words, n_words * 8


def decode(words: list[int], payload: torch.Tensor, device=None):
    """Rebuild the message (tensors are views of `payload`, moved to `device` if given)."""
    top, n_values = words[5], words[6]
    pos = 7
    off = 0

    def tensor():
        nonlocal pos, off
        code = words[pos]
        if code == -1:
            pos += 1
            return None
        req, ndim = words[pos + 1], words[pos + 2]
        shape = words[pos + 3:pos + 3 + ndim]
        pos += 3 + ndim
        dtype = _DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        n = numel * torch.empty((), dtype=dtype).element_size()
        t = payload[off:off + n].view(dtype).view(shape) if n else \
            torch.empty(shape, dtype=dtype)
        off += _padded(n)
        if device is not None and t.device != torch.device(device):
            t = t.to(device)
        if req and (t.is_floating_point() or t.is_complex()):
            t = t.detach().requires_grad_(True)
        return t

    values = []
    for _ in range(n_values):
        kind = words[pos]
        pos += 1
        if kind == _NONE:
            values.append(None)
        elif kind == _TENSOR:
            values.append(tensor())
        else:
            values.append(tuple(tensor() for _ in range(kind)))
    if top == _TOP_NONE:
        return None
    if top == _TOP_TENSOR:
        return values[0]
    return tuple(values) if top == _TOP_TUPLE else values


# ---------------------------------------------------------------------- pair sets
def connect(pairs: Sequence[Sequence[int]]) -> dict:
    """Register a two-rank process set for every (a, b) pair of global ranks (reusing existing
    ones). A collective over the whole job when any is missing: call it on every rank with the
    same list. Returns {frozenset({a, b}): ProcessSet}."""
    norm = []
    size = _basics.size()
    for pair in pairs:
        a, b = (int(x) for x in pair)
        if a == b or not (0 <= a < size and 0 <= b < size):
            raise ValueError(f"p2p.connect: pair {tuple(pair)} must name two different ranks in "
                             f"0..{size - 1}")
        norm.append(sorted((a, b)))
    sets = ensure_process_sets(norm, "point-to-point messaging (p2p.connect)")
    return {frozenset(p): s for p, s in zip(norm, sets)}


def _pair_set(a: int, b: int):
    ps = find_process_set([a, b])
    if ps is None:
        raise ValueError(f"no process set for the rank pair ({min(a, b)}, {max(a, b)}); call "
                         f"hvdlite.torch.parallel.p2p.connect([({min(a, b)}, {max(a, b)})]) on "
                         f"every rank first")
    return ps


# ---------------------------------------------------------------------- send / recv
class SendHandle:
    """An outgoing message in flight; `wait()` returns once the receiver has it."""

    def __init__(self, name: str, dst: int, handles: list):
        self.name, self.dst = name, dst
        self._handles = handles

    def done(self) -> bool:
        return all(mpi_ops.poll(h) for h in self._handles)

    def wait(self) -> None:
        for h in self._handles:
            mpi_ops.synchronize(h)
        self._handles = []


def send(obj, dst: int, name: str, *, process_set=None) -> SendHandle:
    """Start sending `obj` to global rank `dst` under `name` (returns at once; the bytes are
    copied, so `obj` may change afterwards). `name` must be unique among this pair's messages in
    flight."""
    me = _basics.rank()
    ps = process_set if process_set is not None else _pair_set(me, dst)
    words, tensors, payload = encode(obj, name)
    hdr = len(words) * 8
    inline = payload <= inline_limit()
    buf = torch.empty(hdr + (payload if inline else 0), dtype=torch.uint8)
    buf[:hdr].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
    # Inline or not is derived from the sizes on the receiving side: no flag needed.
    handles = []
    if inline:
        _write_payload(buf[hdr:], tensors)
        handles.append(mpi_ops.allgather_async(buf, name=name, process_set=ps))
    else:
        data = torch.empty(payload, dtype=torch.uint8)
        _write_payload(data, tensors)
        handles.append(mpi_ops.allgather_async(buf, name=name, process_set=ps))
        handles.append(mpi_ops.broadcast_async(data, root_rank=me, name=f"{name}.payload",
                                               process_set=ps))
    return SendHandle(name, dst, handles)


class RecvHandle:
    """An incoming message; `wait()` returns it."""

    def __init__(self, name: str, src: int, ps, handle: int, device=None):
        self.name, self.src, self.ps, self.device = name, src, ps, device
        self._handle = handle
        self._result: Any = None
        self._done = False

    def ready(self) -> bool:
        return self._done or mpi_ops.poll(self._handle)

    def wait(self, timeout: Optional[float] = None, warn_after: Optional[float] = None,
             on_warn: Optional[Callable[[float], None]] = None,
             on_timeout: Optional[Callable[[float], Exception]] = None):
        if self._done:
            return self._result
        buf = _comm.wait_handle(self._handle, timeout=timeout, warn_after=warn_after,
                                on_warn=on_warn, on_timeout=on_timeout)
        words, hdr = _parse_header(buf, self.name, self.src)
        payload_bytes = words[4]
        if hdr + payload_bytes == buf.numel():
            payload = buf[hdr:]
        elif hdr == buf.numel():
            h = mpi_ops.broadcast_async(torch.empty(payload_bytes, dtype=torch.uint8),
                                        root_rank=self.src, name=f"{self.name}.payload",
                                        process_set=self.ps)
            payload = _comm.wait_handle(h, timeout=timeout, warn_after=warn_after,
                                        on_warn=on_warn, on_timeout=on_timeout)
        else:
            raise P2PError(f"message {self.name!r} from rank {self.src}: {buf.numel()} bytes for "
                           f"a {hdr}-byte header and a {payload_bytes}-byte payload")
        self._result = decode(words, payload, self.device)
        self._done = True
        self._handle = None
        return self._result


def irecv(src: int, name: str, *, process_set=None, device=None) -> RecvHandle:
    """Post a receive for message `name` from global rank `src` (returns at once)."""
    me = _basics.rank()
    ps = process_set if process_set is not None else _pair_set(me, src)
    h = mpi_ops.allgather_async(torch.empty(0, dtype=torch.uint8), name=name, process_set=ps)
    return RecvHandle(name, src, ps, h, device)


def recv(src: int, name: str, *, process_set=None, device=None,
         timeout: Optional[float] = None):
    """Receive message `name` from global rank `src`; tensors come back with the sender's dtype,
    shape and requires_grad (as leaves). Raises TimeoutError after `timeout` seconds if given."""
    return irecv(src, name, process_set=process_set, device=device).wait(timeout=timeout)


__all__ = ["connect", "send", "recv", "irecv", "SendHandle", "RecvHandle", "P2PError",
           "encode", "decode"]
