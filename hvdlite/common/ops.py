"""The op layer: every collective of every frontend enters the engine here, and only here.

    frontend (torch / TF / add-ons)  --buffers, names, op, scales, process_set, group-->  ops
    ops  --Request + Entry-->  engine.enqueue  -->  public Handle (wait(timeout), done, test)

A *buffer* is what the engine moves: a torch tensor on any device (TensorFlow tensors arrive
over DLPack). Frontends convert tensors to buffers and back, and wrap optimizers; dtype names,
argument checks, call-site naming, grouping, cache flags, join/barrier counters and the object
helpers live here once, so every frontend behaves the same. The engine's `Request` and `Entry`
never leave `common/`.
"""
from __future__ import annotations

import io
import threading
import time
from typing import Any, Callable, NoReturn, Optional, Sequence, Union

import torch

from . import adasum as _adasum
from . import basics as _basics
from . import naming
from . import validation as _validation
from .collectives import DTYPE_NAMES, host_buffer
from .engine import Entry, Finished
from .exceptions import HorovodInternalError, NotInitializedError
from .messages import (ADASUM, ADD_PROCESS_SET, ALLGATHER, ALLREDUCE, ALLTOALL, AVERAGE, BARRIER,
                       BROADCAST, JOIN, MAX, MIN, PRODUCT, REDUCESCATTER, REMOVE_PROCESS_SET,
                       SUM, Request)
from .process_sets import ProcessSet

Buffer = torch.Tensor
Names = Union[str, Sequence[str], None]
# A process set as callers pass it: the object, its registered id, or None (the global set).
SetArg = Union[ProcessSet, int, None]

