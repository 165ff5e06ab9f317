"""hvdlite.tensorflow on real ranks: every collective eagerly and inside tf.function against
single-process references, their gradients, process sets, object helpers, the gradient tape, the
TF1 optimizer, SyncBatchNormalization and the errors. One launch, many named checks."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from tf_common import (check, close, expect_raises, fail, finish, gen, same,  # noqa: E402
                       to_np)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
import hvdlite.tensorflow.gradients as hgrads  # noqa: E402
from hvdlite.common import ops as hops  # noqa: E402

hvd.init(process_sets="dynamic")
RANK, SIZE = hvd.rank(), hvd.size()

MODES = {"eager": lambda f: f, "function": tf.function}
REDUCE_DTYPES = [tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
                 tf.float32, tf.float64]
MOVE_DTYPES = REDUCE_DTYPES + [tf.bool, tf.uint32, tf.uint64, tf.complex64]
OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}


def inputs(shape, dtype, salt, lo=-4, hi=4):
    return [gen(r, shape, dtype, salt, lo, hi) for r in range(SIZE)]


def reduce_ref(xs, op, pre=1.0, post=1.0, size=None):
    dtype = xs[0].dtype
    size = size or len(xs)
    floating = np.issubdtype(dtype, np.floating) or dtype == tf.bfloat16.as_numpy_dtype
    s = np.stack([x.astype(np.float64) for x in xs])
    s = s * pre if floating else np.trunc(s * pre)
    red = {hvd.Average: s.sum(0), hvd.Sum: s.sum(0), hvd.Min: s.min(0), hvd.Max: s.max(0),
           hvd.Product: s.prod(0)}[op]
    red = red * (post / size if op == hvd.Average else post)
    if not floating:
        red = np.trunc(red)
    return red.astype(dtype)


def tf_const(x, dtype):
    return tf.constant(x, dtype=dtype) if dtype != tf.bfloat16 else \
        tf.cast(tf.constant(x.astype(np.float32)), tf.bfloat16)


# ---------------------------------------------------------------------------- collectives
def check_topology():
    if SIZE != 2:
        fail(f"size {SIZE}")
    same(hvd.size_op(), np.int32(SIZE), "size_op eager")
    same(tf.function(lambda: hvd.rank_op())(), np.int32(RANK), "rank_op in tf.function")
    same(tf.function(lambda: hvd.local_size_op())(), np.int32(hvd.local_size()), "local_size_op")
    same(tf.function(lambda: hvd.process_set_included_op(0))(), np.int32(1), "included_op")
    if not hvd.is_initialized() or hvd.local_rank() != RANK or hvd.cross_size() != 1:
        fail("topology functions")


def check_allreduce(mode, opname):
    op = OPS[opname]
    for dtype in REDUCE_DTYPES:
        if op == hvd.Product and dtype in (tf.uint8, tf.int8):
            lo, hi = 0, 3
        else:
            lo, hi = -4, 4
        xs = inputs((3, 4), dtype, ("ar", opname, dtype.name), lo, hi)
        f = MODES[mode](lambda x: hvd.allreduce(x, op=op))
        out = f(tf_const(xs[RANK], dtype))
        expected = reduce_ref(xs, op)
        if dtype == tf.bfloat16:
            same(tf.cast(out, tf.float32), expected.astype(np.float32), f"{dtype.name}")
        else:
            same(out, expected, f"{dtype.name}")


def check_allreduce_variants(mode):
    xs = inputs((5,), tf.float32, "arv")
    x = tf.constant(xs[RANK])
    f = MODES[mode](lambda x: (
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0, name="scaled"),
        hvd.allreduce(x, average=False),
        hvd.allreduce(tf.Variable(x) if mode == "eager" else x, op=hvd.Average),
        hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum),
        hvd.allreduce(x, op=hvd.Average, name="twice"), hvd.allreduce(x * 2, op=hvd.Sum)))
    scaled, summed, avg, fp16, avg2, sum2 = f(x)
    same(scaled, reduce_ref(xs, hvd.Sum, 0.5, 4.0), "prescale/postscale")
    same(summed, reduce_ref(xs, hvd.Sum), "average=False")
    same(avg, reduce_ref(xs, hvd.Average), "Average (variable input)")
    same(fp16, reduce_ref(xs, hvd.Sum), "fp16 compression")
    same(avg2, reduce_ref(xs, hvd.Average), "named")
    same(sum2, reduce_ref([2 * x for x in xs], hvd.Sum), "second unnamed")
    # The same tf.function run again: cached names, same results.
    again = f(x)
    same(again[0], reduce_ref(xs, hvd.Sum, 0.5, 4.0), "second run")


def check_grouped_allreduce(mode):
    xs = [inputs((2, 3), tf.float32, "ga0"), inputs((4,), tf.float64, "ga1"),
          inputs((1,), tf.int32, "ga2")]
    f = MODES[mode](lambda a, b, c: hvd.grouped_allreduce([a, b, c], op=hvd.Sum))
    out = f(*[tf.constant(x[RANK]) for x in xs])
    for i, (o, x) in enumerate(zip(out, xs)):
        same(o, reduce_ref(x, hvd.Sum), f"tensor {i}")
    out = MODES[mode](lambda a: hvd.grouped_allreduce([a, a * 2], op=hvd.Average))(
        tf.constant(xs[0][RANK]))
    same(out[1], reduce_ref([2 * x for x in xs[0]], hvd.Average), "average")


def check_sparse_allreduce(mode):
    vals = inputs((2, 3), tf.float32, "sp")
    idx = [np.array([r, 3], dtype=np.int64) for r in range(SIZE)]

    def fn(v, i):
        s = tf.IndexedSlices(v, i, dense_shape=tf.constant([5, 3], dtype=tf.int64))
        avg = hvd.allreduce(s, op=hvd.Average)
        tot = hvd.allreduce(s, op=hvd.Sum)
        return tf.convert_to_tensor(avg), tf.convert_to_tensor(tot)

    avg, tot = MODES[mode](fn)(tf.constant(vals[RANK]), tf.constant(idx[RANK]))
    dense = np.zeros((5, 3))
    for r in range(SIZE):
        for k, row in enumerate(idx[r]):
            dense[row] += vals[r][k]
    close(tot, dense, "IndexedSlices Sum")
    close(avg, dense / SIZE, "IndexedSlices Average")


def check_allgather(mode):
    for dtype in MOVE_DTYPES:
        xs = [gen(r, (r + 1, 3), dtype, ("ag", dtype.name)) if dtype not in
              (tf.uint32, tf.uint64, tf.complex64) else
              (gen(r, (r + 1, 3), tf.int32, ("ag", dtype.name), 0, 9)
               .astype(dtype.as_numpy_dtype)) for r in range(SIZE)]
        f = MODES[mode](lambda x: hvd.allgather(x))
        out = f(tf_const(xs[RANK], dtype))
        exp = np.concatenate(xs)
        if dtype == tf.bfloat16:
            same(tf.cast(out, tf.float32), exp.astype(np.float32), dtype.name)
        elif dtype == tf.complex64:
            if not np.array_equal(to_np(out), exp):
                fail("complex64 differs")
        else:
            same(out, exp, dtype.name)
    xs = inputs((2,), tf.int64, "ga")
    out = MODES[mode](lambda a, b: hvd.grouped_allgather([a, b]))(
        tf.constant(xs[RANK]), tf.constant(xs[RANK] * 3))
    same(out[0], np.concatenate(xs), "grouped 0")
    same(out[1], np.concatenate([x * 3 for x in xs]), "grouped 1")
    expect_raises(ValueError, lambda: hvd.allgather(tf.constant(1.0)), "scalar",
                  "at least one dimension")


def check_broadcast(mode):
    for root in range(SIZE):
        for dtype in MOVE_DTYPES:
            xs = [gen(r, (2, 3), tf.int32 if dtype in (tf.uint32, tf.uint64, tf.complex64)
                      else dtype, ("bc", root, dtype.name), 0, 9) for r in range(SIZE)]
            xs = [x.astype(dtype.as_numpy_dtype) if dtype != tf.bfloat16 else x for x in xs]
            f = MODES[mode](lambda x: hvd.broadcast(x, root))
            out = f(tf_const(xs[RANK], dtype))
            if dtype == tf.bfloat16:
                same(tf.cast(out, tf.float32), xs[root].astype(np.float32), dtype.name)
            elif dtype == tf.complex64:
                if not np.array_equal(to_np(out), xs[root]):
                    fail("complex64 broadcast differs")
            else:
                same(out, xs[root], f"root {root} {dtype.name}")


def check_broadcast_inplace(mode):
    xs = inputs((3,), tf.float32, "bi")
    v = tf.Variable(xs[RANK])
    w = tf.Variable(xs[RANK].astype(np.int64))
    f = MODES[mode](lambda: hvd.broadcast_([v, w], root_rank=1))
    out = f()
    same(v.read_value(), xs[1], "variable value")
    same(w.read_value(), xs[1].astype(np.int64), "int variable value")
    same(out[0], xs[1], "returned value")
    v2 = tf.Variable(xs[RANK] * 0 + RANK)
    hvd.broadcast_variables([v2], root_rank=0)
    same(v2.read_value(), np.zeros(3, np.float32), "broadcast_variables")
    if mode == "function":
        v3 = tf.Variable(xs[RANK] + RANK)
        @tf.function
        def bcast():
            hvd.broadcast_variables([v3], root_rank=1)

        bcast()
        same(v3.read_value(), xs[1] + 1, "broadcast_variables in tf.function")


def check_alltoall(mode):
    # Rank r sends (r + 1 + i) rows to rank i.
    rows = {r: [r + 1 + i for i in range(SIZE)] for r in range(SIZE)}
    xs = [gen(r, (sum(rows[r]), 2), tf.float32, "a2a") for r in range(SIZE)]
    f = MODES[mode](lambda x, s: hvd.alltoall(x, splits=s))
    out, recv = f(tf.constant(xs[RANK]), tf.constant(rows[RANK], dtype=tf.int32))
    parts = []
    for src in range(SIZE):
        start = sum(rows[src][:RANK])
        parts.append(xs[src][start:start + rows[src][RANK]])
    same(out, np.concatenate(parts), "with splits")
    same(recv, np.array([rows[s][RANK] for s in range(SIZE)], dtype=np.int32), "recv splits")
    ys = inputs((2 * SIZE, 3), tf.int32, "a2a_eq")
    out = MODES[mode](lambda x: hvd.alltoall(x))(tf.constant(ys[RANK]))
    same(out, np.concatenate([ys[s][2 * RANK:2 * RANK + 2] for s in range(SIZE)]), "even split")


def split_rows(dim0, size):
    return [dim0 // size + (1 if i < dim0 % size else 0) for i in range(size)]


def my_rows(full, index):
    rows = split_rows(full.shape[0], SIZE)
    start = sum(rows[:index])
    return full[start:start + rows[index]]


def check_reducescatter(mode):
    for opname in ("Average", "Sum", "Max"):
        op = OPS[opname]
        xs = inputs((5, 2), tf.float32, ("rs", opname))
        out = MODES[mode](lambda x: hvd.reducescatter(x, op=op))(tf.constant(xs[RANK]))
        same(out, my_rows(reduce_ref(xs, op), RANK), f"{opname}")
    xs = [inputs((3, 2), tf.float32, "grs0"), inputs((4,), tf.float32, "grs1")]
    out = MODES[mode](lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum))(
        *[tf.constant(x[RANK]) for x in xs])
    for i, (o, x) in enumerate(zip(out, xs)):
        same(o, my_rows(reduce_ref(x, hvd.Sum), RANK), f"grouped {i}")


def check_join_barrier(mode):
    if mode == "eager":
        hvd.barrier()
        last = hvd.join()
    else:
        @tf.function
        def barrier_then_join():
            hvd.barrier()
            return hvd.join()

        last = barrier_then_join()
    if int(last) not in range(SIZE):
        fail(f"join returned {last}")


def check_uneven_join():
    # Rank 1 has one batch more: rank 0 joins, its zeros enter rank 1's last allreduce.
    x = tf.constant([float(RANK + 1)] * 2)
    f = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum, name="uneven"))
    steps = 2 + RANK
    outs = [f(x) for _ in range(steps)]
    last = hvd.join()
    same(outs[0], np.array([3.0, 3.0], np.float32), "both ranks")
    if RANK == 1:
        same(outs[-1], np.array([2.0, 2.0], np.float32), "joined rank contributes zeros")
    if int(last) != 1:
        fail(f"last joined rank {int(last)}")


def check_process_sets():
    ps_zero = hvd.add_process_set([0])
    ps_one = hvd.add_process_set([1])
    ps_both = hvd.global_process_set
    xs = inputs((3,), tf.float32, "ps")
    out = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum, process_set=ps_both))(
        tf.constant(xs[RANK]))
    same(out, reduce_ref(xs, hvd.Sum), "global set")
    mine = ps_zero if RANK == 0 else ps_one
    out = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum, process_set=mine))(
        tf.constant(xs[RANK]))
    same(out, xs[RANK], "own single-rank set in tf.function")
    if RANK == 1:
        out = hvd.allreduce(tf.constant(xs[RANK]), op=hvd.Sum, process_set=ps_one)
        same(out, xs[1], "set [1]")
        out = hvd.allgather(tf.constant(xs[RANK]), process_set=ps_one)
        same(out, xs[1], "allgather in set [1]")
    else:
        expect_raises(ValueError, lambda: hvd.allreduce(tf.constant(xs[RANK]),
                                                        process_set=ps_one),
                      "non-member", "not a member")
    same(tf.function(lambda: hvd.process_set_included_op(ps_one.process_set_id))(),
         np.int32(1 if RANK == 1 else 0), "included_op")
    objs = hvd.allgather_object({"rank": RANK}, process_set=ps_both)
    if objs != [{"rank": 0}, {"rank": 1}]:
        fail(f"allgather_object in set: {objs}")
    hvd.barrier(process_set=ps_both)
    hvd.remove_process_set(ps_one)
    hvd.remove_process_set(ps_zero)


def check_objects():
    obj = {"rank": RANK, "data": list(range(RANK + 3))}
    got = hvd.broadcast_object(obj, root_rank=1)
    if got != {"rank": 1, "data": [0, 1, 2, 3]}:
        fail(f"broadcast_object: {got}")
    fn = hvd.broadcast_object_fn(root_rank=0)
    if fn("x" * (RANK + 1)) != "x":
        fail("broadcast_object_fn")
    all_objs = hvd.allgather_object(("r", RANK))
    if all_objs != [("r", r) for r in range(SIZE)]:
        fail(f"allgather_object: {all_objs}")
    @tf.function
    def traced():
        hvd.broadcast_object(1)

    expect_raises(ValueError, traced, "inside tf.function", "outside tf.function")


# ---------------------------------------------------------------------------- gradients
def grad_of(mode, fn, x):
    def g(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return y, tape.gradient(y, x)
    return MODES[mode](g)(x)


def check_gradients(mode):
    xs = inputs((3, 2), tf.float32, "grad")
    x = tf.constant(xs[RANK])
    w = np.arange(6, dtype=np.float32).reshape(3, 2) + 1
    # allreduce Average / Sum: d/dx_r sum(w * op(x)) = op applied to w over ranks.
    for op, factor in ((hvd.Average, 1.0), (hvd.Sum, float(SIZE))):
        _, g = grad_of(mode, lambda x: tf.reduce_sum(w * hvd.allreduce(x, op=op)), x)
        close(g, w * factor, f"allreduce op {op}")
    _, g = grad_of(mode, lambda x: tf.reduce_sum(
        w * hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1]), x)
    close(g, 2 * w * SIZE, "grouped_allreduce")
    # allgather (rank r contributes r + 1 rows): the gradient is this rank's rows of the
    # average over ranks of the incoming gradient.
    rows = RANK + 1
    xg = tf.constant(gen(RANK, (rows, 2), tf.float32, "gag"))
    total = sum(r + 1 for r in range(SIZE))
    wg = np.arange(total * 2, dtype=np.float32).reshape(total, 2)
    _, g = grad_of(mode, lambda x: tf.reduce_sum(wg * hvd.allgather(x)), xg)
    start = sum(r + 1 for r in range(RANK))
    close(g, wg[start:start + rows], "allgather")
    _, g = grad_of(mode, lambda x: tf.reduce_sum(wg * hvd.grouped_allgather([x, x])[1]), xg)
    close(g, wg[start:start + rows], "grouped_allgather")
    # broadcast from 1: only the root gets the (averaged) gradient.
    _, g = grad_of(mode, lambda x: tf.reduce_sum(w * hvd.broadcast(x, 1)), x)
    close(g, w if RANK == 1 else np.zeros_like(w), "broadcast")
    # alltoall: rows go back where they came from.
    xa = tf.constant(gen(RANK, (2 * SIZE, 2), tf.float32, "gaa"))
    wa = np.arange(4 * SIZE, dtype=np.float32).reshape(2 * SIZE, 2) + 10 * RANK
    _, g = grad_of(mode, lambda x: tf.reduce_sum(wa * hvd.alltoall(x)), xa)
    exp = np.concatenate([(np.arange(4 * SIZE, dtype=np.float32).reshape(2 * SIZE, 2)
                           + 10 * d)[2 * RANK:2 * RANK + 2] for d in range(SIZE)])
    close(g, exp, "alltoall")
    # reducescatter Sum: gradient = allgather of the incoming gradients * size (Horovod).
    xr = tf.constant(gen(RANK, (4, 2), tf.float32, "grs"))
    wr = [np.full((2, 2), float(r + 1), np.float32) for r in range(SIZE)]
    _, g = grad_of(mode, lambda x: tf.reduce_sum(wr[RANK] * hvd.reducescatter(x, op=hvd.Sum)),
                   xr)
    close(g, np.concatenate(wr) * SIZE, "reducescatter Sum")
    _, g = grad_of(mode, lambda x: tf.reduce_sum(
        wr[RANK] * hvd.reducescatter(x, op=hvd.Average)), xr)
    close(g, np.concatenate(wr), "reducescatter Average")
    # ...times both scale factors (Horovod's _reducescatter_grad), grouped alike.
    _, g = grad_of(mode, lambda x: tf.reduce_sum(wr[RANK] * hvd.reducescatter(
        x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0)), xr)
    close(g, np.concatenate(wr) * SIZE * 6.0, "reducescatter Sum pre=2 post=3")
    _, g = grad_of(mode, lambda x: tf.reduce_sum(wr[RANK] * hvd.grouped_reducescatter(
        [x, x], op=hvd.Average, postscale_factor=0.5)[1]), xr)
    close(g, np.concatenate(wr) * 0.5, "grouped_reducescatter Average post=0.5")


# ---------------------------------------------------------------------------- tape / optimizer
def _toy_problem():
    """A linear model; every rank's data and the global reference gradient."""
    rng = np.random.RandomState(7)
    w0 = rng.randn(3, 2).astype(np.float32)
    data = [gen(r, (4, 3), tf.float32, "tape") for r in range(SIZE)]
    return w0, data


