"""hvdlite.keras (horovod.keras's API) on Keras 3, on the backend KERAS_BACKEND names: model.fit
with DistributedOptimizer and Horovod's callbacks gives the single-process result on the global
batch; the collectives and load_model work (issue 10)."""
from __future__ import annotations

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

import hvdlite.keras as hvd  # noqa: E402
from harness import check, finish, log  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
# KERAS_JIT_COMPILE=1: model.fit compiles its step (on JAX, jax.jit: the gradients are reduced
# by host callbacks inside the compiled step).
JIT = os.environ.get("KERAS_JIT_COMPILE") == "1"


def close(a, b, what, tol=1e-5):
    a = np.asarray(keras.ops.convert_to_numpy(a), np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: {a.reshape(-1)[:6]} != {b.reshape(-1)[:6]}")


def data():
    rng = np.random.RandomState(0)
    x = rng.randn(8 * SIZE, 3).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.1).astype(np.float32)
    return x, y


def model(seed):
    keras.utils.set_random_seed(seed)     # different on each rank: the broadcast must fix it
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(1)])
    return m


def fit(m, opt, x, y, callbacks, batch):
    m.compile(optimizer=opt, loss="mse", jit_compile=JIT)
    return m.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                 callbacks=callbacks)


def check_fit():
    x, y = data()
    per_rank = 4
    idx = _my_rows(x, per_rank)
    dist = model(seed=100 + RANK)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1, momentum=0.9))
    hist = fit(dist, opt, x[idx], y[idx],
               [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                hvd.callbacks.MetricAverageCallback(),
                hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5,
                                                           start_epoch=0)], per_rank)
    ref = model(seed=100)                 # rank 0's initial weights
    ref_hist = fit(ref, keras.optimizers.SGD(learning_rate=0.1, momentum=0.9), x, y,
                   [_Halve()], per_rank * SIZE)
    for a, b in zip(dist.get_weights(), ref.get_weights()):
        close(a, b, "weights after fit == single process on the global batch", 1e-4)
    if type(opt).__name__ != "SGD" or not isinstance(opt, keras.optimizers.SGD):
        raise AssertionError(f"wrapped optimizer class {type(opt)}")
    # MetricAverageCallback: the epoch loss is the mean of the ranks' losses.
    losses = hvd.allgather(np.array([hist.history["loss"][-1]], np.float64))
    close(losses, np.full(SIZE, hist.history["loss"][-1]), "averaged metrics equal on all ranks")
    close(hist.history["lr"][-1], 0.05, "lr schedule applied")
    del ref_hist


class _Halve(keras.callbacks.Callback):
    """The single-process twin of LearningRateScheduleCallback(initial_lr, 0.5, start_epoch=0)
    (Horovod's initial_lr * 0.5 ** (epoch - start_epoch), a change from epoch 1 on), with
    Horovod's momentum correction (momentum buffers scaled by new_lr / old_lr): SGD keeps
    them in `momentums`, RMSprop in `_momentums`."""

    def __init__(self, initial_lr=0.1, buffers="momentums"):
        super().__init__()
        self.initial_lr, self.buffers = initial_lr, buffers

    def on_epoch_begin(self, epoch, logs=None):
        if epoch >= 1:
            opt = self.model.optimizer
            old = float(keras.ops.convert_to_numpy(opt.learning_rate))
            new = self.initial_lr * 0.5 ** epoch
            opt.learning_rate = new
            bufs = getattr(opt, self.buffers)
            if not bufs:
                raise AssertionError(f"{type(opt).__name__} has no {self.buffers}")
            for buf in bufs:
                buf.assign(buf.value * (new / old))