REDUCE_OPS = (AVERAGE, SUM, MIN, MAX, PRODUCT)
REDUCIBLE = frozenset({"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                       "float32", "float64"})


# ---------------------------------------------------------------------- the public handle
class Handle:
    """One submitted collective (one or more buffers), mpi4py-request style.

    `wait(timeout=None)` returns the result (raising HorovodInternalError on failure, and
    TimeoutError, leaving the handle usable, when `timeout` seconds pass first); `test()` returns
    `(done, result_or_None)` without blocking; `done()` says whether `wait` would block;
    `add_done_callback(fn)` calls `fn(handle)` once it completes (on an engine thread, or on
    the caller's thread where the collective ran there: a synchronous MPI call); `fn` must not
    wait for another collective."""

    __slots__ = ("_inner", "_post", "_alive", "_result", "_error", "_waited", "_lock", "_pace")

    def __init__(self, inner: Any, post: Callable[[list[Any]], Any],
                 alive: Optional[Callable[[], bool]], pace: Any = None) -> None:
        self._inner = inner
        self._post = post
        self._alive = alive
        self._pace = pace           # the engine's straggler.Pace, when the report is on
        self._waited = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._waited or self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        with self._lock:
            if not self._waited:
                try:
                    results = self._inner.wait(self._alive, timeout)
                except TimeoutError:
                    raise
                except BaseException as exc:
                    self._error, self._waited = exc, True
                else:
                    self._result, self._waited = self._post(results), True
                    if self._pace is not None:
                        self._pace.done(time.monotonic())
        if self._error is not None:
            raise self._error
        return self._result

    def test(self) -> tuple[bool, Any]:
        if not self.done():
            return False, None
        return True, self.wait()

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        self._inner.add_callback(lambda: fn(self))

    def __repr__(self) -> str:
        return f"<hvdlite Handle {self._inner.names()} done={self.done()}>"


def _first(results: list[Any]) -> Any:
    return results[0]


def _state() -> Any:  # basics._State, whose engine is set once init() is done
    # The module attribute, not basics' accessors: a collective's path stays in this file.
    state = _basics._state
    if state is None:
        raise NotInitializedError(_basics.NOT_INITIALIZED)
    return state


def _submit(entries: list[Entry], post: Callable[[list[Any]], Any] = list,
            blocking: bool = False) -> Handle:
    engine = _state().engine
    if engine.pace is not None:
        engine.pace.submitted(time.monotonic())
    inner = engine.enqueue(entries, blocking)
    return Handle(inner, post, engine.alive, engine.pace)


# ---------------------------------------------------------------------- checks and naming
def set_id(process_set: Union[ProcessSet, int, None]) -> int:
    """The registered id of `process_set` (None: the global set; an int: already an id)."""
    if isinstance(process_set, int):
        return process_set
    if process_set is None:
        return 0
    sid = process_set.process_set_id
    if sid is None:
        raise ValueError(f"{process_set} is not registered: pass it to init(process_sets=...) or "
                         f"add_process_set() first")
    return sid


def set_ranks(process_set: Union[ProcessSet, int, None]) -> list[int]:
    """The global ranks of a registered process set (before init NotInitializedError, the
    error every collective raises then)."""
    _state()
    return _basics._set_ranks(set_id(process_set))


def dtype_name(buffer: Buffer, reduce: bool = False) -> str:
    """The engine's name for a buffer's dtype; ValueError (Horovod's message) if unsupported,
    or if the buffer is not dense (a sparse tensor: its layout holds no flat data to move)."""
    if buffer.layout is not torch.strided:
        raise ValueError(f"Tensor layout {str(buffer.layout).replace('torch.', '')} is not "
                         f"supported: collectives take dense tensors. For a sparse gradient "
                         f"use sparse_allreduce_async, or DistributedOptimizer(..., "
                         f"sparse_as_dense=True); else pass tensor.to_dense().")
    name = DTYPE_NAMES.get(buffer.dtype)
    if name is None or (reduce and name not in REDUCIBLE):
        raise ValueError(f"Tensor type {buffer.type()} is not supported"
                         + (" for reductions." if name is not None else "."))
    return name


def check_reduce_op(op: Any, process_set: SetArg = None, buffers: Sequence[Buffer] = (),
                    what: str = "allreduce") -> None:
    """Horovod's op checks; Adasum only for allreduce, with Horovod's conditions: the global
    process set, a power-of-two number of ranks, CPU floating-point buffers."""
    if op == ADASUM and what == "allreduce":
        if set_id(process_set) != 0:
            raise NotImplementedError(_adasum.NON_GLOBAL_SET)
        if not _adasum.is_power_of_two(_basics.size()):
            raise NotImplementedError(_adasum.NON_POWER_OF_TWO)
        for t in buffers:
            if t.device.type != "cpu":
                raise NotImplementedError(_adasum.GPU_TENSOR)
            if not t.is_floating_point():
                raise ValueError(f"op=Adasum needs floating-point tensors (float16, bfloat16, "
                                 f"float32 or float64); got {t.dtype}.")
        return
    if op == ADASUM and what == "reducescatter":
        # Horovod's enqueue returns Aborted ("Reducescatter currently only supports AVERAGE
        # and SUM."), a RuntimeError that its frontend re-raises as HorovodInternalError.
        raise HorovodInternalError("reducescatter does not support op=Adasum; use Average, "
                                   "Sum, Min, Max or Product")
    if op not in REDUCE_OPS:
        if what == "allreduce":
            raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or "
                             f"Product")
        raise ValueError(f"{what} supports op Average, Sum, Min, Max or Product")


def check_rank(buffer: Buffer, what: str) -> None:
    """Collectives that split or concatenate along dimension 0 need one."""
    if buffer.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension")


def resolve_names(kind: str, names: Names, n: int, sid: int, group: Any) -> tuple[list[str], str]:
    """(one wire name per buffer, base name). None: named by call site (`naming.auto_name`);
    a string: used as is for one ungrouped buffer, else as the base of `base.i`; a list: as
    given."""
    if names is None or isinstance(names, str):
        base = naming.auto_name(kind, sid) if names is None else names
        if n == 1 and not group:
            return [base], base
        return [f"{base}.{i}" for i in range(n)], base
    names = [str(x) for x in names]
    if len(names) != n:
        raise ValueError(f"{kind}: {n} tensors but {len(names)} names")
    return names, names[0] if n else kind


def _group(group: Any, base: str, n: int) -> tuple[Optional[str], int]:
    if not group or n <= 1:
        return None, 0
    return (base if group is True else str(group)), n


def _requests(kind: str, buffers: Sequence[Buffer], names: Names, process_set: SetArg,
              group: Any, cacheable: Optional[bool], reduce: bool = False,
              **kw: Any) -> list[Request]:
    """The requests of a `kind` call ("allreduce", ..., _KIND_TYPES); an argument error that
    a buffer's checks find (an unsupported dtype, a sparse tensor) is refused (refuse)."""
    rtype = _KIND_TYPES[kind]
    sid = set_id(process_set)
    n = len(buffers)
    wire, base = resolve_names(kind, names, n, sid, group)
    gname, gsize = _group(group, base, n)
    cache = (names is not None) if cacheable is None else bool(cacheable)
    me = _state().rank
    try:
        return [_request(me, nm, rtype, b, sid, reduce, cacheable=cache, group=gname,
                         group_size=gsize, **kw)
                for b, nm in zip(buffers, wire)]
    except ValueError as exc:
        refuse(kind, wire, exc, process_set=sid, group=gname)


def _empty_group(kind: str, names: Names, process_set: SetArg, group: Any, **kw: Any) -> Handle:
    """A grouped call of no tensors (a model with no parameters on this rank, one not built
    yet): this rank's part goes out as one request, `<group>.empty`, that stands for the
    group and says it has no members (group_size 0, an empty placeholder: nothing is moved).
    Result: an empty list.

    Why: the call used to return at once, and ranks that passed tensors under the same group
    waited for this one until the stall shutdown (600 s by default), whose report then named
    this rank as hung. Now the coordinator sees the group's sizes differ once every rank's
    part has arrived and fails the call on every rank with both counts
    (controller.Coordinator._note_group); where every rank passes none, the placeholders
    match and the call completes."""
    sid = set_id(process_set)
    _, base = resolve_names(kind, names, 0, sid, group)
    gname = base if group is True else str(group)
    req = Request(rank=_state().rank, name=f"{gname}.empty", type=_KIND_TYPES[kind],
                  dtype="uint8", shape=(0,), process_set_id=sid, cacheable=False, group=gname,
                  group_size=0, **kw)
    placeholder = torch.empty(0, dtype=torch.uint8)
    output = placeholder if kind in ("allreduce", "broadcast") else None   # (others allocate)
    return _submit([Entry(req, placeholder, output)], lambda res: [])


def _refuse_call(kind: str, buffers: Sequence[Buffer], names: Names, process_set: SetArg,
                 group: Any, exc: Exception) -> None:
    """Raise `exc`, an argument error found before a call's requests exist (an op the
    collective does not take, a scalar where a dimension is needed, bad alltoall splits),
    once the other ranks were told about every name the call would have used (refuse)."""
    if _basics._state is None:
        raise exc
    sid = set_id(process_set)
    wire, base = resolve_names(kind, names, len(buffers), sid, group)
    refuse(kind, wire, exc, process_set=sid, group=_group(group, base, len(buffers))[0])


_KIND_TYPES = {"allreduce": ALLREDUCE, "allgather": ALLGATHER, "broadcast": BROADCAST,
               "reducescatter": REDUCESCATTER, "alltoall": ALLTOALL}


def refuse(kind: str, names: Sequence[str], exc: Exception, *, process_set: SetArg = None,
           group: Optional[str] = None) -> NoReturn:
    """Raise `exc`, this rank's argument error for the collective `kind` ("allreduce",
    "allgather", "broadcast", "reducescatter" or "alltoall") whose wire names are `names`, as
    Horovod's enqueue does, but tell the other ranks first. The one place every argument
    error of a collective goes through: this layer's own (an unsupported dtype, bad alltoall
    splits, an op the collective does not take) and a frontend's, found before its tensors
    became buffers (a TensorFlow string tensor, a scalar where a dimension is needed).

    Why: the other ranks have submitted, or will submit, the same names, and waited for them
    until the stall shutdown (600 s by default), whose report then named this rank as hung.
    Each name goes out as a request that carries only the error (`invalid`, with an empty
    placeholder: nothing is moved); the coordinator turns it into an error that names the
    tensor, this rank and `exc` on every rank (negotiation.construct_response). `group`: the
    call's group name when it is grouped, so that its members are refused together and none
    waits for the others. Waited for, so that the names are free again when `exc` comes out.
    Before init there is nobody to tell: `exc` as it is."""
    if _basics._state is None:
        raise exc
    rtype = _KIND_TYPES[kind]
    sid = set_id(process_set)
    names = [str(n) for n in names]
    gname, gsize = (str(group), len(names)) if group and len(names) > 1 else (None, 0)
    me = _state().rank
    placeholder = torch.empty(0, dtype=torch.uint8)
    try:
        _submit([Entry(Request(rank=me, name=nm, type=rtype, dtype="uint8", shape=(0,),
                               process_set_id=sid, invalid=str(exc), cacheable=False,
                               group=gname, group_size=gsize), placeholder)
                 for nm in names]).wait()
    except Exception:
        pass
    raise exc


def _request(me: int, name: str, rtype: int, b: Buffer, sid: int, reduce: bool,
             **kw: Any) -> Request:
    """One buffer's request: what every rank validates against the others'."""
    return Request(rank=me, name=name, type=rtype, dtype=dtype_name(b, reduce),
                   shape=tuple(b.shape), device=b.get_device() if b.is_cuda else -1,
                   process_set_id=sid, **kw)


def blocking_name(kind: str, name: Optional[str],
                  process_set: SetArg = None) -> naming.blocking_name:
    """`with ops.blocking_name(kind, name, process_set) as name:` around a frontend's blocking
    collective (its public function, before autograd): `name` as given, or for an unnamed call
    its line, so the response cache and the steady state serve it (naming.blocking_name)."""
    return naming.blocking_name(kind, name, set_id(process_set))


def output_like(b: Buffer) -> Buffer:
    """A contiguous output buffer shaped like `b`; for a buffer with no dense layout (a sparse
    tensor) an empty placeholder, since the call is refused before it is used (dtype_name)."""
    try:
        return torch.empty_like(b, memory_format=torch.contiguous_format)
    except RuntimeError:
        return torch.empty(0, dtype=b.dtype)


def _contiguous(b: Buffer) -> Buffer:
    # Detached so the engine's threads never record autograd history (nor trip over a view
    # of a leaf that needs gradients); a tensor that has none is used as it is (detach() is
    # ~0.35 us, a noticeable part of a small collective's cost).
    if b.requires_grad or b._is_view():
        b = b.detach()
    return b if b.is_contiguous() else b.contiguous()


# ---------------------------------------------------------------------- collectives
def allreduce(buffers: Sequence[Buffer], *, names: Names = None, op: int = AVERAGE,
              prescale: float = 1.0, postscale: float = 1.0, process_set: SetArg = None,
              group: Any = None, outputs: Optional[Sequence[Buffer]] = None,
              cacheable: Optional[bool] = None, blocking: bool = False) -> Handle:
    """Reduce each buffer over the set; `outputs` (default: new buffers) receive the results.
    `group` (True or a group name) releases and fuses the buffers together. Result: list.
    `blocking`: the caller waits on the handle at once (a synchronous grouped call): several
    small cached float32 buffers may then run from start to end on this thread
    (engine.Engine.express_many), and otherwise, where the caller runs its set's round
    itself, it polls it as long as the express lane does (engine.Engine.enqueue); the result
    is the same either way."""
    buffers = list(buffers)
    if not buffers and group:
        return _empty_group("allreduce", names, process_set, group, reduce_op=SUM)
    try:
        check_reduce_op(op, process_set, buffers, "allreduce")
    except (ValueError, NotImplementedError, HorovodInternalError) as exc:
        _refuse_call("allreduce", buffers, names, process_set, group, exc)
    if not group and cacheable is not False and op in REDUCE_OPS and (
            (isinstance(names, str) and len(buffers) == 1)
            or (isinstance(names, (list, tuple)) and len(names) == len(buffers))):
        # Named and ungrouped (an optimizer's gradients, a metric): each buffer's request is
        # the one its name had last time when nothing differs (_allreduce_request).
        state, sid = _state(), set_id(process_set)
        if isinstance(names, str):
            names = (names,)
        try:
            reqs = [_allreduce_request(state, sid, str(nm), b, op, prescale, postscale)
                    for nm, b in zip(names, buffers)]
        except ValueError as exc:
            refuse("allreduce", names, exc, process_set=sid)
    elif group and len(buffers) > 1 and cacheable is not False and op in REDUCE_OPS and (
            isinstance(names, str)
            or (isinstance(names, (list, tuple)) and len(names) == len(buffers))):
        # A named grouped call (metrics, TensorFlow's SyncBatchNormalization statistics): its
        # members' requests are the ones they had last time when nothing differs.
        reqs = _grouped_requests(_state(), set_id(process_set), names, group, buffers, op,
                                 prescale, postscale)
    else:
        reqs = _requests("allreduce", buffers, names, process_set, group, cacheable,
                         reduce=True, reduce_op=op, prescale=float(prescale),
                         postscale=float(postscale))
    if outputs is None:
        outputs = [output_like(b) for b in buffers]
    entries = [Entry(r, _contiguous(b), o) for r, b, o in zip(reqs, buffers, outputs)]
    engine = _state().engine
    if len(entries) == 1 and len(engine.set_ranks.get(reqs[0].process_set_id, ())) == 1:
        # A one-member set's cached allreduce finishes on this thread (engine.Engine.express),
        # without the queue and the handle's locks.
        done = engine.express(entries[0], blocking=False)
        if done is not None:                 # a Finished handle, or the general path's
            return Handle(done, list, engine.alive)
    elif blocking and len(entries) > 1:
        pace = engine.pace
        if pace is not None:
            pace.submitted(time.monotonic())
        done = engine.express_many(entries)
        if done is True:                     # finished here; the names are free already
            return Handle(Finished(entries, None), list, engine.alive, pace)
        if done is not None:                 # the general path's handle
            return Handle(done, list, engine.alive, pace)
    return _submit(entries, blocking=blocking)


def whole_pass() -> bool:
    """Whether this rank sends a training step's CPU gradients as one bucket, once the step
    has submitted them all (buckets.whole_pass_on_host: a host with no core to spare per rank).

    Why a frontend asks: there, a gradient submitted from its autograd hook waits for the last
    one anyway, so a frontend may as well submit them together when backpropagation ends, in
    one call, rather than run a submission's Python once per gradient in the middle of it
    (torch/optimizer.py says what that cost)."""
    return _state().engine.whole_pass


def fuses_in_place(process_set: SetArg = None) -> bool:
    """Whether this rank's transport for the set fuses CPU allreduces of every size with no
    fusion buffer (through shared memory: gloo's channel on one host, or MPI's where ranks
    outnumber cores; not MPI's large collectives alone, backends/shm.ShmRouted), so gradients
    kept in one flat buffer (torch/flat_grads.py) would only add a copy to a step. False
    before the set's first collective has made its communicator.

    Why a frontend asks: elsewhere (MPI on one core per rank, gloo over TCP) a fused step's
    gradients are copied into a fusion buffer and back, or reduced with one call each, and one
    flat buffer spares that; through shared memory the CNN of benchmarks/train_step.py measured
    a loss from it (2 gloo ranks, three alternating runs: 28.2-28.4 ms a step against
    26.4-27.6), the hooks' copies into the buffer costing more than the fusion saved."""
    comm = _state().engine.comms.get((set_id(process_set), "cpu"))
    return comm is not None and comm.fuses_in_place


def allreduce_now(buffer: Buffer, output: Buffer, *, name: Optional[str] = None,
                  op: int = AVERAGE, prescale: float = 1.0, postscale: float = 1.0,
                  process_set: SetArg = None) -> Buffer:
    """Reduce one buffer over the set into `output` and return it, blocking: the frontends'
    synchronous calls (`allreduce_`, and `allreduce` when nothing records a gradient).

    Why a call of its own: a caller that blocks needs no handle, and a named buffer whose
    cache bit the set's steady state knows can run from start to end on this thread
    (engine.Engine.express), which skips most of the per-call Python of a submission. Anything
    else (no name, a first sight, a changed signature, something else in flight, Adasum, a
    GPU buffer, a timeline) is exactly `allreduce([buffer], ...).wait()[0]`, with every check
    and error message of that path. Without a name, the call is named by its line, the same
    every time (naming.claimed_site), so it is cached like a named one."""
    sid = set_id(process_set)
    if name is None:            # (the context manager stays off the named calls' hot path)
        with naming.claimed_site("allreduce", sid) as claimed:
            return _allreduce_now(buffer, output, claimed, op, prescale, postscale,
                                  process_set, sid)
    return _allreduce_now(buffer, output, name, op, prescale, postscale, process_set, sid)


# How many named allreduce requests _allreduce_request keeps for reuse (names that change
# every call would otherwise pile up).
_REQUESTS_KEPT = 1024


def _allreduce_request(state: _basics._State, sid: int, name: str, buffer: Buffer, op: int,
                       prescale: float, postscale: float) -> Request:
    """The request of a named, ungrouped, cacheable allreduce of `buffer` (`op` one of
    REDUCE_OPS), reused from the last call under the same name when its signature is the same.

    Why: a request is built per call and nothing changes it once made, but building one
    (naming, dtype and shape checks, the dataclass) cost ~3.6 us here, a quarter of an
    asynchronous submission's Python and a tenth of a small MPI allreduce on the express lane.
    A step's gradients and a loop's metrics repeat the same names with the same signatures, so
    the steady state's calls find theirs. Anything that differs (op, scaling, shape, dtype, a
    GPU buffer) builds a new one, with every check of the general path."""
    key = (sid, name)
    req = state.requests.get(key)
    if req is None or not _request_fits(req, buffer, op, prescale, postscale):
        req = _request(state.rank, name, ALLREDUCE, buffer, sid, True,
                       reduce_op=op, prescale=float(prescale), postscale=float(postscale))
        if len(state.requests) >= _REQUESTS_KEPT:
            state.requests.clear()
        state.requests[key] = req
    return req


def _request_fits(req: Request, buffer: Buffer, op: int, prescale: float,
                  postscale: float) -> bool:
    """Whether a kept allreduce request still describes `buffer` reduced by `op` with these
    scale factors (a CPU buffer of the request's shape and dtype)."""
    return (req.reduce_op == op and req.prescale == prescale and req.postscale == postscale
            and not buffer.is_cuda and req.device < 0 and req.shape == buffer.shape
            and req.dtype == DTYPE_NAMES.get(buffer.dtype))


def _grouped_requests(state: _basics._State, sid: int, names: Union[str, Sequence[str]],
                      group: Any, buffers: list[Buffer], op: int, prescale: float,
                      postscale: float) -> list[Request]:
    """The requests of a named, cacheable grouped allreduce (`op` one of REDUCE_OPS), reused
    from the last call with the same names and group while every member's signature is the
    same, as _allreduce_request does for one buffer.

    Why: building a group's requests (naming, the group's name, dtype and shape checks, a
    dataclass per member) cost ~4 us of a blocking grouped call of two metrics that takes
    ~40 us on 2 MPI ranks. Anything that differs builds them anew, with every check."""
    key = (sid, "group", names if isinstance(names, str) else tuple(names), group)
    reqs = state.requests.get(key)
    if reqs is None or len(reqs) != len(buffers) or not all(
            _request_fits(req, b, op, prescale, postscale) for req, b in zip(reqs, buffers)):
        reqs = _requests("allreduce", buffers, names, sid, group, None,
                         reduce=True, reduce_op=op, prescale=float(prescale),
                         postscale=float(postscale))
        if len(state.requests) >= _REQUESTS_KEPT:
            state.requests.clear()
        state.requests[key] = reqs
    return reqs


def _allreduce_now(buffer: Buffer, output: Buffer, name: Optional[str], op: int,
                   prescale: float, postscale: float, process_set: SetArg, sid: int) -> Buffer:
    if isinstance(name, str) and op in REDUCE_OPS:
        state = _state()
        try:
            req = _allreduce_request(state, sid, name, buffer, op, prescale, postscale)
        except ValueError as exc:
            refuse("allreduce", [name], exc, process_set=sid)
        engine = state.engine
        pace = engine.pace
        if pace is not None:
            pace.submitted(time.monotonic())
        done = engine.express(Entry(req, _contiguous(buffer), output))
        if done is True:
            if pace is not None:
                pace.done(time.monotonic())
            return output
        if done is not None:
            return Handle(done, _first, engine.alive, pace).wait()
    return allreduce([buffer], names=name, op=op, prescale=prescale, postscale=postscale,
                     process_set=process_set, outputs=[output]).wait()[0]


def allgather(buffers: Sequence[Buffer], *, names: Names = None, process_set: SetArg = None,
              group: Any = None, cacheable: Optional[bool] = None) -> Handle:
    """Concatenate every rank's buffer along dimension 0 (first dims may differ). Result: list."""
    buffers = list(buffers)
    if not buffers and group:
        return _empty_group("allgather", names, process_set, group)
    for b in buffers:
        if b.dim() == 0:
            _refuse_call("allgather", buffers, names, process_set, group, ValueError(
                "allgather needs a tensor with at least one dimension; reshape the scalar to "
                "[1]"))
    reqs = _requests("allgather", buffers, names, process_set, group, cacheable)
    return _submit([Entry(r, _contiguous(b)) for r, b in zip(reqs, buffers)])


def broadcast(buffers: Sequence[Buffer], root_rank: int, *, names: Names = None,
              process_set: SetArg = None, group: Any = None,
              outputs: Optional[Sequence[Buffer]] = None,
              cacheable: Optional[bool] = None) -> Handle:
    """Every rank gets `root_rank`'s buffers (a global rank). Result: list (`outputs`)."""
    buffers = list(buffers)
    if not buffers and group:
        return _empty_group("broadcast", names, process_set, group, root_rank=int(root_rank))
    reqs = _requests("broadcast", buffers, names, process_set, group, cacheable,
                     root_rank=int(root_rank))
    if outputs is None:
        outputs = [output_like(b) for b in buffers]
    return _submit([Entry(r, _contiguous(b), o) for r, b, o in zip(reqs, buffers, outputs)])


def reducescatter(buffers: Sequence[Buffer], *, names: Names = None, op: int = AVERAGE,
                  prescale: float = 1.0, postscale: float = 1.0, process_set: SetArg = None,
                  group: Any = None, cacheable: Optional[bool] = None) -> Handle:
    """Reduce over the set; each rank keeps its slice of dimension 0 (the first
    dim % size ranks one row more). Result: list."""
    buffers = list(buffers)
    if not buffers and group:
        return _empty_group("reducescatter", names, process_set, group, reduce_op=SUM)
    try:
        check_reduce_op(op, process_set, buffers, "reducescatter")
        for b in buffers:
            check_rank(b, "reducescatter")
    except (ValueError, NotImplementedError, HorovodInternalError) as exc:
        _refuse_call("reducescatter", buffers, names, process_set, group, exc)
    reqs = _requests("reducescatter", buffers, names, process_set, group, cacheable,
                     reduce=True, reduce_op=op, prescale=float(prescale),
                     postscale=float(postscale))
    return _submit([Entry(r, _contiguous(b)) for r, b in zip(reqs, buffers)])


def alltoall(buffer: Buffer, splits: Optional[Sequence[int]] = None, *, names: Names = None,
             process_set: SetArg = None, splits_dtype: Optional[str] = None) -> Handle:
    """Rows `splits[i]` go to set rank i (default: equal parts). Result: (output, received
    splits as an int32 buffer). Never cached: splits may change every call. `splits_dtype` is
    the dtype name of a splits tensor (Horovod takes int32 only)."""
    size = len(set_ranks(process_set))
    try:
        check_rank(buffer, "alltoall")
        split_list = _validation.alltoall_splits(splits, int(buffer.shape[0]), size,
                                                 dtype=splits_dtype)
    except ValueError as exc:
        _refuse_call("alltoall", [buffer], names, process_set, None, exc)
    (req,) = _requests("alltoall", [buffer], names, process_set, None, False,
                       splits=split_list)
    entry = Entry(req, _contiguous(buffer))
    return _submit([entry], lambda res: (res[0], entry.extra))


# ---------------------------------------------------------------------- control


def join() -> Handle:
    """This rank has no more data: until every rank has joined, it contributes zeros to the
    other ranks' allreduces. Result: the rank that joined last (int)."""
    req = Request(rank=_state().rank, name="join.noname", type=JOIN, cacheable=False)
    return _submit([Entry(req)], lambda res: int(res[0]))


def barrier(process_set: SetArg = None) -> Handle:
    """Completes once every rank of the set has reached it. Result: None.

    One name per set, cacheable: in the steady state a barrier is a round in which every rank
    offers its bit, with no coordinator and no fallback (a barrier per step used to send the set
    back to full negotiation every step). The frontends wait on it at once, so a rank has one
    barrier per set in flight; ranks match barriers by order, as Horovod's do."""
    req = Request(rank=_state().rank, name="barrier", type=BARRIER,
                  process_set_id=set_id(process_set))
    return _submit([Entry(req)], lambda res: None)


def engine_token() -> object:
    """Stays the same object while this process's engine does, and changes with a new one
    (after init, or an elastic reset): a frontend that agreed something with the ranks for one
    engine agrees again for the next (torch/flat_grads.py)."""
    return _state().engine


def flat_buffer(nbytes: int) -> torch.Tensor:
    """A CPU buffer for a frontend's flat gradients, allocated as the engine's fusion buffers
    are (collectives.host_buffer says why)."""
    return host_buffer(nbytes)


def process_set_change(name: str, extra: Any, add: bool) -> Handle:
    """Register (`extra`: the ranks) or remove (`extra`: the set id) a process set on every rank:
    a collective over the whole job. Result: the set id."""
    req = Request(rank=_state().rank, name=name, type=ADD_PROCESS_SET if add
                  else REMOVE_PROCESS_SET, extra=extra, cacheable=False)
    return _submit([Entry(req)], _first)


# ---------------------------------------------------------------------- Python objects
def _pickle(obj: Any) -> Buffer:
    import cloudpickle
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _pickled(obj: Any, kind: str, name: str, process_set: SetArg) -> Buffer:
    """`obj` pickled for an object collective; where it cannot be (a lock, a socket, an open
    file), the error reaches the other ranks first (refuse), who waited for its length until
    the stall shutdown."""
    try:
        return _pickle(obj)
    except Exception as exc:
        refuse(kind, [name + ".sz"], exc, process_set=process_set)


def _unpickle(data: bytes) -> Any:
    import cloudpickle
    return cloudpickle.load(io.BytesIO(data))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: SetArg = None) -> Any:
    """Pickle `obj` on `root_rank` (a global rank) and return it on every rank of the set.

    Other ranks may pass anything (e.g. None). `name` defaults to "broadcast_object" (Horovod
    used the object's type name, which hangs when non-root ranks pass an object of another
    type). Two broadcasts: the length (cached), then the bytes."""
    name = name or "broadcast_object"
    is_root = _state().rank == int(root_rank)
    payload = _pickled(obj, "broadcast", name, process_set) if is_root else None
    size = torch.tensor([payload.numel() if is_root else 0], dtype=torch.int64)
    broadcast([size], root_rank, names=name + ".sz", process_set=process_set,
              outputs=[size]).wait()
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    broadcast([payload], root_rank, names=name + ".t", process_set=process_set,
              outputs=[payload], cacheable=False).wait()
    if is_root:
        return obj
    return _unpickle(payload.numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: SetArg = None) -> list[Any]:
    """Pickle `obj` on every rank of the set; return all of them, in set-rank order."""
    name = name or "allgather_object"
    payload = _pickled(obj, "allgather", name, process_set)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    (sizes,) = allgather([size], names=name + ".sz", process_set=process_set).wait()
    (data,) = allgather([payload], names=name + ".t", process_set=process_set,
                        cacheable=False).wait()
    raw = data.numpy().tobytes()
    out, start = [], 0
    for n in sizes.tolist():
        out.append(_unpickle(raw[start:start + int(n)]))
        start += int(n)
    return out