def _loss(w, x):
    return tf.reduce_mean(tf.square(tf.matmul(x, w)))


def check_gradient_path(mode):
    """The gradient path of DistributedGradientTape: float32/float64/float16 gradients, a None
    gradient, an IndexedSlices gradient, a chain deep enough for the pacing edges, explicit
    groups, and results of earlier steps kept alive while later steps run (the reused output
    buffers must not overwrite them); against the single-process reference of every step.

    Eagerly that is one submission. A graph has two shapes (gradients._one_node): one node
    that submits every gradient once backprop has ended, where the engine sends a step as one
    bucket (ops.whole_pass, this 2-core machine), else per-gradient submit nodes and one
    collect node. The traced graph must have the shape this host calls for, and the check
    then runs again with the other shape forced, so both are tested on any machine."""
    if mode == "eager":
        return _gradient_path(MODES[mode], None)
    real = hgrads._one_node
    whole = hops.whole_pass()
    try:
        for one_node in (None, not whole):
            if one_node is not None:
                hgrads._one_node = lambda inputs, _v=one_node: _v
            _gradient_path(tf.function, whole if one_node is None else one_node)
    finally:
        hgrads._one_node = real


def _gradient_path(wrap, one_node):
    """check_gradient_path's steps through `wrap` (tf.function or not); `one_node`: the graph
    shape expected (None: eager)."""
    rng = np.random.RandomState(11)
    init = {"a": rng.randn(4, 3).astype(np.float32), "c": rng.randn(3, 3).astype(np.float64),
            "d": rng.randn(3, 2).astype(np.float32), "h": rng.randn(2).astype(np.float16),
            "emb": rng.randn(6, 2).astype(np.float32), "unused": np.zeros(2, np.float32)}
    var = {k: tf.Variable(v) for k, v in init.items()}
    order = ["a", "c", "d", "h", "emb", "unused"]

    def loss_of(v, x, ids):
        z = tf.tanh(tf.matmul(x, v["a"]))
        z = tf.cast(tf.tanh(tf.matmul(tf.cast(z, tf.float64), v["c"])), tf.float32)
        z = tf.matmul(z, v["d"])
        return (tf.reduce_sum(z * z) + tf.reduce_sum(tf.cast(v["h"], tf.float32) * x[0, :2])
                + 2.0 * tf.reduce_sum(tf.gather(v["emb"], ids)))

    def data(r, k):
        return (gen(r, (5, 4), tf.float32, f"gp{k}").astype(np.float32) / 4,
                np.array([(r + k) % 6, (2 * r + k + 1) % 6, 3], np.int32))

    def reference(k):
        dense = []
        for r in range(SIZE):
            v = {n: tf.Variable(init[n]) for n in order}
            x, ids = data(r, k)
            with tf.GradientTape() as tape:
                loss = loss_of(v, tf.constant(x), tf.constant(ids))
            gs = tape.gradient(loss, [v[n] for n in order])
            dense.append([None if g is None else to_np(tf.convert_to_tensor(g)) for g in gs])
        return [None if dense[0][i] is None else
                np.mean([d[i].astype(np.float64) for d in dense], axis=0)
                for i in range(len(order))]

    for groups in (None, [[var["a"], var["d"]], [var["c"], var["h"]]]):
        def step(x, ids):
            with tf.GradientTape() as tape:
                loss = loss_of(var, x, ids)
            tape = hvd.DistributedGradientTape(tape, groups=groups)
            return tape.gradient(loss, [var[n] for n in order])

        fn = wrap(step)
        kept = []
        for k in range(3):
            x, ids = data(RANK, k)
            kept.append(fn(tf.constant(x), tf.constant(ids)))
        shape = "eager" if one_node is None else "one node" if one_node else "per gradient"
        if one_node is not None:
            x, ids = data(RANK, 0)
            names = [op.name for op in
                     fn.get_concrete_function(tf.constant(x), tf.constant(ids)).graph
                     .get_operations() if op.type == "EagerPyFunc"]
            submits = [n for n in names if "HorovodSubmitGradients" in n]
            collects = [n for n in names if "HorovodAllreduceGradients" in n]
            if len(collects) != 1 or bool(submits) == one_node:
                fail(f"{shape}, groups={'explicit' if groups else None}: the traced graph's "
                     f"hvdlite nodes are {names}")
        for k, grads in enumerate(kept):
            ref = reference(k)
            what = f"{shape}, groups={'explicit' if groups else None} step {k}"
            for n, g, e in zip(order, grads, ref):
                if e is None or g is None:
                    if (e is None) != (g is None):
                        fail(f"{what} {n}: None-ness {g is None} != reference {e is None}")
                    continue
                if n == "emb" and not isinstance(g, tf.IndexedSlices):
                    fail(f"{what}: the embedding gradient is no longer tf.IndexedSlices")
                g = tf.convert_to_tensor(g)
                if g.dtype != var[n].dtype:
                    fail(f"{what} {n}: dtype {g.dtype.name} != {var[n].dtype.name}")
                tol = 2e-3 if n == "h" else 1e-5
                close(g, e, f"{what} {n}", rtol=tol, atol=tol)


