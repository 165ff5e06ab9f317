"""Reduce a step's gradients over the ranks: the shared core of `DistributedGradientTape`, the TF1
`DistributedOptimizer` and the Keras `DistributedOptimizer`.

Executing eagerly, all gradients of one call go to the engine in one submission. In a graph
(`tf.function`, Keras `model.fit`) the same holds where the engine sends a step's CPU gradients as
one bucket anyway (`ops.whole_pass`: a host with no core to spare per rank): one node submits
them all once backprop has ended and waits. Elsewhere each gradient leaves in its own small node
as soon as backprop has produced it, and one node per step waits for all of them: the transfers
overlap the rest of the backward pass and the engine still fuses what is queued together. Dense
gradients are allreduced (optionally compressed, optionally in explicit groups); `tf.IndexedSlices`
(embedding gradients) are allgathered as values + indices, as in Horovod.
"""
from __future__ import annotations

import itertools

import tensorflow as tf
import torch

from ..common import basics as _basics
from ..common import config as _config
from ..common import naming as _naming
from ..common import ops as _cops
from ..common.elastic import may_resize
from ..common.fusion import group_positions, resolve_groups, split_list
from ..common.stateful_compression import drive_all
from . import mpi_ops as _ops
from .compression import Compression
from .mpi_ops import Adasum, Average, Max, Min, Product, Sum, global_process_set


def var_ref(v):
    """A hashable identity for a variable (tf.Variable, keras.Variable) or tensor."""
    tv = _ops._tf_variable(v)
    if tv is not None:
        return tv.ref()
    if hasattr(v, "ref"):
        try:
            return v.ref()
        except Exception:
            pass
    return id(v)


def call_site() -> str:
    """The user's line that led here (outside hvdlite, TensorFlow and Keras): identical on every
    rank and on every step, so it makes a stable name for eager gradient reductions."""
    return _naming.framework_site()


def nothing_to_reduce(set_id: int) -> bool:
    """Whether this rank reduces nothing over the set: the set has one member, or the rank is
    outside it. Horovod skips the reduction in both cases; the gradients pass through."""
    ranks = _ops._set_ranks(set_id)
    return _basics.rank() not in ranks or len(ranks) == 1