def _my_rows(x, per_rank):
    """Rank r's rows r*per_rank..(r+1)*per_rank-1 of every global batch of per_rank*SIZE rows."""
    return np.concatenate([np.arange(b * per_rank * SIZE + RANK * per_rank,
                                     b * per_rank * SIZE + (RANK + 1) * per_rank)
                           for b in range(len(x) // (per_rank * SIZE))])


def check_lr_callbacks():
    """RMSprop's momentum (Keras 3 keeps it in `_momentums`) is corrected as SGD's when the
    learning rate changes, on either backend: model.fit on 2 ranks equals one process on the
    global batch. An optimizer built with a learning-rate schedule gets a clear error."""
    x, y = data()
    per_rank = 4
    idx = _my_rows(x, per_rank)
    dist = model(seed=200 + RANK)
    opt = hvd.DistributedOptimizer(keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.9))
    fit(dist, opt, x[idx], y[idx],
        [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
         hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.01, multiplier=0.5,
                                                    start_epoch=0)], per_rank)
    ref = model(seed=200)
    fit(ref, keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.9), x, y,
        [_Halve(0.01, "_momentums")], per_rank * SIZE)
    for a, b in zip(dist.get_weights(), ref.get_weights()):
        close(a, b, "RMSprop with momentum correction == single process", 1e-4)

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    m = model(seed=300)
    try:
        fit(m, hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=schedule)), x[idx],
            y[idx], [hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5)], per_rank)
    except ValueError as exc:
        if "learning-rate schedule (ExponentialDecay)" not in str(exc):
            raise AssertionError(f"unclear error: {exc}") from exc
    else:
        raise AssertionError("a learning-rate schedule was overwritten without an error")


def check_accumulation_and_groups():
    """backward_passes_per_step=2 with average_aggregated_gradients, and explicit groups, on
    either backend: 2 passes of 2 rows on each rank then one update equal one process's step
    on the 4 * SIZE rows; `groups` changes how the gradients travel, not the result."""
    x, y = data()
    per_rank = 2
    idx = _my_rows(x, per_rank)
    dist = model(seed=400 + RANK)
    layer = dist.layers[0]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1),
                                   backward_passes_per_step=2, average_aggregated_gradients=True,
                                   groups=[[layer.kernel, layer.bias]])
    fit(dist, opt, x[idx], y[idx], [hvd.callbacks.BroadcastGlobalVariablesCallback(0)], per_rank)
    ref = model(seed=400)
    fit(ref, keras.optimizers.SGD(learning_rate=0.1), x, y, [], 2 * per_rank * SIZE)
    for a, b in zip(dist.get_weights(), ref.get_weights()):
        close(a, b, "2 passes accumulated == one process on the global batch", 1e-4)
    steps = 2 * len(idx) // per_rank      # (fit's 2 epochs)
    close(opt.iterations, steps, "iterations count every pass, as Horovod")

    # groups=3, and horovod.keras' positional order, where the 9th argument is num_groups
    # (horovod.tensorflow.keras has backward_passes_per_step there: taken for it, the
    # optimizer would accumulate 3 passes and the weights differ from the reference).
    for how in ("groups=3", "num_groups=3 positionally"):
        dist = model(seed=500 + RANK)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)      # (num_groups)
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1), groups=3) \
                if how == "groups=3" else hvd.DistributedOptimizer(
                    keras.optimizers.SGD(learning_rate=0.1), None, "", "",
                    hvd.Compression.none, False, 1.0, hvd.Average, 3)
        fit(dist, opt, x[idx], y[idx], [hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
            per_rank)
        ref = model(seed=500)
        fit(ref, keras.optimizers.SGD(learning_rate=0.1), x, y, [], per_rank * SIZE)
        for a, b in zip(dist.get_weights(), ref.get_weights()):
            close(a, b, f"{how} == one process on the global batch", 1e-4)
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    except ValueError as exc:
        if "backward_passes_per_step must be > 0" not in str(exc):
            raise
    else:
        raise AssertionError("backward_passes_per_step=0 was accepted")


def check_elastic_state():
    """hvdlite.keras.elastic on either backend: the callbacks exist; sync() takes the variables
    and attributes of the rank the reset agreement chose (sync_root: the most commits, which
    need not be rank 0), and a reset drops a DistributedOptimizer's partial sums on every
    rank, so all count the passes to the next reduction alike."""
    for name in ("CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"):
        if not hasattr(hvd.elastic, name):
            raise AssertionError(f"hvdlite.keras.elastic lacks {name}")
    # A model that is not built has no variables yet: refused, with Horovod's message.
    try:
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(1)]), epoch=0)
    except ValueError as exc:
        if "Model must be built first" not in str(exc):
            raise AssertionError(f"unbuilt model: {exc}") from exc
    else:
        raise AssertionError("KerasState of an unbuilt model was accepted")
    m = model(seed=700 + RANK)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1),
                                   backward_passes_per_step=2)
    m.compile(optimizer=opt, loss="mse", jit_compile=JIT)
    opt.build(m.trainable_variables)
    state = hvd.elastic.KerasState(m, batch=RANK + 3, epoch=0)
    state._sync_root = SIZE - 1           # what the reset agreement sets (common/elastic.py)
    state.sync()
    for a, b in zip(m.get_weights(), model(seed=700 + SIZE - 1).get_weights()):
        close(a, b, "variables synced from sync_root")
    if state.batch != SIZE - 1 + 3:
        raise AssertionError(f"state.batch {state.batch}: not synced from sync_root")

    v = m.trainable_variables
    before = [np.asarray(keras.ops.convert_to_numpy(x)) for x in v]
    opt.apply([keras.ops.ones_like(x.value) * 100.0 for x in v], v)  # pass 1 of 2: no update
    state.on_reset()                      # what every rank runs after a membership change
    for _ in range(2):
        opt.apply([keras.ops.ones_like(x.value) for x in v], v)
    for x, w in zip(v, before):
        close(x, w - 0.1 * 2.0, "the reset dropped the partial sum (2 passes of ones)")