def check_size_one_tape():
    """A tape over a one-member process set builds no hvdlite node at all in a graph (as
    Horovod builds no allreduce at size 1 outside elastic jobs) and returns the local
    gradients; the same tape over the global set does build its submit and collect nodes."""
    sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    try:
        w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
        x = tf.constant(np.full((4, 2), RANK + 1.0, np.float32))

        def traced(process_set):
            @tf.function
            def step(x):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
                tape = hvd.DistributedGradientTape(tape, process_set=process_set)
                return tape.gradient(loss, [w])[0]
            graph = step.get_concrete_function(x).graph
            kinds = {op.type for op in graph.get_operations()}
            return step(x), kinds

        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
        local = tape.gradient(loss, w)
        for ps in sets:         # a member on one rank, outside the set on the other
            g, kinds = traced(ps)
            if "EagerPyFunc" in kinds:
                fail(f"process set {ps.ranks}: the traced graph has hvdlite nodes "
                     f"(EagerPyFunc) although the set has one member")
            close(g, local.numpy(), f"process set {ps.ranks}: gradient", rtol=1e-6, atol=1e-6)
        g, kinds = traced(hvd.global_process_set)
        if "EagerPyFunc" not in kinds:
            fail("global set of 2 ranks: no submit/collect nodes in the traced graph")
    finally:
        for ps in sets:
            hvd.remove_process_set(ps)


