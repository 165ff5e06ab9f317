"""Horovod 0.28's behaviours (exception classes, accepted arguments, result dtypes) of
hvdlite.tensorflow, eagerly and inside tf.function, on every rank (issue 10).

Horovod's TF collectives are op kernels: cross-rank mismatches raise
tf.errors.FailedPreconditionError, invalid arguments tf.errors.InvalidArgumentError, in both
modes. hvdlite's eager errors are also hvdlite's own classes (HorovodInternalError, ValueError).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from tf_common import check, close, expect_raises, fail, finish, same  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
MODES = {"eager": lambda f: f, "function": tf.function}
FP = tf.errors.FailedPreconditionError
IA = tf.errors.InvalidArgumentError


def _mismatch(mode, what, fn, needles):
    err = expect_raises(FP, fn, f"{what} ({mode})")
    if err is None:
        return
    if mode == "eager" and not isinstance(err, hvd.HorovodInternalError):
        fail(f"{what}: eager error is not also a HorovodInternalError: {type(err).__mro__}")
    for needle in needles:
        if needle not in str(err):
            fail(f"{what}: message lacks {needle!r}: {str(err)[:500]}")


def check_mismatch(mode):
    wrap = MODES[mode]
    n = 2 + (RANK % 2)          # ranks disagree on the shape
    f = wrap(lambda x: hvd.allreduce(x, name=f"cmp.ar.{mode}"))
    _mismatch(mode, "allreduce shape", lambda: f(tf.zeros((n, 3))), [f"cmp.ar.{mode}"])
    dtype = tf.float32 if RANK == 0 else tf.float64
    g = wrap(lambda x: hvd.allgather(x, name=f"cmp.ag.{mode}"))
    _mismatch(mode, "allgather dtype", lambda: g(tf.zeros((2,), dtype)), ["float32", "float64"])
    b = wrap(lambda x: hvd.broadcast(x, root_rank=RANK % 2, name=f"cmp.bc.{mode}"))
    _mismatch(mode, "broadcast root", lambda: b(tf.zeros((2,))), [f"cmp.bc.{mode}"])
    r = wrap(lambda x: hvd.reducescatter(x, name=f"cmp.rs.{mode}", op=hvd.Sum))
    _mismatch(mode, "reducescatter shape", lambda: r(tf.zeros((SIZE * n, 2))),
              [f"cmp.rs.{mode}"])
    a = wrap(lambda x: hvd.alltoall(x, name=f"cmp.a2a.{mode}"))
    _mismatch(mode, "alltoall dtype",
              lambda: a(tf.zeros((SIZE, 2), tf.float32 if RANK == 0 else tf.int32)),
              [f"cmp.a2a.{mode}"])
    out = hvd.allreduce(tf.ones(2), op=hvd.Sum, name=f"cmp.after.{mode}")
    same(out, np.full(2, SIZE, np.float32), "a collective after the errors")


def check_invalid(mode):
    wrap = MODES[mode]
    a = wrap(lambda x: hvd.alltoall(x))
    err = expect_raises(IA, lambda: a(tf.zeros((SIZE + 1, 2))), "alltoall uneven dim0",
                        "divide evenly")
    if mode == "eager" and err is not None and not isinstance(err, ValueError):
        fail("eager InvalidArgumentError is not also a ValueError")
    s = wrap(lambda x, sp: hvd.alltoall(x, splits=sp))
    bad = tf.constant([1] * SIZE, tf.int32)           # sums to SIZE, tensor has SIZE + 2 rows
    expect_raises(IA, lambda: s(tf.zeros((SIZE + 2, 2)), bad), "alltoall splits sum", "sum to")
    expect_raises(ValueError, lambda: hvd.alltoall(tf.zeros((SIZE, 2)),
                                                   splits=tf.ones([SIZE], tf.float32)),
                  "float splits")
    expect_raises(ValueError, lambda: hvd.alltoall(tf.zeros((SIZE, 2)),
                                                   splits=tf.ones([SIZE], tf.int64)),
                  "int64 splits")
    if mode == "eager":
        # Arguments checked before anything runs come out as Horovod's kernels return them,
        # InvalidArgumentError, and are still ValueError (they were the bare ValueError).
        for what, fn in [
                ("int64 splits", lambda: hvd.alltoall(tf.zeros((SIZE, 2)),
                                                      splits=tf.ones([SIZE], tf.int64))),
                ("reducescatter of a scalar", lambda: hvd.reducescatter(tf.constant(1.0))),
                ("allgather of a scalar", lambda: hvd.allgather(tf.constant(1.0))),
                ("allreduce of bool", lambda: hvd.allreduce(tf.constant([True]))),
                ("grouped_allreduce of complex", lambda: hvd.grouped_allreduce(
                    [tf.constant([1j])]))]:
            err = expect_raises(IA, fn, what)
            if err is not None and not isinstance(err, ValueError):
                fail(f"{what}: InvalidArgumentError that is not also a ValueError")
    # Python lists and numpy int arrays are accepted, as in Horovod.
    out, recv = hvd.alltoall(tf.ones((SIZE, 2)), splits=np.ones(SIZE, np.int64))
    same(recv, np.ones(SIZE, np.int32), "recv splits from numpy splits")
    out, recv = hvd.alltoall(tf.ones((SIZE, 2)), splits=[1] * SIZE)
    same(out, np.ones((SIZE, 2), np.float32), "alltoall with list splits")


def check_sparse_dtype(mode):
    wrap = MODES[mode]
    values = tf.constant(np.arange(6, dtype=np.int32).reshape(3, 2) + RANK)
    sl = tf.IndexedSlices(values, tf.constant([0, 1, 2], tf.int64), tf.constant([4, 2], tf.int64))

    def single(v):
        return hvd.allreduce(tf.IndexedSlices(v, sl.indices, sl.dense_shape), op=hvd.Average).values

    gathered = np.concatenate([np.arange(6, dtype=np.int32).reshape(3, 2) + r
                               for r in range(SIZE)])
    expected = gathered / np.float64(SIZE)    # TF: int32 / int32 -> float64, as Horovod's
    out = wrap(single)(values)
    same(out, expected, "averaged int32 IndexedSlices")

    def grouped(v, d):
        res = hvd.grouped_allreduce([tf.IndexedSlices(v, sl.indices, sl.dense_shape), d],
                                    op=hvd.Average)
        return res[0].values, res[1]

    gv, gd = wrap(grouped)(values, tf.constant([2.0 * RANK]))
    same(gv, expected, "grouped mixed: averaged int32 IndexedSlices")
    close(gd, np.array([float(SIZE - 1)], np.float32), "grouped mixed: dense part")
    f16 = tf.cast(values, tf.int16)
    out16 = wrap(single)(f16)
    if out16.dtype != tf.float32:     # int16 / int16 -> float32 in TensorFlow
        fail(f"averaged int16 IndexedSlices dtype {out16.dtype.name}, expected float32")


def check_partial_tape_variables(mode):
    import keras
    k_var = keras.Variable(np.ones((2,), np.float32), name="k3var")
    t_var = tf.Variable(np.ones((2,), np.float32), name="tfvar")
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    x = tf.constant([[1.0 + RANK, 2.0]])
    local(x)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(k_var * x) + tf.reduce_sum(t_var * x) + \
                tf.reduce_sum(local(x))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=local,
                                                  scale_local_gradients=False)
        return tape.gradient(loss, [k_var, t_var] + local.trainable_weights)

    gk, gt, gl = MODES[mode](step)(x)
    mean = np.array([1.0 + (SIZE - 1) / 2.0, 2.0], np.float32)
    close(gk, mean, "keras.Variable gradient averaged")
    close(gt, mean, "tf.Variable gradient averaged")
    close(gl, np.array([[1.0 + RANK], [2.0]], np.float32), "local layer gradient local")
    # register_local_source with a Keras 3 variable (horovod#4290's `.ref`)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(k_var * x)
    tape = hvd.PartialDistributedGradientTape(tape)
    tape.register_local_source(k_var)
    (g,) = tape.gradient(loss, [k_var])
    close(g, to_local(x), "registered local keras.Variable")
    # Horovod's get_local_and_global_gradients: (source, gradient) pairs, local ones first;
    # and gradient()'s fourth positional parameter is use_generic_names.
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(k_var * x) + tf.reduce_sum(t_var * x)
    tape = hvd.PartialDistributedGradientTape(tape, scale_local_gradients=False)
    tape.register_local_source(k_var)
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, [k_var, t_var])
    if [s is k_var for s, _ in local_pairs] != [True] or \
            [s is t_var for s, _ in global_pairs] != [True]:
        raise AssertionError(f"get_local_and_global_gradients: {local_pairs}, {global_pairs}")
    close(local_pairs[0][1], x.numpy()[0], "local (source, gradient) pair")
    close(global_pairs[0][1], mean, "global (source, gradient) pair")
    (g,) = tape.gradient(loss, [t_var], None, True)
    close(g, mean, "gradient(target, sources, None, True): use_generic_names positional")


def to_local(x):
    return x.numpy()[0] / SIZE       # scale_local_gradients=True divides by the set size


def check_sync_batch_norm():
    import keras
    layer = hvd.SyncBatchNormalization(axis=-1)
    x = tf.constant(np.arange(8, dtype=np.float32).reshape(4, 2) + 4 * RANK)
    y = layer(x, training=True)
    full = np.concatenate([np.arange(8, dtype=np.float32).reshape(4, 2) + 4 * r
                           for r in range(SIZE)])
    ref = (to_np_local(x) - full.mean(0)) / np.sqrt(full.var(0) + layer.epsilon)
    close(y, ref, "synced batch statistics", rtol=1e-4, atol=1e-4)
    if "fused" in layer.get_config() and keras.__version__.startswith("3"):
        fail("Keras 3 layer config carries fused")


def to_np_local(x):
    return x.numpy()


def check_process_set_args():
    ps = hvd.ProcessSet(reversed(range(1, SIZE)))
    if ps.ranks != list(range(1, SIZE)):
        fail(f"ProcessSet(reversed(...)).ranks = {ps.ranks}")
    if hvd.ProcessSet(np.array([1, 0])).ranks != [0, 1]:
        fail("ProcessSet(numpy array) not sorted")
    if hvd.ProcessSet({1, 0}).ranks != [0, 1]:
        fail("ProcessSet(set) not sorted")
    expect_raises(ValueError, lambda: hvd.ProcessSet("01"), "ProcessSet(str)")


def check_scalars_and_arrays(mode):
    # Python scalars, numpy arrays and lists are accepted as tensors, as Horovod's
    # tf.convert_to_tensor does; results keep the input's dtype.
    out = hvd.allreduce(3, op=hvd.Sum)
    same(out, np.int32(3 * SIZE), "allreduce of a Python int")
    out = hvd.allreduce(np.array([1.5, 2.5]), op=hvd.Average)
    same(out, np.array([1.5, 2.5]), "allreduce of a float64 numpy array")
    out = hvd.allgather([[RANK]])
    same(out, np.arange(SIZE, dtype=np.int32).reshape(SIZE, 1), "allgather of a list")
    out = hvd.broadcast(np.float32(RANK), root_rank=0)
    same(out, np.float32(0), "broadcast of a numpy scalar")
    out = hvd.allreduce(tf.constant([2, 3]))             # default op Average, int32 stays int32
    same(out, np.array([2, 3], np.int32), "Average of int32 keeps int32")


def check_duplicate_sets():
    hvd.shutdown()
    sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 0])]
    expect_raises(ValueError, lambda: hvd.init(process_sets=sets), "duplicate process sets",
                  "pass each process set once")
    hvd.init()
    out = hvd.allreduce(tf.ones(1), op=hvd.Sum, name="cmp.after.reinit")
    same(out, np.full(1, SIZE, np.float32), "usable after the refused init")


def main():
    for mode in MODES:
        check(f"mismatch_{mode}", check_mismatch, mode)
        check(f"invalid_{mode}", check_invalid, mode)
        check(f"sparse_dtype_{mode}", check_sparse_dtype, mode)
        check(f"partial_tape_{mode}", check_partial_tape_variables, mode)
    check("scalars_and_arrays", check_scalars_and_arrays, "eager")
    check("sync_batch_norm", check_sync_batch_norm)
    check("process_set_args", check_process_set_args)
    check("duplicate_sets", check_duplicate_sets)
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main()
