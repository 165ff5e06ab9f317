"""Flat buffers: tensors packed one after another into one buffer, and copied back out.

The executor's fusion buffer (collectives.py) and the shared-memory channel's slots
(backends/shm.py) both move many tensors through one flat region; the copies are made by
torch's multi-tensor calls, not a Python-level copy per tensor, which is what a step of
tens to hundreds of gradients costs most in Python otherwise."""
from __future__ import annotations

import torch

from .arith import scale_


def pack(buf: torch.Tensor, inputs: list, counts: list[int]) -> None:
    """Copy `inputs` (None: zeros) one after another into the flat `buf`.

    Why one call: a fused step holds tens to hundreds of gradients, and a Python-level slice and
    copy per tensor cost ~5 us each on top of the memcpy (0.5 ms per step for 100 tensors); one
    torch.cat into the buffer does the copies in C++. The loop stays for the cases cat cannot
    take: a joined rank's zeros, or inputs on another device than the buffer.
    """
    if inputs and _all_like(inputs, buf):
        torch.cat([t.reshape(-1) for t in inputs], out=buf)
        return
    offset = 0
    for src, n in zip(inputs, counts):
        part = buf[offset:offset + n]
        if src is None:
            part.zero_()
        else:
            part.copy_(src.reshape(-1))
        offset += n


def _all_like(tensors: list, buf: torch.Tensor) -> bool:
    """Whether every tensor is there, of `buf`'s dtype and on its device. (On the CPU by
    `is_cpu`: comparing .device objects builds two per tensor, twice the time for 100.)"""
    dtype = buf.dtype
    if buf.is_cpu:
        return all(t is not None and t.dtype is dtype and t.is_cpu for t in tensors)
    device = buf.device
    return all(t is not None and t.dtype is dtype and t.device == device for t in tensors)


def unpack(buf: torch.Tensor, outputs: list, counts: list[int], scale: float = 1.0) -> None:
    """Copy consecutive pieces of the flat `buf` into `outputs` (None: skipped), times `scale`.

    One multi-tensor copy (torch._foreach_copy_) rather than one Python-level copy per tensor,
    from views of `buf` shaped like the outputs that torch makes in one call (_pieces_like).
    A floating-point scale (Average's 1/size) is applied while copying, one pass over memory
    instead of two: scaling a 15 MB fused gradient in place first cost ~1 ms per step. Where the
    members are small (_FOREACH_SCALE_BYTES) they are scaled after the copy instead, in one
    multi-tensor call while they are still in the cache: 100 tensors of 16 bytes took 560 us
    one torch.mul at a time and 320 us so. Integer results are scaled in the buffer first
    (scale_ truncates as Horovod does).
    """
    if scale != 1.0 and not buf.is_floating_point():
        scale_(buf, scale)
        scale = 1.0
    dst = [o for o in outputs if o is not None]
    if not dst:
        return
    if len(dst) == len(outputs):
        src = _pieces_like(buf, dst)
    else:
        src = [p.view(o.shape) for p, o in zip(buf.split(counts), outputs) if o is not None]
    if scale != 1.0:
        # (On the CPU by is_cpu: comparing .device objects builds two per tensor, ~1 us each.)
        if (buf.is_cpu and all(d.is_cpu for d in dst)) or \
                all(d.device == p.device for d, p in zip(dst, src)):
            if buf.dtype in _FOREACH_SCALE_DTYPES and \
                    sum(counts) * buf.element_size() < _FOREACH_SCALE_BYTES * len(counts):
                torch._foreach_copy_(dst, src)
                torch._foreach_mul_(dst, scale)
            else:
                for d, p in zip(dst, src):
                    torch.mul(p, scale, out=d)
            return
        for d, p in zip(dst, src):
            if d.device == p.device:
                torch.mul(p, scale, out=d)
            else:
                # A GPU tensor staged through a host buffer: scaled on the host, then one
                # blocking copy. (A mul_ on the GPU would run on this thread's stream, not the
                # caller's, and could still be running when the handle completes.)
                d.copy_(torch.mul(p, scale))
        return
    torch._foreach_copy_(dst, src)


# Members smaller than this on average are scaled after their copy, in one call (unpack);
# not 16-bit floats, whose multi-tensor product rounded 1 in ~10 results of a 1/3 scale one
# unit differently from torch.mul's.
_FOREACH_SCALE_BYTES = 64 << 10
_FOREACH_SCALE_DTYPES = (torch.float32, torch.float64)


def _pieces_like(buf: torch.Tensor, like: list) -> list:
    """Consecutive views of the flat `buf`, each shaped like the tensor of `like` at its place.

    Why torch's own: it makes every view in one C++ call, where a Python split and a view per
    tensor cost ~3 us a member (100 tensors: 320 us against 150 to copy them all out). Any
    surplus at the end of `buf` is left alone, as with split."""
    if _unflatten is not None:
        return _unflatten(buf, like)
    out, at = [], 0
    for t in like:
        n = t.numel()
        out.append(buf[at:at + n].view(t.shape))
        at += n
    return out


# torch's flat-buffer helper behind DDP's and apex's buckets (torch._utils._unflatten_dense_
# tensors); the Python loop in _pieces_like stands in should a release drop it.
_unflatten = getattr(getattr(torch._C, "_nn", None), "unflatten_dense_tensors", None)