def check_gradient_tape(mode):
    w0, data = _toy_problem()
    w = tf.Variable(w0)
    b = tf.Variable(np.ones(2, np.float32) * (RANK + 1))

    def step(x):
        with tf.GradientTape() as tape:
            loss = _loss(w, x) + tf.reduce_sum(b * float(RANK + 1))
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, [w, b])

    gw, gb = MODES[mode](step)(tf.constant(data[RANK]))
    ref = np.mean([_ref_grad(w0, d) for d in data], axis=0)
    close(gw, ref, "weights (Average)")
    close(gb, np.full(2, np.mean([r + 1 for r in range(SIZE)])), "bias")

    def entered(x):
        with hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum) as tape:
            loss = _loss(w, x)
        return tape.gradient(loss, {"w": w})["w"]

    close(MODES[mode](entered)(tf.constant(data[RANK])), ref * SIZE, "entered tape, Sum, dict")

    def partial(x):
        with tf.GradientTape() as tape:
            loss = _loss(w, x) + tf.reduce_sum(b * float(RANK + 1))
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16,
                                           gradient_predivide_factor=2.0, groups=1)
        tape.register_local_source(b)
        return tape.gradient(loss, [w, b])

    gw, gb = MODES[mode](partial)(tf.constant(data[RANK]))
    close(gw, ref, "fp16 + predivide + groups", rtol=2e-3, atol=2e-3)
    close(gb, np.full(2, (RANK + 1) / SIZE), "local source scaled by 1/size")
    expect_raises(ValueError, lambda: hvd.DistributedGradientTape(tf.GradientTape(),
                                                                  op=hvd.Sum,
                                                                  gradient_predivide_factor=2),
                  "predivide with Sum", "gradient_predivide_factor")


