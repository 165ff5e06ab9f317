"""Reduce a step's gradients over the ranks: the shared core of `DistributedGradientTape`, the TF1
`DistributedOptimizer` and the Keras `DistributedOptimizer`.

All gradients of one call go to the engine in ONE submission (one graph node), so they are
negotiated together and fused into as few transport calls as the fusion threshold allows. Dense
gradients are allreduced (optionally compressed, optionally in explicit groups); `tf.IndexedSlices`
(embedding gradients) are allgathered as values + indices, as in Horovod.
"""
from __future__ import annotations

import tensorflow as tf

from ..common import basics as _basics
from ..common import naming as _naming
from ..common import ops as _cops
from . import mpi_ops as _ops
from .compression import Compression
from .mpi_ops import Adasum, Average, Max, Min, Product, Sum, global_process_set


def split_list(lst, n):
    """Split `lst` into `n` chunks of nearly equal length (the first ones one longer)."""
    d, r = divmod(len(lst), n)
    return [lst[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


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


def check_reduce_args(op, gradient_predivide_factor, num_groups, groups):
    """Horovod's argument checks, shared by every gradient wrapper; returns `groups`."""
    import warnings
    if gradient_predivide_factor != 1.0:
        if _basics.rocm_built():
            raise ValueError("gradient_predivide_factor not supported yet with ROCm")
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "tf.Variable.")
    if op == Adasum:
        raise NotImplementedError("op=Adasum is not available yet in hvdlite; use Average or Sum.")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average or hvd.Sum")
    return groups


class GradientReducer:
    """Reduces lists of gradients with one fixed configuration."""

    def __init__(self, kind: str, compression=Compression.none, sparse_as_dense: bool = False,
                 op=Average, gradient_predivide_factor: float = 1.0, groups=None,
                 process_set=global_process_set, scale_local_gradients: bool = True):
        self.kind = kind
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

    def _group_of(self, indices: list, variables: list) -> list[list[int]]:
        """Split the indices of dense gradients into explicit groups (or one big batch)."""
        if self.groups is None:
            return [indices]
        if isinstance(self.groups, int):
            return [g for g in split_list(indices, self.groups) if g]
        pos = {var_ref(variables[i]): i for i in indices}
        out, used = [], set()
        for group in self.groups:
            members = [pos[var_ref(v)] for v in group if var_ref(v) in pos]
            members = [i for i in members if i not in used]
            used.update(members)
            if members:
                out.append(sorted(members))
        out.extend([i] for i in indices if i not in used)
        return out

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
        if self.sparse_as_dense:
            for i in todo:
                if isinstance(out[i], tf.IndexedSlices):
                    out[i] = tf.convert_to_tensor(out[i])
        dense = [i for i in todo if not isinstance(out[i], tf.IndexedSlices)]
        sparse = [i for i in todo if isinstance(out[i], tf.IndexedSlices)]
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

    def _reduce_now(self, grads, dense, sparse, variables, base, cacheable) -> dict:
        set_id = _ops._set_id(self.process_set)
        _ops._check_graph(f"{self.kind} (gradient allreduce)")
        compressed, ctxs = [], []
        for i in dense:
            g = tf.convert_to_tensor(grads[i])
            _ops._dtype_name(g.dtype, True, f"{self.kind} gradient {i}")
            c, ctx = self.compression.compress(g)
            compressed.append(c)
            ctxs.append(ctx)
        sv = [tf.convert_to_tensor(grads[i].values) for i in sparse]
        si = [tf.convert_to_tensor(grads[i].indices) for i in sparse]
        groups = self._group_of(dense, variables)
        slot = {i: k for k, i in enumerate(dense)}
        op, pre, post = self.op, self.prescale, self.postscale
        explicit_groups = self.groups is not None
        nd, ns = len(dense), len(sparse)

        def fn(*xs):
            dxs, vxs, ixs = list(xs[:nd]), list(xs[nd:nd + ns]), list(xs[nd + ns:])
            ranks = _ops._set_ranks(set_id)
            if _basics.rank() not in ranks or len(ranks) == 1:
                return dxs + vxs + ixs     # Horovod skips the reduction here too
            handles = []
            for g_idx, members in enumerate(groups):
                gname = f"{base}.group_{g_idx}" if explicit_groups and len(members) > 1 else None
                handles.append(_cops.allreduce(
                    [_ops._to_torch(dxs[slot[i]]) for i in members],
                    names=[f"{base}.grad_{i}" for i in members], op=op, prescale=pre,
                    postscale=post, process_set=set_id, group=gname, cacheable=cacheable))
            if sparse:
                bufs, names = [], []
                for k, i in enumerate(sparse):
                    for part, x in (("values", vxs[k]), ("indices", ixs[k])):
                        bufs.append(_ops._to_torch(x))
                        names.append(f"{base}.grad_{i}.{part}")
                handles.append(_cops.allgather(bufs, names=names, process_set=set_id,
                                               cacheable=cacheable))
            results = []
            for h in handles:
                results.extend(h.wait())
            reduced = {}
            pos = 0
            for members in groups:
                for i in members:
                    reduced[i] = _ops._to_tf(results[pos])
                    pos += 1
            dense_out = [reduced[i] for i in dense]
            values_out, indices_out = [], []
            for k in range(ns):
                v = _ops._to_tf(results[pos])
                ind = _ops._to_tf(results[pos + 1])
                pos += 2
                if op == Average:
                    v = v / tf.cast(len(ranks), v.dtype)
                values_out.append(v)
                indices_out.append(ind)
            return dense_out + values_out + indices_out

        inputs = compressed + sv + si
        touts = [x.dtype for x in inputs]
        shapes = [x.shape for x in compressed] + \
            [tf.TensorShape([None]).concatenate(v.shape[1:]) for v in sv] + \
            [tf.TensorShape([None]) for _ in si]
        outs = _ops._run("HorovodAllreduceGradients", fn, inputs, touts, shapes)
        result = {}
        for k, i in enumerate(dense):
            result[i] = self.compression.decompress(outs[k], ctxs[k])
        for k, i in enumerate(sparse):
            result[i] = tf.IndexedSlices(outs[nd + k], outs[nd + ns + k],
                                         dense_shape=grads[i].dense_shape)
        return result


__all__ = ["GradientReducer", "split_list", "var_ref", "call_site", "check_reduce_args"]