def check_collectives():
    out = hvd.allreduce(np.array([1.0 + RANK, 2.0]))
    close(out, [1.0 + (SIZE - 1) / 2.0, 2.0], "allreduce averages")
    out = hvd.allreduce(np.array([RANK], np.int32), op=hvd.Sum)
    close(out, [SIZE * (SIZE - 1) / 2], "allreduce Sum")
    out = hvd.allgather(np.array([[RANK]], np.float32))
    close(out, np.arange(SIZE).reshape(SIZE, 1), "allgather")
    out = hvd.broadcast(np.array([RANK + 5.0]), root_rank=SIZE - 1)
    close(out, [SIZE + 4.0], "broadcast")
    out = hvd.reducescatter(np.ones((SIZE, 2), np.float32) * (RANK + 1), op=hvd.Sum)
    close(out, np.full((1, 2), SIZE * (SIZE + 1) / 2), "reducescatter")


def check_load_model():
    m = model(seed=7)
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=JIT)
    x, y = data()
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), f"m{RANK}.keras")
    m.save(path)
    loaded = hvd.load_model(path)
    if not getattr(loaded.optimizer, "_hvd_distributed", False):
        raise AssertionError("load_model did not wrap the optimizer")
    if type(loaded.optimizer).__name__ != "Adam":
        raise AssertionError(f"class {type(loaded.optimizer).__name__}")
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)


def check_partial_optimizer():
    """PartialDistributedOptimizer (horovod.keras's): the local layer's gradients are not
    averaged (divided by the set size with scale_local_gradients, as Horovod does), the other
    layers' are. The optimizer is wrapped before the model is built, when the local layer has
    no variables yet (Horovod's collected none then and averaged the layer)."""
    x, y = data()
    per_rank, lr = 4, 0.1

    def build():
        head = keras.layers.Dense(1, name="head")
        return keras.Sequential([keras.layers.Dense(4, activation="tanh"), head]), head

    def one_step(m, opt, r):
        m.compile(optimizer=opt, loss="mse", jit_compile=JIT)
        rows = slice(r * per_rank, (r + 1) * per_rank)
        m.fit(x[rows], y[rows], batch_size=per_rank, epochs=1, shuffle=False, verbose=0)

    ref0, _ = build()
    ref0(x[:1])
    w0 = hvd.broadcast_object(ref0.get_weights(), root_rank=0)
    grads = []                            # every rank's gradients, from plain Keras here
    for r in range(SIZE):
        m, _ = build()
        m(x[:1])
        m.set_weights(w0)
        one_step(m, keras.optimizers.SGD(learning_rate=lr), r)
        grads.append([(a - b) / lr for a, b in zip(w0, m.get_weights())])
    for scale in (True, False):
        m, head = build()
        opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=lr),
                                              local_layers=head, scale_local_gradients=scale)
        m(x[:1])
        m.set_weights(w0)
        one_step(m, opt, RANK)
        got = m.get_weights()
        n_body = len(m.layers[0].get_weights())
        for i, (w, g) in enumerate(zip(w0, grads[RANK])):
            if i < n_body:
                want = w - lr * np.mean([grads[r][i] for r in range(SIZE)], axis=0)
                close(got[i], want, f"averaged layer, weight {i} (scale={scale})")
            else:
                want = w - lr * g / (SIZE if scale else 1)
                close(got[i], want, f"local layer, weight {i} (scale={scale})")
    try:
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(), local_layers=[object()])
    except ValueError as exc:
        if "All local layers must be of tf.keras.layers.Layer type" not in str(exc):
            raise
    else:
        raise AssertionError("a non-layer in local_layers was accepted")