def _ref_grad(w0, x):
    w = tf.Variable(w0)
    with tf.GradientTape() as tape:
        loss = _loss(w, tf.constant(x))
    return tape.gradient(loss, w).numpy()


def check_partial_tape():
    import keras
    layer_a = keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)
    layer_b = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
    x = tf.constant(gen(RANK, (2, 3), tf.float32, "ptape"))
    layer_b(layer_a(x))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer_b(layer_a(x)))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[layer_b],
                                                  scale_local_gradients=False)
        return tape.gradient(loss, layer_a.trainable_weights + layer_b.trainable_weights)

    ga, gb = step(x)
    xs = [gen(r, (2, 3), tf.float32, "ptape") for r in range(SIZE)]
    ref_a = np.mean([np.repeat(xx.sum(0, keepdims=True).T, 2, axis=1) for xx in xs], axis=0)
    close(ga, ref_a, "global layer averaged")
    local_b = np.full((2, 1), to_np(x).sum(), np.float32)
    close(gb, local_b, "local layer kept local")


def check_tf1_optimizer(mode):
    w0, data = _toy_problem()
    w = tf.Variable(w0)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
    x = tf.constant(data[RANK])
    if mode == "eager":
        opt.minimize(lambda: _loss(w, x), var_list=[w])
    else:
        @tf.function
        def step():
            grads_and_vars = opt.compute_gradients(_loss(w, x), var_list=[w])
            opt.apply_gradients(grads_and_vars)
        step()
    ref = w0 - 0.5 * np.mean([_ref_grad(w0, d) for d in data], axis=0)
    close(w.read_value(), ref, "one step")
    # backward_passes_per_step=2: two local passes, one reduced update of the summed grads.
    w2 = tf.Variable(w0)
    opt2 = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                    backward_passes_per_step=2,
                                    average_aggregated_gradients=True)

    def two_passes():
        for k in range(2):
            xk = tf.constant(data[RANK] * (k + 1))
            loss = (lambda: _loss(w2, xk)) if tf.executing_eagerly() else _loss(w2, xk)
            gv = opt2.compute_gradients(loss, var_list=[w2])
            opt2.apply_gradients(gv)

    MODES[mode](two_passes)()
    g = np.mean([np.mean([_ref_grad(w0, d * (k + 1)) for k in range(2)], axis=0) for d in data],
                axis=0)
    close(w2.read_value(), w0 - 0.5 * g, "backward_passes_per_step=2")


def check_tf1_graph():
    """TF1 graph mode (tf.Graph + Session): collectives as graph nodes, chained in creation order,
    broadcast_global_variables, BroadcastGlobalVariablesHook and the TF1 DistributedOptimizer."""
    xs = inputs((2,), tf.float32, "tf1")
    with tf.Graph().as_default():
        x = tf.constant(xs[RANK])
        summed = hvd.allreduce(x, op=hvd.Sum)
        gathered = hvd.allgather(tf.reshape(x, [1, 2]))
        bcast = hvd.broadcast(x, 1)
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(xs[RANK]))
        loss = tf.reduce_sum(w * x)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train = opt.minimize(loss)
        sync = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(sync)
            same(sess.run(w), xs[0], "broadcast_global_variables")
            for _ in range(2):      # the same nodes run again: cached names
                s_, g_, b_ = sess.run([summed, gathered, bcast])
                same(s_, reduce_ref(xs, hvd.Sum), "allreduce")
                same(g_, np.stack(xs), "allgather")
                same(b_, xs[1], "broadcast")
            sess.run(train)
            same(sess.run(w), xs[0] - 0.5 * np.mean(xs, axis=0), "DistributedOptimizer step")
        hook = hvd.BroadcastGlobalVariablesHook(1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
            same(sess.run(w), xs[1], "BroadcastGlobalVariablesHook")
    expect_raises(RuntimeError, lambda: hvd.broadcast_global_variables(0), "eager",
                  "does not support eager execution")


def check_sync_batch_norm(mode):
    import keras
    n = 3 + RANK      # uneven local batches
    xs = [gen(r, (3 + r, 4), tf.float32, "sbn").astype(np.float32) * 0.5 + r for r in range(SIZE)]
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    ref = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3)
    layer.build((None, 4))
    ref.build((None, 4))
    wout = np.arange(4, dtype=np.float32) + 1

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * wout)
        gx, gg = tape.gradient(loss, [x, layer.gamma])
        return y, gx, gg

    y, gx, gg = MODES[mode](step)(tf.constant(xs[RANK]))
    full = tf.constant(np.concatenate(xs))
    with tf.GradientTape() as tape:
        tape.watch(full)
        yr = ref(full, training=True)
        lr = tf.reduce_sum(yr * wout)
    gxr, ggr = tape.gradient(lr, [full, ref.gamma])
    start = sum(3 + r for r in range(RANK))
    close(y, to_np(yr)[start:start + n], "output", rtol=1e-4, atol=1e-4)
    close(gx, to_np(gxr)[start:start + n], "input gradient", rtol=1e-4, atol=1e-4)
    # gamma's gradient stays local (DistributedOptimizer sums it): the ranks' parts add up.
    total = hvd.allreduce(gg, op=hvd.Sum)
    close(total, ggr, "gamma gradient over ranks", rtol=1e-4, atol=1e-4)
    close(layer.moving_mean, ref.moving_mean, "moving mean", rtol=1e-4, atol=1e-5)
    close(layer.moving_variance, ref.moving_variance, "moving variance", rtol=1e-4, atol=1e-5)
    expect_raises(ValueError, lambda: hvd.SyncBatchNormalization(fused=True), "fused", "fused")