def check_reduce_args(op, gradient_predivide_factor, num_groups, groups):
    """Horovod's argument checks, shared by every gradient wrapper; returns `groups`."""
    if gradient_predivide_factor != 1.0:
        if _basics.rocm_built():
            raise ValueError("gradient_predivide_factor not supported yet with ROCm")
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
    groups = resolve_groups(groups, num_groups, "tf.Variable")
    if op not in (Average, Sum, Adasum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average or hvd.Sum")
    return groups


class GradientReducer:
    """Reduces lists of gradients with one fixed configuration."""

    def __init__(self, kind: str, compression=Compression.none, sparse_as_dense: bool = False,
                 op=Average, gradient_predivide_factor: float = 1.0, groups=None,
                 process_set=global_process_set, scale_local_gradients: bool = True):
        self.kind = kind
        if isinstance(compression, type) and getattr(compression, "stateful", False):
            compression = compression()   # per-tensor state (residuals) belongs to this reducer
        if getattr(compression, "stateful", False) and groups is not None:
            raise ValueError("stateful compression (int8, powersgd) reduces tensor by tensor; "
                             "do not pass groups/num_groups with it")
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        if op == Average:
            # The engine applies the extra 1/size for Average, as Horovod's C++ does.
            self.prescale, self.postscale = 1.0 / gradient_predivide_factor, \
                float(gradient_predivide_factor)
        else:
            self.prescale, self.postscale = 1.0, 1.0
        self._local: set = set()
        self._outputs: dict = {}

    # ------------------------------------------------------------------ local variables
    def register_local(self, var) -> None:
        """Gradients of `var` stay local (not reduced; divided by the set size when
        scale_local_gradients)."""
        self._local.add(var_ref(var))

    def is_local(self, var) -> bool:
        return var_ref(var) in self._local

    # ------------------------------------------------------------------ naming
    def _base_name(self, site: str | None, use_generic_names: bool) -> tuple[str, bool]:
        if use_generic_names:
            return self.kind, True
        if tf.executing_eagerly():
            return f"{self.kind}.{site or call_site()}", True
        return _ops._unique_in_graph(tf.compat.v1.get_default_graph(), self.kind), True

    # ------------------------------------------------------------------ reduce
    def reduce(self, grads, variables, use_generic_names: bool = False, site: str | None = None):
        """Return `grads` with every non-local, non-None gradient reduced over the set."""
        grads = list(grads)
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
        out = list(grads)
        todo = [i for i, (g, v) in enumerate(zip(grads, variables))
                if g is not None and not self.is_local(v)]
        if todo and self._reduces_nothing():
            todo = []
        if self.sparse_as_dense:
            for i in todo:
                if isinstance(out[i], tf.IndexedSlices):
                    out[i] = tf.convert_to_tensor(out[i])
        dense = [i for i in todo if not isinstance(out[i], tf.IndexedSlices)]
        sparse = [i for i in todo if isinstance(out[i], tf.IndexedSlices)]
        if sparse and self.op == Adasum:
            raise NotImplementedError("The Adasum reduction does not currently support sparse "
                                      "tensors. As a workaround please pass sparse_as_dense=True "
                                      f"to {self.kind}")
        if sparse and self.op not in (Sum, Average):
            raise NotImplementedError("Only Sum and Average ops are supported with "
                                      "tf.IndexedSlices; pass sparse_as_dense=True")
        if todo:
            base, cacheable = self._base_name(site, use_generic_names)
            reduced = self._reduce_now(out, dense, sparse, variables, base, cacheable)
            for i, r in reduced.items():
                out[i] = r
        local = [i for i, (g, v) in enumerate(zip(grads, variables))
                 if g is not None and self.is_local(v)]
        if local and self.scale_local_gradients:
            size = _ops.size_op(_ops._set_id(self.process_set))
            for i in local:
                g = out[i]
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / tf.cast(size, g.values.dtype),
                                              g.indices, g.dense_shape)
                else:
                    out[i] = g / tf.cast(size, g.dtype)
        return out

    def _reduces_nothing(self) -> bool:
        """Whether this rank's set has one member (or the rank is outside it) in a job that
        cannot grow: then, as Horovod does, no reduction is built at all and the gradients pass
        through untouched. An elastic job keeps its nodes, which skip at run time, so a traced
        graph stays valid after a resize. Why: with the per-gradient nodes in its graph a
        1-rank Keras fit ran 7-13 % below plain Keras."""
        return not may_resize() and nothing_to_reduce(_ops._set_id(self.process_set))

    def _reduce_now(self, grads, dense, sparse, variables, base, cacheable) -> dict:
        """Reduce the gradients at `dense` and `sparse` (indices into `grads`).

        Executing eagerly, every gradient exists already: one submission, one wait; in a graph
        the same, as one node, where nothing could overlap (_one_node). Otherwise, in a graph
        (`tf.function`, `model.fit`) each unit (a gradient, or an explicit group) gets its own
        small node that only hands its tensors to the engine and returns a token, so TensorFlow
        runs it as soon as backprop has produced that gradient and the transfer overlaps the
        rest of the backward pass, as the torch hooks do; one last node waits for all of them.
        """
        set_id = _ops._set_id(self.process_set)
        _ops._check_graph(f"{self.kind} (gradient allreduce)")
        if getattr(self.compression, "stateful", False) and dense:
            return self._reduce_stateful(grads, dense, sparse, variables, base, cacheable,
                                         set_id)
        compressed, ctxs = {}, {}
        for i in dense:
            g = tf.convert_to_tensor(grads[i])
            _ops._dtype_name(g.dtype, True, f"{self.kind} gradient {i}")
            compressed[i], ctxs[i] = self.compression.compress(g)
        svals = {i: tf.convert_to_tensor(grads[i].values) for i in sparse}
        sidx = {i: tf.convert_to_tensor(grads[i].indices) for i in sparse}
        explicit_groups = self.groups is not None
        units = []      # (indices, group name or None, sparse?)
        if explicit_groups:
            for g_idx, members in enumerate(group_positions(dense, variables, self.groups,
                                                            var_ref)):
                gname = f"{base}.group_{g_idx}" if len(members) > 1 else None
                units.append((members, gname, False))
        else:
            # One unit per gradient: each leaves as soon as it exists; the engine still fuses
            # whatever is queued together.
            units.extend(([i], None, False) for i in dense)
        units.extend(([i], None, True) for i in sparse)
        plan = _Plan(self, base, cacheable, set_id)

        def unit_inputs(unit):
            members, _, is_sparse = unit
            if is_sparse:
                return [svals[members[0]], sidx[members[0]]]
            return [compressed[i] for i in members]

        def reduce_all(*xs):
            return plan.collect(units, plan.submit_all(units, xs))

        inputs = [x for unit in units for x in unit_inputs(unit)]
        if tf.executing_eagerly():
            outs = reduce_all(*inputs)
        elif _one_node(inputs):
            touts, shapes = _unit_signature(units, compressed, svals, sidx)
            outs = _ops._run("HorovodAllreduceGradients", reduce_all, inputs, touts, shapes)
        else:
            tokens = {}
            # Roughly the order backprop produces gradients in: the last variables first.
            order = sorted(range(len(units)), key=lambda u: -max(units[u][0]))
            for u in order:
                unit = units[u]
                tokens[u] = _ops._run(
                    "HorovodSubmitGradients",
                    lambda *xs, _unit=unit: [tf.constant(plan.submit_token(_unit, xs), tf.int64)],
                    unit_inputs(unit), [tf.int64], [tf.TensorShape([])])[0]
            _pace_backprop([unit_inputs(units[u]) for u in order], [tokens[u] for u in order])

            def collect(*ts):
                return plan.collect(units, [plan.take(int(t)) for t in ts])

            touts, shapes = _unit_signature(units, compressed, svals, sidx)
            outs = _ops._run("HorovodAllreduceGradients", collect,
                             [tokens[u] for u in range(len(units))], touts, shapes)
        result = {}
        pos = 0
        for members, _, is_sparse in units:
            if is_sparse:
                i = members[0]
                result[i] = tf.IndexedSlices(outs[pos], outs[pos + 1],
                                             dense_shape=grads[i].dense_shape)
                pos += 2
            else:
                for i in members:
                    result[i] = self.compression.decompress(outs[pos], ctxs[i])
                    pos += 1
        return result

    def _reduce_stateful(self, grads, dense, sparse, variables, base, cacheable, set_id) -> dict:
        """Dense gradients through a stateful compressor (int8 / PowerSGD, which keep residuals
        per tensor and run their own collectives on the engine's torch tensors); sparse ones as
        usual. The compressor's state is keyed by the gradient's wire name, stable across steps
        (call site in eager mode, graph-unique name under tf.function)."""
        comp, op, ps = self.compression, self.op, self.process_set
        xs = []
        for i in dense:
            g = tf.convert_to_tensor(grads[i])
            if not g.dtype.is_floating:
                name = getattr(variables[i], "name", f"gradient {i}")
                raise TypeError(f"{type(comp).__name__} cannot compress the gradient of "
                                f"'{name}' of dtype {g.dtype.name}: floating-point only; use "
                                f"Compression.none")
            xs.append(g)
        result = {}
        if sparse:
            result.update(GradientReducer._reduce_plain(self, grads, sparse, variables, base,
                                                        cacheable))

        def fn(*ys):
            if nothing_to_reduce(set_id):
                return list(ys)
            pend = [comp.reduce_async(_ops._to_torch(y), f"{base}.grad_{i}", op=op,
                                      process_set=ps) for y, i in zip(ys, dense)]
            drive_all(pend)
            return [_ops._to_tf(p.result().contiguous()) for p in pend]

        outs = _ops._run("HorovodAllreduceGradients", fn, xs, [x.dtype for x in xs],
                         [x.shape for x in xs])
        for k, i in enumerate(dense):
            result[i] = outs[k]
        return result

    def _reduce_plain(self, grads, sparse, variables, base, cacheable) -> dict:
        """Sparse gradients only, without compression (used beside a stateful compressor)."""
        saved = self.compression
        self.compression = Compression.none
        try:
            return self._reduce_now(grads, [], sparse, variables, base + ".sparse", cacheable)
        finally:
            self.compression = saved

    # ------------------------------------------------------------------ output buffers
    def output_like(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """An output buffer for the reduction named `name`: last step's, when nothing outside
        this reducer still uses it (TensorFlow has dropped the tensor that aliased it), else a
        new one. A fresh multi-megabyte buffer costs page faults on every step (measured: 15-20
        ms for this benchmark's 15 MB of gradients, against 2-4 ms to refill a used one).
        Liveness is the storage's reference count: only views (what TensorFlow was given)
        hold the storage besides the buffer itself."""
        buf = self._outputs.get(name)
        if (buf is None or buf.shape != t.shape or buf.dtype != t.dtype
                or torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2):
            # 2: the buffer itself and the temporary storage object of this check.
            buf = torch.empty_like(t)
            self._outputs[name] = buf
        return buf


def _one_node(inputs: list) -> bool:
    """Whether a traced step reduces its gradients in one node that submits them all once
    backprop has ended, rather than one submit node per gradient plus a collect node.

    Why: where the engine sends a step's CPU gradients as one bucket (ops.whole_pass: no core
    to spare per rank), a gradient submitted early only waits in the engine for the last one,
    so the per-gradient nodes bought no overlap and cost a `py_function` call and a
    submission each (~0.15-0.2 ms apiece on a 2-core host). A custom loop's later step on a
    small MLP (six gradients, 2 ranks on 2 cores; benchmarks/tf_first_step.py, 5 alternating
    jobs each) took 6.6-7.4 ms with them and 3.2-5.3 ms without, against 1.2-2.4 ms for the
    plain tape. A gradient whose device at trace time is a GPU keeps the per-gradient nodes:
    its backprop runs on the device, and the host-side transfers overlap it as in DDP."""
    if not _cops.whole_pass():
        return False
    return not any("GPU" in (getattr(x, "device", "") or "").upper() for x in inputs)


def _unit_signature(units, compressed, svals, sidx) -> tuple[list, list]:
    """(dtypes, static shapes) of a reduction node's outputs, unit by unit."""
    touts, shapes = [], []
    for members, _, is_sparse in units:
        if is_sparse:
            v = svals[members[0]]
            touts += [v.dtype, sidx[members[0]].dtype]
            shapes += [tf.TensorShape([None]).concatenate(v.shape[1:]), tf.TensorShape([None])]
        else:
            touts += [compressed[i].dtype for i in members]
            shapes += [compressed[i].shape for i in members]
    return touts, shapes


_PACE_SEARCH_LIMIT = 2000


def _descendants_reach(op, target, ours: set, limit: int) -> bool | None:
    """True if `target`, or a stateful op other than `ours`, is reachable from `op` along
    data and control edges; None when the search gave up after `limit` ops."""
    seen, stack = {op}, [op]
    while stack:
        cur = stack.pop()
        nxt = [c for out in cur.outputs for c in out.consumers()]
        nxt += list(getattr(cur, "_control_outputs", ()))
        for c in nxt:
            if c in seen:
                continue
            if c is target:
                return True
            if c not in ours and c.op_def is not None and c.op_def.is_stateful:
                return True
            seen.add(c)
            if len(seen) > limit:
                return None
            stack.append(c)
    return False


def _pace_backprop(inputs: list, tokens: list) -> None:
    """Let each submit node run as soon as its gradient exists, before backprop moves on.

    With one inter-op thread TensorFlow's executor runs a chain of ready ops inline and leaves
    the nodes it queued (our submit nodes) until the backward pass is over, so nothing
    overlaps. A control edge from unit k's submit node to the op producing unit k+1's
    gradient (the next one in backward order) makes the executor run the submit first. An edge
    is only added where it cannot close a cycle: the gradient op must be in this graph, and
    nothing downstream of it may be unit k's submit node or a stateful op that TensorFlow's
    automatic control dependencies could order before it."""
    graph = tf.compat.v1.get_default_graph()
    if not getattr(graph, "building_function", False) or not _config.truthy(
            _config.raw("HVDLITE_TF_PACE_BACKPROP"), True):
        return
    ours = {t.op for t in tokens}
    for k in range(len(tokens) - 1):
        submit_op = tokens[k].op
        for x in inputs[k + 1]:
            target = x.op
            if target.graph is not graph or target.type in ("Placeholder", "Const") \
                    or not target.inputs:
                continue
            if _descendants_reach(target, submit_op, ours, _PACE_SEARCH_LIMIT) is not False:
                continue
            try:
                target._add_control_input(submit_op)
            except Exception:   # TF internals changed: run without pacing
                return


# Submitted gradient units waiting for their collect node, by token (tokens travel through the
# graph as int64 scalars, so a collect node can only take what its own submit nodes handed in).
_pending: dict = {}
_tokens = itertools.count(1)


class _Member:
    """One buffer's share of a handle that reduced several (Plan.submit_all)."""

    __slots__ = ("handle", "index")

    def __init__(self, handle, index: int):
        self.handle, self.index = handle, index

    def wait(self) -> list:
        return [self.handle.wait()[self.index]]


class _Plan:
    """How one traced reduction talks to the engine (shared by its submit and collect nodes)."""

    def __init__(self, reducer: GradientReducer, base: str, cacheable: bool, set_id: int):
        self.reducer = reducer
        self.base = base
        self.cacheable = cacheable
        self.set_id = set_id

    def skipped(self) -> bool:
        return nothing_to_reduce(self.set_id)

    def submit(self, unit, xs):
        """Hand one unit to the engine: (handle, inputs), or (None, inputs) when skipped."""
        members, gname, is_sparse = unit
        if self.skipped():
            return None, list(xs)
        r = self.reducer
        bufs = [_ops._to_torch(x) for x in xs]
        if is_sparse:
            i = members[0]
            handle = _cops.allgather(bufs, names=[f"{self.base}.grad_{i}.values",
                                                  f"{self.base}.grad_{i}.indices"],
                                     process_set=self.set_id, cacheable=self.cacheable)
        else:
            names = [f"{self.base}.grad_{i}" for i in members]
            handle = _cops.allreduce(bufs, names=names, op=r.op, prescale=r.prescale,
                                     postscale=r.postscale, process_set=self.set_id,
                                     group=gname, cacheable=self.cacheable,
                                     outputs=[r.output_like(n, b) for n, b in zip(names, bufs)])
        return handle, list(xs)

    def submit_all(self, units, xs) -> list:
        """Hand every unit to the engine at once: what submit() gives for each, in order. The
        ungrouped dense units (one gradient each) go as one submit() of all their gradients
        with no group: one call, each gradient its own named collective."""
        out, pos, slots, members, batch = [], 0, [], [], []
        for unit in units:
            k = 2 if unit[2] else len(unit[0])
            mine = list(xs[pos:pos + k])
            pos += k
            if unit[2] or unit[1] is not None:
                out.append(self.submit(unit, mine))
            else:
                slots.append(len(out))
                members += unit[0]
                batch += mine
                out.append(None)
        if slots:
            handle, _ = self.submit((members, None, False), batch)
            for j, slot in enumerate(slots):
                out[slot] = (None if handle is None else _Member(handle, j), [batch[j]])
        return out

    def submit_token(self, unit, xs) -> int:
        token = next(_tokens)
        _pending[token] = self.submit(unit, xs)
        return token

    @staticmethod
    def take(token: int):
        try:
            return _pending.pop(token)
        except KeyError:
            raise RuntimeError(f"hvdlite: gradient submission {token} is unknown (its graph "
                               f"ran the collect node twice?)") from None

    def collect(self, units, submitted) -> list:
        """Wait for every unit; the reduced tensors in the order of the collect node's outputs."""
        out = []
        ranks = None
        for (_members, _, is_sparse), (handle, xs) in zip(units, submitted):
            if handle is None:
                out.extend(xs)
                continue
            results = handle.wait()
            if is_sparse:
                v, ind = _ops._to_tf(results[0]), _ops._to_tf(results[1])
                if self.reducer.op == Average:
                    ranks = ranks or _ops._set_ranks(self.set_id)
                    v = v / tf.cast(len(ranks), v.dtype)
                out += [v, ind]
            else:
                # TensorFlow gets a view: the view holds a reference to the storage, which is
                # what output_like() checks before reusing the buffer (the buffer itself is also
                # referenced by the engine's bookkeeping, so its own count proves nothing).
                out.extend(_ops._to_tf(t.view(t.shape)) for t in results)
        return out


__all__ = ["GradientReducer", "split_list", "var_ref", "call_site", "check_reduce_args"]