def check_api():
    for name in ("DistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather",
                 "broadcast", "load_model", "init", "rank", "size", "local_rank", "local_size",
                 "shutdown", "Compression", "ProcessSet", "Average", "Sum"):
        if not hasattr(hvd, name):
            raise AssertionError(f"hvdlite.keras lacks {name}")
    for name in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
                 "LearningRateScheduleCallback", "LearningRateWarmupCallback",
                 "BestModelCheckpoint"):
        if not hasattr(hvd.callbacks, name):
            raise AssertionError(f"hvdlite.keras.callbacks lacks {name}")
    # horovod.keras's BestModelCheckpoint(monitor, verbose, mode, save_freq) has no
    # save_weights_only (horovod.tensorflow.keras's has it third): both orders work.
    cb = hvd.callbacks.BestModelCheckpoint("loss", 0, "max", 3)
    got = (cb.monitor, cb.mode, cb.save_freq, cb.save_weights_only)
    if got != ("loss", "max", 3, False):
        raise AssertionError(f"BestModelCheckpoint in horovod.keras's order: {got}")
    cb = hvd.callbacks.BestModelCheckpoint("loss", 0, True, "min")
    if (cb.mode, cb.save_weights_only) != ("min", True):
        raise AssertionError(f"BestModelCheckpoint in horovod.tensorflow.keras's order: "
                             f"{(cb.mode, cb.save_weights_only)}")
    if not hasattr(hvd.elastic, "KerasState") or not hasattr(hvd.elastic, "run"):
        raise AssertionError("hvdlite.keras.elastic lacks KerasState/run")
    import inspect
    for name, expected in HOROVOD_KERAS_SIGNATURES.items():
        params = []
        for p in inspect.signature(getattr(hvd, name)).parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in params:
                params.append("*")
            if p.default is inspect.Parameter.empty:
                params.append(p.name)
            elif p.default is hvd.Compression.none:
                params.append(f"{p.name}=Compression.none")
            elif p.default is hvd.global_process_set:
                params.append(f"{p.name}=global_process_set")
            elif p.name == "op" and p.default is not None:
                params.append(f"{p.name}={['Average', 'Sum'][p.default]}")
            else:
                params.append(f"{p.name}={p.default!r}")
        if ", ".join(params) != expected:
            raise AssertionError(f"{name}({', '.join(params)}) != Horovod's ({expected})")


# horovod/keras/__init__.py (Horovod 0.28). DistributedOptimizer: horovod.keras' parameters in
# its order, then those only horovod.tensorflow.keras has, keyword-only.
HOROVOD_KERAS_SIGNATURES = {
    "DistributedOptimizer": "optimizer, name=None, device_dense='', device_sparse='', "
                            "compression=Compression.none, sparse_as_dense=False, "
                            "gradient_predivide_factor=1.0, op=Average, num_groups=0, "
                            "groups=None, *, backward_passes_per_step=1, "
                            "average_aggregated_gradients=False, "
                            "process_set=global_process_set, scale_local_gradients=True",
    "PartialDistributedOptimizer": "optimizer, name=None, device_dense='', device_sparse='', "
                                   "compression=Compression.none, sparse_as_dense=False, "
                                   "gradient_predivide_factor=1.0, op=Average, groups=None, "
                                   "process_set=global_process_set, local_layers=None, "
                                   "scale_local_gradients=True",
    "broadcast_global_variables": "root_rank",
    "allreduce": "value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, "
                 "op=None, compression=Compression.none",
    "allgather": "value, name=None",
    "broadcast": "value, root_rank, name=None",
    "reducescatter": "value, name=None, op=Average",
    "load_model": "filepath, custom_optimizers=None, custom_objects=None, "
                  "compression=Compression.none, legacy_opts=False",
}


def main():
    log(f"BACKEND {keras.backend.backend()}")
    check("api", check_api)
    check("collectives", check_collectives)
    check("fit", check_fit)
    check("lr_callbacks", check_lr_callbacks)
    check("accumulation_and_groups", check_accumulation_and_groups)
    check("partial_optimizer", check_partial_optimizer)
    check("elastic_state", check_elastic_state)
    check("load_model", check_load_model)
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main()
