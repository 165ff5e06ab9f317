"""hvdlite.jax on real ranks: every collective eagerly and inside jax.jit against single-process
references, its gradient, the cross-rank errors in both modes, zero-copy DLPack, the pytree
broadcast, and a custom training loop (optax, and the optax-free GradientTransformation) that
equals one process on the global batch. One launch, many named checks."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hvdlite.jax as hvd  # noqa: E402
from harness import check, expect_raises, fail, finish  # noqa: E402
from hvdlite.jax import bridge  # noqa: E402

jax.config.update("jax_enable_x64", True)
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
MODES = {"eager": lambda f: f, "jit": jax.jit}
OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}


def close(got, want, what, tol=1e-6):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or \
            not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol):
        fail(f"{what}: got {got.dtype}{got.shape} {got.reshape(-1)[:6]}, want "
             f"{want.dtype}{want.shape} {want.reshape(-1)[:6]}")


def gen(rank, shape, dtype, salt):
    rng = np.random.RandomState(1000 * salt + rank)
    return (rng.randint(1, 4, size=shape) if np.issubdtype(dtype, np.integer)
            else rng.uniform(0.5, 2.0, size=shape)).astype(dtype)


def reduce_ref(xs, op, pre=1.0, post=1.0):
    s = np.stack([x.astype(np.float64) for x in xs]) * pre
    red = {hvd.Average: s.sum(0) / len(xs), hvd.Sum: s.sum(0), hvd.Min: s.min(0),
           hvd.Max: s.max(0), hvd.Product: s.prod(0)}[op] * post
    return red.astype(xs[0].dtype)


# ---------------------------------------------------------------------------- collectives
def check_allreduce(mode):
    wrap = MODES[mode]
    for k, (opname, op) in enumerate(OPS.items()):
        for dtype in (np.float32, np.float64, np.int32):
            xs = [gen(r, (3, 2), dtype, k) for r in range(SIZE)]
            if op == hvd.Average and dtype == np.int32:
                continue
            f = wrap(lambda x: hvd.allreduce(x, op=op, name=f"ar.{mode}.{opname}"))
            want = reduce_ref(xs, op)
            close(f(jnp.asarray(xs[RANK])), want, f"allreduce {opname} {dtype.__name__}")
    xs = [gen(r, (5,), np.float32, 9) for r in range(SIZE)]
    f = wrap(lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0))
    close(f(jnp.asarray(xs[RANK])), reduce_ref(xs, hvd.Sum, 0.5, 3.0), "prescale/postscale")
    f = wrap(lambda x: hvd.allreduce(x, compression=hvd.Compression.fp16))
    close(f(jnp.asarray(xs[RANK])), reduce_ref(xs, hvd.Average), "fp16 compression", 1e-2)
    for rep in range(3):      # unnamed: one stable name per line, cached, every repetition
        close(wrap(lambda x: hvd.allreduce(x))(jnp.asarray(xs[RANK])),
              reduce_ref(xs, hvd.Average), f"unnamed, repetition {rep}")


def check_grouped(mode):
    wrap = MODES[mode]
    xs = [[gen(r, (4,), np.float32, 20), gen(r, (2, 3), np.float64, 21)] for r in range(SIZE)]
    f = wrap(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum, name=f"g.{mode}"))
    out = f(jnp.asarray(xs[RANK][0]), jnp.asarray(xs[RANK][1]))
    for i in range(2):
        close(out[i], reduce_ref([x[i] for x in xs], hvd.Sum), f"grouped member {i}")
    g = wrap(lambda a, b: hvd.grouped_allgather([a, b]))
    out = g(jnp.asarray(xs[RANK][0]), jnp.asarray(xs[RANK][1]))
    for i in range(2):
        close(out[i], np.concatenate([x[i] for x in xs]), f"grouped_allgather member {i}")
    h = wrap(lambda a: hvd.grouped_reducescatter([a, a * 2], op=hvd.Sum))
    rows = [gen(r, (SIZE * 2, 3), np.float32, 22) for r in range(SIZE)]
    out = h(jnp.asarray(rows[RANK]))
    total = np.stack(rows).sum(0)
    close(out[0], total[RANK * 2:(RANK + 1) * 2], "grouped_reducescatter 0")
    close(out[1], 2 * total[RANK * 2:(RANK + 1) * 2], "grouped_reducescatter 1")
    if mode == "eager" and hvd.grouped_allreduce([]) != []:
        fail("grouped_allreduce([]) is not []")


def check_move(mode):
    wrap = MODES[mode]
    xs = [gen(r, (2, 3), np.float32, 30) for r in range(SIZE)]
    close(wrap(lambda x: hvd.allgather(x, name=f"ag.{mode}"))(jnp.asarray(xs[RANK])),
          np.concatenate(xs), "allgather")
    close(wrap(lambda x: hvd.broadcast(x, SIZE - 1))(jnp.asarray(xs[RANK])), xs[SIZE - 1],
          "broadcast from the last rank")
    big = [gen(r, (SIZE * 3 + 1, 2), np.int64, 31) for r in range(SIZE)]
    out = wrap(lambda x: hvd.reducescatter(x, op=hvd.Sum))(jnp.asarray(big[RANK]))
    total = np.stack(big).sum(0)
    counts = [3 + (1 if r < 1 else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    close(out, total[start:start + counts[RANK]], "reducescatter, uneven rows")
    a2a = [np.arange(SIZE * 2, dtype=np.float32) + 100 * r for r in range(SIZE)]
    out, recv = wrap(lambda x: hvd.alltoall(x))(jnp.asarray(a2a[RANK]))
    close(out, np.concatenate([a[RANK * 2:(RANK + 1) * 2] for a in a2a]), "alltoall")
    close(recv, np.full(SIZE, 2, np.int32), "alltoall received splits")
    if mode == "eager":
        # First dimensions that differ, and alltoall splits: eagerly only.
        mine = np.full((RANK + 1, 2), RANK, np.float32)
        close(hvd.allgather(jnp.asarray(mine)),
              np.concatenate([np.full((r + 1, 2), r, np.float32) for r in range(SIZE)]),
              "allgather of unequal first dimensions")
        splits = [1 + r for r in range(SIZE)]
        x = jnp.arange(sum(splits), dtype=jnp.float32) + 10 * RANK
        out, recv = hvd.alltoall(x, splits=splits)
        want = np.concatenate([np.arange(sum(splits), dtype=np.float32)[
            sum(splits[:RANK]):sum(splits[:RANK + 1])] + 10 * r for r in range(SIZE)])
        close(out, want, "alltoall with splits")
        close(recv, np.full(SIZE, splits[RANK], np.int32), "alltoall splits received")


def check_gradient():
    xs = [gen(r, (4,), np.float32, 40) for r in range(SIZE)]
    x = jnp.asarray(xs[RANK])
    grad = jax.jit(jax.grad(lambda a: jnp.sum(hvd.allreduce(a, op=hvd.Sum) * a)))(x)
    # d/da_me sum(S * a_me) = S + sum over ranks of a_r (the cotangent a, reduced the same way)
    total = np.stack(xs).sum(0)
    close(grad, total + total, "gradient of allreduce(Sum) under jit")
    grad = jax.grad(lambda a: jnp.sum(hvd.allreduce(a) ** 2))(x)
    avg = total / SIZE
    close(grad, (2 * avg).astype(np.float32), "gradient of allreduce under jax.grad")


def check_objects_and_control():
    obj = hvd.broadcast_object({"rank": RANK, "list": [RANK] * 3}, root_rank=SIZE - 1)
    if obj != {"rank": SIZE - 1, "list": [SIZE - 1] * 3}:
        fail(f"broadcast_object {obj}")
    got = hvd.allgather_object(("r", RANK))
    if got != [("r", r) for r in range(SIZE)]:
        fail(f"allgather_object {got}")
    hvd.barrier()
    last = hvd.join()
    if last not in range(SIZE):
        fail(f"join returned {last}")
    tree = {"w": jnp.full((2, 2), float(RANK)), "layers": [jnp.arange(3) + RANK, jnp.ones(1)]}
    out = hvd.broadcast_parameters(tree, root_rank=SIZE - 1)
    close(out["w"], np.full((2, 2), float(SIZE - 1)), "broadcast_parameters w")
    close(out["layers"][0], np.arange(3) + SIZE - 1, "broadcast_parameters layers[0]")
    close(jax.jit(lambda t: hvd.broadcast_parameters(t, 0))(tree)["w"], np.zeros((2, 2)),
          "broadcast_parameters under jit")


def check_elastic_state():
    """A pytree of parameters in an ObjectState: restored to the last save, and synced from
    sync_root (the rank the reset agreement chose) with the other attributes."""
    tree = {"w": jnp.full((2,), float(RANK)), "b": [jnp.ones(1) * RANK]}
    state = hvd.elastic.ObjectState(params=tree, epoch=RANK)
    state.params = jax.tree.map(lambda a: a + 100.0, state.params)
    state.restore()
    close(state.params["w"], np.full(2, float(RANK)), "restored to the last save")
    state._sync_root = SIZE - 1           # what the reset agreement sets (common/elastic.py)
    state.sync()
    close(state.params["b"][0], np.ones(1) * (SIZE - 1), "params synced from sync_root")
    if state.epoch != SIZE - 1:
        fail(f"epoch {state.epoch} not synced from sync_root")


def check_zero_copy():
    x = jnp.arange(16, dtype=jnp.float32)
    buf = bridge.to_buffer(x)
    if buf.data_ptr() != x.unsafe_buffer_pointer():
        fail("jax.Array -> engine buffer copied")
    back = bridge.from_buffer(buf * 2)
    if bridge.to_buffer(back).data_ptr() != back.unsafe_buffer_pointer():
        fail("engine buffer -> jax.Array copied")


def check_errors(mode):
    """A rank-dependent mismatch fails every rank with the op layer's message naming the
    tensor and both values: eagerly as HorovodInternalError, inside jit as JaxRuntimeError
    carrying it (hvdlite.jax.elastic.run turns it back)."""
    wrap = MODES[mode]
    want = hvd.HorovodInternalError if mode == "eager" else jax.errors.JaxRuntimeError
    n = 2 + RANK % 2
    f = wrap(lambda x: hvd.allreduce(x, name=f"err.shape.{mode}"))
    expect_raises(want, lambda: np.asarray(f(jnp.zeros((n, 3)))), f"shape mismatch ({mode})",
                  match=f"err.shape.{mode}")
    dtype = jnp.float32 if RANK == 0 else jnp.float64
    g = wrap(lambda x: hvd.allgather(x, name=f"err.dtype.{mode}"))
    expect_raises(want, lambda: np.asarray(g(jnp.zeros((2,), dtype))),
                  f"dtype mismatch ({mode})", match=["float32", "float64"])
    if mode == "jit":
        err = hvd.callback_error()
        if not isinstance(err, hvd.HorovodInternalError):
            fail(f"callback_error() is {err!r}")
        wrapped = hvd.elastic.reraising(lambda: np.asarray(g(jnp.zeros((2,), dtype))))
        expect_raises(hvd.HorovodInternalError, wrapped, "elastic.reraising",
                      match=f"err.dtype.{mode}")
        expect_raises(ValueError, lambda: jax.jit(lambda x: hvd.alltoall(x, splits=[1, 1]))(
            jnp.zeros(2)), "alltoall splits inside jit", match="equal splits")
    else:
        # A dtype no collective reduces, on one rank only: every rank fails at once.
        x = jnp.zeros(2, jnp.complex64 if RANK == 0 else jnp.float32)
        expect_raises((ValueError, hvd.HorovodInternalError),
                      lambda: hvd.allreduce(x, name="err.complex"), "complex on one rank",
                      match="err.complex" if RANK else "complex64")
        expect_raises((ValueError, hvd.HorovodInternalError), lambda: hvd.allgather(
            jnp.float32(1.0) if RANK == 0 else jnp.zeros(1), name="err.scalar"),
            "scalar allgather on one rank", match="dimension" if RANK == 0 else "err.scalar")
    close(hvd.allreduce(jnp.ones(2, jnp.float32), op=hvd.Sum, name=f"err.after.{mode}"),
          np.full(2, SIZE, np.float32), "a collective after the errors")


# ---------------------------------------------------------------------------- training loop
def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(16 * SIZE, 5).astype(np.float32)
    y = (x @ rng.randn(5, 1) + 0.3).astype(np.float32)
    return x, y


def _init(seed):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"h": {"w": jax.random.normal(k1, (5, 8)) * 0.3, "b": jnp.zeros(8)},
            "o": {"w": jax.random.normal(k2, (8, 1)) * 0.3, "b": jnp.zeros(1)}}


def _loss(p, x, y):
    h = jnp.tanh(x @ p["h"]["w"] + p["h"]["b"])
    return jnp.mean((h @ p["o"]["w"] + p["o"]["b"] - y) ** 2)


def _sgd(lr):
    """A GradientTransformation without optax (init, update)."""
    return hvd.GradientTransformation(lambda params: (),
                                      lambda g, s, p=None: (jax.tree.map(lambda v: -lr * v, g), s))


def _train(tx, params, x, y, batch, steps, jit=True):
    state = tx.init(params)

    def step(p, s, xb, yb):
        grads = jax.grad(_loss)(p, xb, yb)
        updates, s = tx.update(grads, s, p)
        return jax.tree.map(lambda a, u: a + u, p, updates), s

    step = jax.jit(step) if jit else step
    for i in range(steps):
        rows = slice(i * batch % len(x), i * batch % len(x) + batch)
        params, state = step(params, state, x[rows], y[rows])
    return params


def _my_rows(x, per_rank):
    return np.concatenate([x[b * per_rank * SIZE + RANK * per_rank:
                             b * per_rank * SIZE + (RANK + 1) * per_rank]
                           for b in range(len(x) // (per_rank * SIZE))])


def check_training_loop(which):
    x, y = _data()
    per_rank = 4
    params = hvd.broadcast_parameters(_init(RANK), root_rank=0)    # rank 0's initial weights
    if which == "optax":
        import optax
        make = lambda: optax.adam(0.05)  # noqa: E731
    else:
        make = lambda: _sgd(0.1)  # noqa: E731
    # (Eagerly too for the optax-free one: JAX runs an unjitted step op by op, slowly.)
    for jit in ((True, False) if which == "plain" else (True,)):
        steps = 6 if jit else 2
        dist = _train(hvd.DistributedOptimizer(make()), params, _my_rows(x, per_rank),
                      _my_rows(y, per_rank), per_rank, steps, jit)
        ref = _train(make(), _init(0), x, y, per_rank * SIZE, steps, jit)
        for a, b in zip(jax.tree.leaves(dist), jax.tree.leaves(ref)):
            close(a, b, f"{which} loop (jit={jit}) == one process on the global batch", 1e-5)
    if which == "optax":
        # backward_passes_per_step=2, summed: 2 passes of 2 rows then one update equal one
        # process's step on 4 * SIZE rows with the summed gradient.
        dist = _train(hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2,
                                               average_aggregated_gradients=True),
                      params, _my_rows(x, 2), _my_rows(y, 2), 2, 8)
        ref = _train(optax.sgd(0.1), _init(0), x, y, 4 * SIZE, 4)
        for a, b in zip(jax.tree.leaves(dist), jax.tree.leaves(ref)):
            close(a, b, "backward_passes_per_step=2 == one process", 1e-5)


def main():
    for mode in MODES:
        check(f"allreduce_{mode}", check_allreduce, mode)
        check(f"grouped_{mode}", check_grouped, mode)
        check(f"move_{mode}", check_move, mode)
        check(f"errors_{mode}", check_errors, mode)
    check("gradient", check_gradient)
    check("objects_and_control", check_objects_and_control)
    check("zero_copy", check_zero_copy)
    check("elastic_state", check_elastic_state)
    check("loop_plain", check_training_loop, "plain")
    try:
        import optax  # noqa: F401
    except ImportError:
        pass
    else:
        check("loop_optax", check_training_loop, "optax")
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main()