# ---------------------------------------------------------------------------- errors
def check_mismatch_errors(mode):
    shape = (2, 3) if RANK == 0 else (3, 3)
    f = MODES[mode](lambda x: hvd.allreduce(x, name="mismatch.shape"))
    err = expect_raises(Exception, lambda: f(tf.zeros(shape)), "shape mismatch")
    msg = str(err)
    for needle in ("Mismatched", "mismatch.shape", "[2, 3]", "[3, 3]"):
        if needle not in msg:
            fail(f"shape mismatch message lacks {needle!r}: {msg[:600]}")
    dtype = tf.float32 if RANK == 0 else tf.float64
    g = MODES[mode](lambda x: hvd.allgather(x, name="mismatch.dtype"))
    err = expect_raises(Exception, lambda: g(tf.zeros((2,), dtype)), "dtype mismatch")
    msg = str(err)
    for needle in ("mismatch.dtype", "float32", "float64"):
        if needle not in msg:
            fail(f"dtype mismatch message lacks {needle!r}: {msg[:600]}")
    # The job is still usable afterwards.
    out = hvd.allreduce(tf.ones(2), op=hvd.Sum, name=f"after.{mode}")
    same(out, np.full(2, SIZE, np.float32), "collective after the errors")


def check_local_errors():
    expect_raises(ValueError, lambda: hvd.allreduce(tf.constant([True])), "bool allreduce",
                  "not supported for reductions")
    expect_raises(ValueError, lambda: hvd.allreduce(tf.constant(["a"])), "string allreduce",
                  "not supported")
    xla = tf.function(lambda x: hvd.allreduce(x), jit_compile=True)
    expect_raises(ValueError, lambda: xla(tf.ones(2)), "XLA", "jit_compile=False")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(object()), "bad optimizer",
                  "object")
    expect_raises(ValueError, lambda: hvd.allreduce(tf.ones(2), average=True, op=hvd.Sum),
                  "average and op", "supersedes")


def check_adasum(mode):
    """op=hvd.Adasum (Horovod's pairwise formula, per tensor): allreduce, grouped_allreduce
    and DistributedGradientTape(op=Adasum) against the NumPy reference (adasum_ref.py), and
    Horovod's errors, raised where the op is built."""
    from adasum_ref import adasum as adasum_ref
    wrap = MODES[mode]
    for dtype, tol in ((tf.float32, 1e-5), (tf.float64, 1e-12)):
        x = inputs((3, 5), dtype, f"ada.{mode}.{dtype.name}")
        f = wrap(lambda t: hvd.allreduce(t, op=hvd.Adasum, name=f"ada.{mode}.{dtype.name}"))
        close(f(tf.constant(x[RANK])), adasum_ref(x), f"allreduce {dtype.name}",
              rtol=tol, atol=tol)
    a, b = inputs((7,), tf.float32, f"ada.ga.{mode}"), inputs((2, 2), tf.float64,
                                                             f"ada.gb.{mode}")
    g = wrap(lambda p, q: hvd.grouped_allreduce([p, q], op=hvd.Adasum))
    got = g(tf.constant(a[RANK]), tf.constant(b[RANK]))
    close(got[0], adasum_ref(a), "grouped_allreduce [0]")
    close(got[1], adasum_ref(b), "grouped_allreduce [1]", rtol=1e-12, atol=1e-12)
    # The tape: each gradient reduced by Adasum, as Horovod's tape does.
    w0 = gen(0, (4, 2), tf.float32, f"ada.w.{mode}")
    data = inputs((3, 4), tf.float32, f"ada.x.{mode}")
    w = tf.Variable(w0)

    def loss_of(var, xx):
        return tf.reduce_sum(tf.tanh(tf.matmul(xx, var)))

    def step(xx):
        with tf.GradientTape() as tape:
            loss = loss_of(w, xx)
        return hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w])[0]

    got = wrap(step)(tf.constant(data[RANK]))
    per_rank = []
    for r in range(SIZE):
        v = tf.Variable(w0)
        with tf.GradientTape() as tape:
            loss = loss_of(v, tf.constant(data[r]))
        per_rank.append(tape.gradient(loss, v).numpy())
    close(got, adasum_ref(per_rank), "DistributedGradientTape(op=Adasum)")
    expect_raises(ValueError, lambda: wrap(lambda t: hvd.allreduce(t, op=hvd.Adasum))(
        tf.ones(2, tf.int32)), "integer Adasum", "floating-point")
    if mode == "eager":
        only0 = hvd.add_process_set([0])
        if RANK == 0:
            expect_raises(NotImplementedError, lambda: hvd.allreduce(
                tf.ones(2), op=hvd.Adasum, process_set=only0), "Adasum on a process set",
                "non-global process sets")
        hvd.remove_process_set(only0)
    expect_raises(NotImplementedError, lambda: hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum),
        "TF1 DistributedOptimizer(op=Adasum)", "delta formulation")


