"""The arithmetic every data path must do alike: scale factors, and sums in rank order.

Why one module: the executor (collectives.py), the shared-memory channel (backends/shm.py),
which reduces in its segment and copies results straight out of it, and the steady state's
rounds that carry a small tensor (steady.py, shm.ShmAgreement) all compute results that must
be bit-identical on every rank and whichever path carried a tensor: integers truncate as
Horovod does, and the ranks' contributions are added in rank order.

torch is imported only where a factor is applied: steady.py sums numpy payloads with
reduce_in_order and, like the control-plane benchmark that drives it, loads no framework."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


# Below torch's parallel grain size (at::internal::GRAIN_SIZE, 32768 elements) a CPU tensor's
# multiply runs on one thread in torch as in NumPy, and NumPy's ufunc on the same memory is the
# cheaper call: ~2.5 us against mul_'s ~6-8 us in a loop on this 2-core machine, and 10-18 us
# against 18-23 us timed inside an averaged 4 KiB allreduce on 2 MPI ranks (the average's
# 1/size, hvd.allreduce's default op). Both multiply float32 by the factor rounded to float32
# (NumPy's rule for a Python scalar), or float64 by the factor, so the bits are torch's. The
# tensor's version counter is bumped as mul_ would bump it, so autograd still refuses a saved
# tensor that was changed in place.
NUMPY_SCALE_MAX = 32768
_NUMPY_DTYPES = None
_BUMP = None


def scale_(t: torch.Tensor, factor: float) -> None:
    """In-place multiply that also works for integer tensors (truncating, as Horovod does)."""
    if factor == 1.0:
        return
    if t.is_cpu and t.numel() <= NUMPY_SCALE_MAX and t.dtype in _numpy_dtypes() \
            and t.is_contiguous() and not t.requires_grad:
        a = t.numpy()
        a *= factor
        _BUMP(t)
    elif t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_((t.double() * factor).to(t.dtype))


def _numpy_dtypes() -> tuple:
    global _NUMPY_DTYPES, _BUMP
    if _NUMPY_DTYPES is None:
        import torch
        from torch.autograd.graph import increment_version as _BUMP
        _NUMPY_DTYPES = (torch.float32, torch.float64)
    return _NUMPY_DTYPES


def copy_scaled(dst: torch.Tensor, src: torch.Tensor, factor: float) -> None:
    """dst = src * factor, in one pass for floats; `src` is never written (it may be memory
    that other ranks still read)."""
    if factor == 1.0:
        dst.copy_(src)
    elif dst.is_floating_point():
        import torch
        torch.mul(src, factor, out=dst)
    else:
        dst.copy_(src)
        scale_(dst, factor)


def reduce_in_order(fn: Callable, parts: Sequence, out):
    """out = fn(...fn(fn(parts[0], parts[1]), parts[2])..., parts[-1]), in place in `out`, and
    returned: the ranks' contributions (two or more) combined in rank order. Floating-point
    addition is not associative, so every path that reduces the same values must fold them in
    this one order to give every rank the same bits. `fn` is an elementwise function with an
    `out=` argument (torch.add, torch.minimum, numpy.add...)."""
    fn(parts[0], parts[1], out=out)
    for p in parts[2:]:
        fn(out, p, out=out)
    return out
