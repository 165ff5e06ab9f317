"""The JAX side of the op layer: jax.Arrays to engine buffers and back, and host callbacks.

Executing eagerly, a collective hands the array's buffer to the op layer (`common/ops.py`) over
DLPack, no copy, and waits, as hvdlite.tensorflow does with eager tensors (its bridge.py). Inside
`jax.jit` (or any other trace: `jax.grad`, `lax.cond`) the same Python runs as an ordered
`io_callback`: XLA calls it each time the compiled function runs, on the host, with the concrete
arrays.

Why `io_callback(ordered=True)` and not `pure_callback`: a pure callback may be dropped when
its result is unused, run twice, or moved past another one, and every rank must submit its
collectives (or at least their names) alike; ordered callbacks run exactly once each, in program
order, across every compiled function of the process.

Names are fixed at trace time: the caller's name, or for an unnamed call its line
(`jax.allreduce.noname@train.py:42`), the same on every rank (every rank traces the same code)
and on every run, so the response cache serves them. Two calls from one line in one trace run
one after the other (ordered), so they can share the name.

An error raised inside a callback (a mismatch on another rank, a dead peer) reaches the caller
as `jax.errors.JaxRuntimeError` carrying hvdlite's message; the exception itself is kept
(`callback_error`) so that `hvdlite.jax.elastic.run` can raise it as it was, a
HorovodInternalError that rolls the state back.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import io_callback

from ..common import naming as _naming
from ..common import ops as _cops
from ..common.process_sets import global_process_set

# The engine's buffers are torch tensors (common/ops.py): a jax.Array on the host crosses over
# DLPack both ways without a copy.


def to_buffer(x) -> torch.Tensor:
    """A torch tensor over a host array's memory (DLPack: no copy where the layout allows)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)) if x.flags.writeable else \
            torch.from_numpy(np.array(x))
    try:
        if x.devices() and next(iter(x.devices())).platform != "cpu":
            x = jax.device_put(x, jax.devices("cpu")[0])
        return torch.from_dlpack(x)
    except Exception:    # a dtype or layout DLPack refuses: copy through NumPy
        arr = np.array(x)
        if arr.dtype == jnp.bfloat16:
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)


def from_buffer(t: torch.Tensor) -> jax.Array:
    """A jax.Array over an engine buffer's memory (DLPack: no copy where the layout allows)."""
    t = t.contiguous()
    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.view(torch.int16).numpy().view(jnp.bfloat16))
        return jnp.asarray(t.numpy())


def to_host(t: torch.Tensor) -> np.ndarray:
    """An engine buffer as a NumPy array (a callback's result: XLA copies it into its own)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


# ---------------------------------------------------------------------- tracing
def traced(xs: Sequence[Any]) -> bool:
    """Whether any of `xs` is a tracer: the call is being traced (jit, grad, cond), so it has to
    run as a host callback."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


_last_error: list = [None]


def callback_error() -> Optional[BaseException]:
    """The exception the last failed host callback raised (None if none failed)."""
    return _last_error[0]


def _guarded(fn: Callable[..., list]) -> Callable[..., list]:
    def run(*xs):
        try:
            return [to_host(r) for r in fn(*[to_buffer(x) for x in xs])]
        except BaseException as exc:
            _last_error[0] = exc
            raise
    return run


def host_call(fn: Callable[..., list], xs: Sequence[Any], results: Sequence[jax.ShapeDtypeStruct],
              check: Optional[Callable[[Sequence[Any]], None]] = None) -> list:
    """Run `fn(*buffers) -> list of buffers` on `xs`: now (concrete arrays, no copy) or, while
    tracing, as an ordered host callback that XLA runs every time the compiled code runs.
    `results` are the outputs' shapes and dtypes (static, as JAX needs them). `check(arrays)`
    runs first, where the call runs (so an error it reports reaches the other ranks then)."""
    if not traced(xs):
        if check is not None:
            check(xs)
        return [from_buffer(r) for r in fn(*[to_buffer(x) for x in xs])]

    def run(*bufs):
        return fn(*bufs)

    def checked(*arrays):
        if check is not None:
            check(arrays)
        return _guarded(run)(*arrays)

    out = io_callback(checked, list(results), *xs, ordered=True)
    return list(out)


REDUCIBLE = _cops.REDUCIBLE
MOVABLE = REDUCIBLE | {"bool"}


def check_dtypes(kind: str, names: Sequence[str], set_id: int, reduce: bool,
                 group: Optional[str] = None) -> Callable[[Sequence[Any]], None]:
    """A `host_call` check: every array's dtype is one the collective `kind` carries, else a
    ValueError naming JAX's dtype, sent to the other ranks first (common.ops.refuse), so they
    fail at once instead of waiting for the stall shutdown."""
    def check(arrays) -> None:
        allowed = REDUCIBLE if reduce else MOVABLE
        for x in arrays:
            name = np.dtype(x.dtype).name
            if name not in allowed:
                exc = ValueError(f"{kind}: tensor type {name} is not supported"
                                 + (" for reductions" if reduce and name in MOVABLE else "")
                                 + f"; supported types: {', '.join(sorted(allowed))}")
                _last_error[0] = exc
                _cops.refuse(kind, list(names), exc, process_set=set_id, group=group)
    return check


def translated(exc: BaseException) -> Optional[BaseException]:
    """The hvdlite exception behind a JaxRuntimeError a failed host callback caused, or None."""
    err = callback_error()
    if err is not None and isinstance(exc, jax.errors.JaxRuntimeError) and \
            type(err).__name__ in str(exc):
        return err
    return None


# ---------------------------------------------------------------------- names
def set_id(process_set) -> int:
    return _cops.set_id(process_set if process_set is not None else global_process_set)


class wire_name:
    """`with wire_name(kind, name, set_id, tracing) as (wire, cacheable):` a collective's name
    on the wire. Eagerly an unnamed call is named by its line while it runs (claimed_site), as
    hvdlite.tensorflow's eager calls are; while tracing, by its line with no counter
    (`jax.<kind>.noname@file:line`): it must be the same every time the compiled code runs."""

    __slots__ = ("_claim", "_value")

    def __init__(self, kind: str, name: Optional[str], set_id: int, tracing: bool):
        self._claim = None
        if name is not None:
            self._value = (str(name), True)
        elif tracing:
            self._value = (_naming.site_name(f"jax.{kind}.noname"), True)
        else:
            self._claim = _naming.claimed_site(kind, set_id)
            claimed = self._claim.__enter__()
            self._value = (claimed, True) if claimed is not None else \
                (_naming.auto_name(kind, set_id), False)

    def __enter__(self) -> tuple[str, bool]:
        return self._value

    def __exit__(self, *exc) -> None:
        if self._claim is not None:
            self._claim.__exit__(*exc)


def member_names(wire: str, n: int) -> list:
    """The wire names of a grouped call's members."""
    return [f"{wire}.{i}" for i in range(n)]


def shape_dtype(x, shape=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape) if shape is None else tuple(shape), x.dtype)