def check_one_rank_errors():
    """An argument error on one rank only (a string tensor, a scalar to gather, where the
    others pass valid float32): that rank raises its own error, and every other rank gets one
    that names the tensor, that rank and the reason at once (they waited for the stall
    shutdown, 600 s); named and unnamed, grouped; then the names work again."""
    odd = RANK == SIZE - 1

    def bad_dtype():
        return tf.constant(["a", "b", "c"]) if odd else tf.zeros((3,))

    def scalar():
        return tf.zeros(()) if odd else tf.zeros((SIZE,))

    calls = {
        "named allreduce": (lambda: hvd.allreduce(bad_dtype(), name="onerank.ar", op=hvd.Sum),
                            "not supported"),
        "unnamed allreduce": (lambda: hvd.allreduce(bad_dtype(), op=hvd.Sum), "not supported"),
        "grouped_allreduce": (lambda: hvd.grouped_allreduce([tf.ones(2), bad_dtype()],
                                                            name="onerank.group", op=hvd.Sum),
                              "not supported"),
        "allgather of a scalar": (lambda: hvd.allgather(scalar(), name="onerank.ag"),
                                  "at least one dimension"),
        "grouped_allgather": (lambda: hvd.grouped_allgather([tf.ones((2,)), scalar()]),
                              "at least one dimension"),
        "broadcast": (lambda: hvd.broadcast(bad_dtype(), 0, name="onerank.bc"),
                      "not supported"),
        "broadcast_variables": (lambda: hvd.broadcast_variables(
            [tf.Variable(tf.ones(2)), tf.Variable(bad_dtype())], 0), "not supported"),
        "reducescatter of a scalar": (lambda: hvd.reducescatter(scalar(), name="onerank.rs"),
                                      "at least one dimension"),
        "alltoall of a scalar": (lambda: hvd.alltoall(scalar(), name="onerank.a2a"),
                                 "at least one dimension"),
        "sparse allreduce": (lambda: hvd.allreduce(tf.IndexedSlices(
            bad_dtype(), tf.constant([0, 1, 2], tf.int64), tf.constant([4], tf.int64)),
            name="onerank.sparse"), "not supported"),
    }
    for what, (fn, reason) in calls.items():
        if odd:
            expect_raises(ValueError, fn, f"{what}, refused on rank {RANK}", reason)
        else:
            expect_raises(Exception, fn, f"{what}, when rank {SIZE - 1} refused it",
                          [f"invalid arguments on rank {SIZE - 1}", reason])
    # Models that differ (a variable more on the last rank): every rank fails at once.
    vs = [tf.Variable(tf.ones(2)) for _ in range(2 + odd)]
    expect_raises(Exception, lambda: hvd.broadcast_variables(vs, 0),
                  "broadcast_variables of different models",
                  ["Mismatched grouped BROADCAST", "with 2 tensors", "with 3 tensors"])
    # A model with no variables on one rank (not built there): it takes part with an empty
    # list, and every rank fails at once; in place as well; where every rank passes none,
    # nothing fails.
    expect_raises(Exception, lambda: hvd.broadcast_variables([] if odd else vs, 0),
                  "broadcast_variables of no variables on the last rank",
                  ["Mismatched grouped BROADCAST", "with 2 tensors",
                   f"rank {SIZE - 1} with no tensors (an empty list)"])
    expect_raises(Exception, lambda: hvd.broadcast_([] if odd else vs, 0),
                  "broadcast_ of no variables on the last rank",
                  ["Mismatched grouped BROADCAST", "with no tensors (an empty list)"])
    hvd.broadcast_variables([], 0)
    for fn, n in ((hvd.grouped_allreduce, "ALLREDUCE"), (hvd.grouped_allgather, "ALLGATHER"),
                  (hvd.grouped_reducescatter, "REDUCESCATTER")):
        expect_raises(tf.errors.FailedPreconditionError,
                      lambda: fn([] if odd else [tf.ones(2 * SIZE)] * 2, name=f"empty.{n}"),
                      f"{fn.__name__} of no tensors on the last rank",
                      [f"Mismatched grouped {n} in group 'empty.{n}'", "with 2 tensors",
                       f"rank {SIZE - 1} with no tensors (an empty list)"])
        assert list(fn([], name=f"none.{n}")) == [], f"{fn.__name__}([]) on every rank"
    hvd.broadcast_variables(vs[:2], 0)             # used alike afterwards
    same(hvd.allreduce(tf.ones(3), name="onerank.ar", op=hvd.Sum), np.full(3, SIZE, np.float32),
         "'onerank.ar' used alike afterwards")
    same(hvd.allgather(tf.ones((1,)), name="onerank.ag"), np.ones(SIZE, np.float32),
         "'onerank.ag' used alike afterwards")


TF_NAMES = """init shutdown is_initialized start_timeline stop_timeline size local_size cross_size
rank local_rank cross_rank is_homogeneous rank_op local_rank_op size_op local_size_op
process_set_included_op mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built
nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product
handle_average_backwards_compatibility check_num_rank_power_of_2 join allreduce grouped_allreduce
allgather grouped_allgather broadcast broadcast_ alltoall reducescatter grouped_reducescatter
barrier broadcast_variables broadcast_object broadcast_object_fn allgather_object
broadcast_global_variables BroadcastGlobalVariablesHook Compression DistributedOptimizer
DistributedGradientTape PartialDistributedGradientTape SyncBatchNormalization
LocalGradientAggregationHelper HorovodInternalError elastic""".split()
KERAS_NAMES = """init shutdown size rank local_rank local_size DistributedOptimizer
broadcast_global_variables allreduce allgather broadcast reducescatter load_model callbacks
elastic Compression Average Sum ProcessSet global_process_set""".split()
SIGNATURES = {
    "allreduce": "tensor average device_dense device_sparse compression op prescale_factor "
                 "postscale_factor name process_set ignore_name_scope",
    "allgather": "tensor name ignore_name_scope process_set",
    "broadcast": "tensor root_rank name ignore_name_scope process_set",
    "alltoall": "tensor splits name ignore_name_scope process_set",
    "reducescatter": "tensor device_dense compression op name process_set ignore_name_scope "
                     "prescale_factor postscale_factor",
    "broadcast_variables": "variables root_rank process_set inplace",
    "broadcast_object": "obj root_rank session name process_set",
    "DistributedGradientTape": "gradtape device_dense device_sparse compression sparse_as_dense "
                               "op gradient_predivide_factor num_groups groups process_set "
                               "scale_local_gradients",
    "DistributedOptimizer": "optimizer name use_locking device_dense device_sparse compression "
                            "sparse_as_dense backward_passes_per_step op "
                            "gradient_predivide_factor average_aggregated_gradients num_groups "
                            "groups process_set scale_local_gradients",
}


def check_unnamed_steady():
    """Eager collectives without a name are named by their line and cached: a loop of them (a
    logged loss, averaged metrics, gathered predictions, a broadcast, a reduce-scatter)
    reaches the steady state and sends nothing to the coordinator, each with the reference
    result."""
    from hvdlite.common import basics

    def ref(k, shape, tag):
        return inputs(shape, tf.float32, f"un{tag}{k}")

    for k in range(14):
        if k == 6:
            before = basics.engine_counters()
        x = ref(k, (2,), "ar")
        close(hvd.allreduce(tf.constant(x[RANK]), op=hvd.Sum), sum(x), f"allreduce, step {k}")
        a, b = ref(k, (3,), "ga"), ref(k, (2, 2), "gb")
        got = hvd.grouped_allreduce([tf.constant(a[RANK]), tf.constant(b[RANK])], op=hvd.Sum)
        close(got[0], sum(a), f"grouped_allreduce [0], step {k}")
        close(got[1], sum(b), f"grouped_allreduce [1], step {k}")
        g = ref(k, (2, 3), "ag")
        close(hvd.allgather(tf.constant(g[RANK])), np.concatenate(g), f"allgather, step {k}")
        c = ref(k, (4,), "bc")
        close(hvd.broadcast(tf.constant(c[RANK]), root_rank=1), c[1], f"broadcast, step {k}")
        rs = ref(k, (2 * SIZE, 2), "rs")
        close(hvd.reducescatter(tf.constant(rs[RANK]), op=hvd.Sum),
              my_rows(sum(rs), RANK), f"reducescatter, step {k}")
    after = basics.engine_counters()
    if after["coordinator_messages"] != before["coordinator_messages"] \
            or after["steady_entered"] < 1:
        fail(f"unnamed eager collectives did not stay in the steady state: {before} -> {after}")