__all__ = ["Buffer", "Handle", "output_like", "allreduce", "allreduce_now", "allgather",
           "broadcast", "reducescatter", "alltoall", "join", "barrier", "broadcast_object",
           "allgather_object", "refuse", "blocking_name", "set_id", "set_ranks", "dtype_name",
           "check_reduce_op", "resolve_names",
           "AVERAGE", "SUM", "ADASUM", "MIN", "MAX", "PRODUCT"]


def add_process_set(process_set) -> ProcessSet:
    """Register a new process set on every rank (a collective: every rank must call it, in the
    same order, with the same ranks)."""
    state = _basics._require()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError("add_process_set needs a ProcessSet built from a list of ranks")
    if not state.dynamic:
        raise ValueError("add_process_set() needs dynamic process sets: call "
                         "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1.")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    state.add_counter += 1
    try:
        sid = process_set_change(f"process_set.add.{state.add_counter}", tuple(ps.ranks),
                                 add=True).wait()
    except HorovodInternalError as exc:
        raise ValueError(str(exc)) from None
    ps.process_set_id = sid
    state.sets[sid] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set on every rank (a collective). Returns True when removed;
    False, as in Horovod, for a set that is not registered and for the global set, which is
    never removed (no collective is run then)."""
    state = _basics._require()
    sid = process_set.process_set_id
    if sid is None or sid == 0:
        return False
    state.add_counter += 1
    try:
        process_set_change(f"process_set.remove.{state.add_counter}", sid, add=False).wait()
    except HorovodInternalError as exc:
        raise ValueError(str(exc)) from None
    process_set._invalidate()
    state.sets.pop(sid, None)
    return True