def check_eager_without_tape():
    """Executing eagerly with no tape active, a collective runs without tf.custom_gradient
    (bridge._nothing_records: ~0.4 ms a call) and gives the reference result; under a tape
    the same call goes through it and its gradient is right. Seen by counting the decorations
    hvdlite asks for."""
    from hvdlite.tensorflow import bridge
    real, made = bridge.tf.custom_gradient, []

    def counting(f):
        made.append(f)
        return real(f)

    xs = inputs((3, 2), tf.float32, "notape")
    x = tf.constant(xs[RANK])
    bridge.tf.custom_gradient = counting
    try:
        close(hvd.allreduce(x, op=hvd.Sum), sum(xs), "allreduce, no tape")
        close(hvd.allgather(x), np.concatenate(xs), "allgather, no tape")
        close(hvd.broadcast(x, 1), xs[1], "broadcast, no tape")
        if made:
            fail(f"with no tape active, {len(made)} collectives still went through "
                 f"tf.custom_gradient")
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * 3.0)
        close(tape.gradient(y, x), np.full((3, 2), 3.0 * SIZE), "allreduce gradient under a tape")
        if len(made) != 1:
            fail(f"under a tape the allreduce made {len(made)} tf.custom_gradient decorations, "
                 f"not 1")
    finally:
        bridge.tf.custom_gradient = real


def check_autograph_leaves_hvdlite_alone():
    """A tf.function's first trace rewrites only the user's functions: AutoGraph calls
    hvdlite's (the tape, the optimizer, the collectives, hvd.rank) as they are, as it does
    TensorFlow's and Keras's. Seen through AutoGraph's own log (level 2 names every function it
    runs converted: "Calling <function ...tf__<name> ...>"), and the step's result still
    checked against a single-process reference."""
    import contextlib
    import io
    import re

    import keras

    import hvdlite.tensorflow.keras as hk
    w0 = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
    w = tf.Variable(w0)
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.5))
    xs = [np.full((4, 3), r + 1.0, np.float32) for r in range(SIZE)]

    def user_loss(x):
        return tf.reduce_sum(tf.matmul(x, w) ** 2)

    @tf.function
    def user_step(x):
        with tf.GradientTape() as tape:
            loss = user_loss(x)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, [w])
        opt.apply_gradients(zip(grads, [w]))
        return hvd.allreduce(loss, op=hvd.Sum, name="ag.loss") + float(hvd.rank() * 0)

    log = io.StringIO()
    tf.autograph.set_verbosity(2, alsologtostdout=True)
    try:
        with contextlib.redirect_stdout(log):
            loss = user_step(tf.constant(xs[RANK]))
    finally:
        tf.autograph.set_verbosity(0)
    converted = set(re.findall(r"Calling <function (?:[\w<>.]*\.)?tf__(\w+) at", log.getvalue()))
    if not converted:
        fail("AutoGraph's log named no converted function at all: the check sees nothing "
             f"(log of {len(log.getvalue())} characters)")
    extra = converted - {"user_step", "user_loss"}
    if extra:
        fail(f"AutoGraph rewrote functions that are not the user's: {sorted(extra)}")
    grad = np.mean([2 * x.T @ (x @ w0) for x in xs], axis=0)
    close(w.numpy(), w0 - 0.5 * grad, "weights after one step", rtol=1e-5, atol=1e-6)
    close(loss, sum(float(np.sum((x @ w0) ** 2)) for x in xs), "summed loss", rtol=1e-5)


def check_api():
    import inspect

    import hvdlite.tensorflow.keras as hk
    for n in TF_NAMES:
        if not hasattr(hvd, n):
            fail(f"hvdlite.tensorflow lacks {n}")
    for n in KERAS_NAMES:
        if not hasattr(hk, n):
            fail(f"hvdlite.tensorflow.keras lacks {n}")
    for n in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
              "LearningRateScheduleCallback", "LearningRateWarmupCallback",
              "BestModelCheckpoint"):
        if not hasattr(hk.callbacks, n):
            fail(f"callbacks lack {n}")
    for n in ("KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
              "UpdateEpochStateCallback", "run"):
        if not hasattr(hk.elastic, n):
            fail(f"keras.elastic lacks {n}")
    for n in ("run", "TensorFlowKerasState", "TensorFlowState"):
        if not hasattr(hvd.elastic, n):
            fail(f"tensorflow.elastic lacks {n}")
    for fn, params in SIGNATURES.items():
        got = list(inspect.signature(getattr(hvd, fn)).parameters)
        if got[:len(params.split())] != params.split():
            fail(f"{fn}{tuple(got)} != Horovod's {tuple(params.split())}")
    got = list(inspect.signature(hk.DistributedOptimizer).parameters)
    want = ("optimizer name device_dense device_sparse compression sparse_as_dense "
            "gradient_predivide_factor op backward_passes_per_step average_aggregated_gradients "
            "num_groups groups process_set scale_local_gradients").split()
    if got != want:
        fail(f"keras DistributedOptimizer{tuple(got)}")


def main():
    check("topology", check_topology)
    check("api", check_api)
    for mode in MODES:
        for opname in OPS:
            check(f"allreduce_{opname}_{mode}", check_allreduce, mode, opname)
        check(f"allreduce_variants_{mode}", check_allreduce_variants, mode)
        check(f"grouped_allreduce_{mode}", check_grouped_allreduce, mode)
        check(f"sparse_allreduce_{mode}", check_sparse_allreduce, mode)
        check(f"allgather_{mode}", check_allgather, mode)
        check(f"broadcast_{mode}", check_broadcast, mode)
        check(f"broadcast_inplace_{mode}", check_broadcast_inplace, mode)
        check(f"alltoall_{mode}", check_alltoall, mode)
        check(f"reducescatter_{mode}", check_reducescatter, mode)
        check(f"join_barrier_{mode}", check_join_barrier, mode)
        check(f"gradients_{mode}", check_gradients, mode)
        check(f"gradient_tape_{mode}", check_gradient_tape, mode)
        check(f"gradient_path_{mode}", check_gradient_path, mode)
        check(f"tf1_optimizer_{mode}", check_tf1_optimizer, mode)
        check(f"sync_batch_norm_{mode}", check_sync_batch_norm, mode)
        check(f"mismatch_errors_{mode}", check_mismatch_errors, mode)
        check(f"adasum_{mode}", check_adasum, mode)
    check("tf1_graph", check_tf1_graph)
    check("uneven_join", check_uneven_join)
    check("process_sets", check_process_sets)
    check("objects", check_objects)
    check("partial_tape", check_partial_tape)
    check("size_one_tape", check_size_one_tape)
    check("local_errors", check_local_errors)
    check("one_rank_errors", check_one_rank_errors)
    check("unnamed_steady", check_unnamed_steady)
    check("eager_without_tape", check_eager_without_tape)
    check("autograph_leaves_hvdlite_alone", check_autograph_leaves_hvdlite_alone)
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main()
