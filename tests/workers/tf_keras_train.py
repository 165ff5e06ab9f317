"""Keras `model.fit` with hvdlite.tensorflow.keras on real ranks (Keras 3, or tf_keras when run
with TF_USE_LEGACY_KERAS=1): the weights after training are identical on every rank and equal to
a plain single-process Keras run on the global batch. Also callbacks, save/load, custom loops.

Usage: tf_keras_train.py TMPDIR [quick]
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

from tf_common import check, close, expect_raises, fail, finish, log  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd_tf  # noqa: E402
import hvdlite.tensorflow.keras as hvd  # noqa: E402
from hvdlite.tensorflow.keras.optimizer import is_keras3  # noqa: E402

keras = tf.keras
KERAS3 = is_keras3()
TMP = sys.argv[1]
QUICK = len(sys.argv) > 2 and sys.argv[2] == "quick"

ONLY_0, ONLY_1 = hvd.ProcessSet([0]), hvd.ProcessSet([1])
hvd.init(process_sets=[ONLY_0, ONLY_1])
RANK, SIZE = hvd.rank(), hvd.size()
B = 8                       # local batch
N_LOCAL = 32                # samples per rank
RTOL, ATOL = 2e-5, 2e-6     # fp32: sums of 8 vs 16 terms round differently

rng = np.random.RandomState(42)
X = rng.randn(SIZE * N_LOCAL, 6).astype(np.float32)
Y = (X @ rng.randn(6, 1) + 0.1 * rng.randn(SIZE * N_LOCAL, 1)).astype(np.float32)
X_LOCAL = X[RANK * N_LOCAL:(RANK + 1) * N_LOCAL]
Y_LOCAL = Y[RANK * N_LOCAL:(RANK + 1) * N_LOCAL]


def global_order(arr, local_batch):
    """The global batches, rank after rank, as one array (batch size SIZE * local_batch)."""
    parts = [arr[r * N_LOCAL:(r + 1) * N_LOCAL] for r in range(SIZE)]
    out = []
    for k in range(N_LOCAL // local_batch):
        for p in parts:
            out.append(p[k * local_batch:(k + 1) * local_batch])
    return np.concatenate(out)


def make_model(seed, sync_bn=False, plain_bn=False):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh")]
    if sync_bn:
        layers.append(hvd_tf.SyncBatchNormalization())
    elif plain_bn:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)



def initial_weights(model):
    """Rank 0's initial weights (what BroadcastGlobalVariablesCallback gives every rank)."""
    return hvd.broadcast_object(model.get_weights(), root_rank=0)


def check_identical(model, what):
    all_w = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    for r in range(1, SIZE):
        for i, (a, b) in enumerate(zip(all_w[0], all_w[r])):
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                fail(f"{what}: weight {i} differs between rank 0 and rank {r}")


def reference_fit(make_opt, weights, epochs, local_batch=B, callbacks=None, sync_bn=False,
                  run_eagerly=False):
    model = make_model(123, plain_bn=sync_bn)
    model.set_weights(weights)
    model.compile(optimizer=make_opt(), loss="mse", run_eagerly=run_eagerly)
    hist = model.fit(global_order(X, local_batch), global_order(Y, local_batch),
                     batch_size=SIZE * local_batch, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks or [])
    return model, hist


def distributed_fit(make_opt, epochs, opt_kwargs=None, callbacks=None, sync_bn=False,
                    compile_kwargs=None, local_batch=B):
    model = make_model(1000 + RANK, sync_bn=sync_bn)   # different on every rank on purpose
    weights0 = initial_weights(model)
    opt = hvd.DistributedOptimizer(make_opt(), **(opt_kwargs or {}))
    model.compile(optimizer=opt, loss="mse", **(compile_kwargs or {}))
    cbs = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
           hvd.callbacks.MetricAverageCallback()] + list(callbacks or [])
    hist = model.fit(X_LOCAL, Y_LOCAL, batch_size=local_batch, epochs=epochs, shuffle=False,
                     verbose=0, callbacks=cbs)
    return model, opt, weights0, hist


def compare(model, ref, what, rtol=RTOL, atol=ATOL):
    for i, (a, b) in enumerate(zip(model.get_weights(), ref.get_weights())):
        close(a, b, f"{what}: weight {i}", rtol=rtol, atol=atol)


OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    "Adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
}
if KERAS3:
    OPTIMIZERS["AdamW"] = lambda: keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1)
    OPTIMIZERS["RMSprop"] = lambda: keras.optimizers.RMSprop(learning_rate=0.01, momentum=0.5)


def check_fit(name):
    make_opt = OPTIMIZERS[name]
    model, opt, w0, hist = distributed_fit(make_opt, epochs=2)
    check_identical(model, name)
    ref, ref_hist = reference_fit(make_opt, w0, epochs=2)
    compare(model, ref, name)
    close(hist.history["loss"], ref_hist.history["loss"], "averaged loss history", rtol=1e-5)
    if type(opt).__name__ != type(make_opt()).__name__ or not isinstance(opt, type(make_opt())):
        fail(f"wrapped optimizer is a {type(opt).__name__}")
    if int(opt.iterations.numpy()) != 2 * N_LOCAL // B:
        fail(f"iterations {int(opt.iterations.numpy())}")


def check_fit_options():
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)  # noqa: E731
    # op=Sum: the summed gradient is SIZE times the average one.
    model, _, w0, _ = distributed_fit(sgd, 1, opt_kwargs={"op": hvd.Sum})
    check_identical(model, "Sum")
    ref, _ = reference_fit(lambda: keras.optimizers.SGD(learning_rate=0.05 * SIZE,
                                                        momentum=0.9), w0, 1)
    compare(model, ref, "op=Sum")
    # gradient_predivide_factor splits the average around the sum: same result.
    model, _, w0, _ = distributed_fit(sgd, 1, opt_kwargs={"gradient_predivide_factor": 4.0})
    ref, _ = reference_fit(sgd, w0, 1)
    compare(model, ref, "gradient_predivide_factor")
    # fp16 compression: close to the float32 result.
    model, _, w0, _ = distributed_fit(sgd, 1, opt_kwargs={"compression": hvd.Compression.fp16})
    check_identical(model, "fp16")
    ref, _ = reference_fit(sgd, w0, 1)
    compare(model, ref, "fp16 compression", rtol=5e-3, atol=5e-3)


def check_process_set():
    """Reducing over a process set of this rank alone: each rank trains on its own data only."""
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)  # noqa: E731
    mine = ONLY_0 if RANK == 0 else ONLY_1
    model = make_model(1000 + RANK)
    w0 = initial_weights(model)
    model.set_weights(w0)
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(), process_set=mine), loss="mse")
    model.fit(X_LOCAL, Y_LOCAL, batch_size=B, epochs=1, shuffle=False, verbose=0)
    ref = make_model(1)
    ref.set_weights(w0)
    ref.compile(optimizer=sgd(), loss="mse")
    ref.fit(X_LOCAL, Y_LOCAL, batch_size=B, epochs=1, shuffle=False, verbose=0)
    compare(model, ref, "process_set of one rank", rtol=1e-6, atol=1e-7)


def check_backward_passes():
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)  # noqa: E731
    model, opt, w0, _ = distributed_fit(
        sgd, 2, opt_kwargs={"backward_passes_per_step": 2,
                            "average_aggregated_gradients": True})
    check_identical(model, "backward_passes_per_step")
    # Each update: 2 local passes on SIZE ranks = one reference batch of 2 * SIZE * B samples.
    ref, _ = reference_fit(sgd, w0, 2, local_batch=2 * B)
    compare(model, ref, "backward_passes_per_step=2")
    if int(opt.iterations.numpy()) != 2 * N_LOCAL // B:
        fail(f"iterations count every pass: {int(opt.iterations.numpy())}")


class _HorovodStyleLR(keras.callbacks.Callback):
    """The reference: Horovod's own algorithm (momentum coefficient scaled for one batch), run
    eagerly so the coefficient change takes effect."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.restore = None

    def _lr(self, epoch, batch):
        if epoch < 2:
            e = epoch + batch / self.steps + 1.0 / self.steps
            return 0.1 / SIZE * (e * (SIZE - 1) / 2 + 1)
        return 0.1 * 0.5 ** (epoch - 2) if batch == 0 else None   # (epoch - start_epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        new = self._lr(self.epoch, batch)
        if new is None:
            return
        opt = self.model.optimizer
        old = float(opt.learning_rate.numpy())
        opt.learning_rate.assign(new)
        if new != old:
            self.restore = opt.momentum
            opt.momentum = opt.momentum * new / old

    def on_train_batch_end(self, batch, logs=None):
        if self.restore is not None:
            self.model.optimizer.momentum = self.restore
            self.restore = None


def check_lr_callbacks():
    sgd = lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)  # noqa: E731
    cbs = [hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, verbose=0),
           hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5,
                                                      start_epoch=2)]
    model, opt, w0, hist = distributed_fit(sgd, 4, callbacks=cbs)
    check_identical(model, "lr callbacks")
    # The schedule: Horovod's initial_lr * multiplier ** (epoch - start_epoch).
    close(hist.history["lr"], [0.1 / SIZE * (1 * (SIZE - 1) / 2 + 1), 0.1, 0.1, 0.1 * 0.5],
          "logged lr", rtol=1e-6)
    if not KERAS3:
        return   # tf_keras SGD: the reference callback below is Keras 3 specific
    ref, _ = reference_fit(sgd, w0, 4, callbacks=[_HorovodStyleLR(N_LOCAL // B)],
                           run_eagerly=True)
    compare(model, ref, "warmup + schedule with momentum correction", rtol=1e-4, atol=1e-5)


def check_sync_bn_fit():
    adam = lambda: keras.optimizers.Adam(learning_rate=0.01)  # noqa: E731
    model, _, w0, _ = distributed_fit(adam, 1, sync_bn=True)
    check_identical(model, "SyncBatchNormalization")
    ref, _ = reference_fit(adam, w0, 1, sync_bn=True)
    compare(model, ref, "SyncBatchNormalization vs BatchNormalization on the global batch",
            rtol=1e-4, atol=1e-5)


def check_save_load():
    adam = lambda: keras.optimizers.Adam(learning_rate=0.01)  # noqa: E731
    model, opt, _, _ = distributed_fit(adam, 1)
    ext = ".keras" if KERAS3 else ".h5"
    path = os.path.join(TMP, f"model_{'k3' if KERAS3 else 'k2'}{ext}")
    if RANK == 0:
        model.save(path)
    hvd.broadcast_object(None, 0)     # the file exists before anyone reads it
    plain = keras.models.load_model(path)
    cls = type(plain.optimizer)
    if cls.__name__ != "Adam" or "hvdlite" in cls.__module__ or \
            getattr(plain.optimizer, "_hvd_distributed", False):
        fail(f"plain Keras loaded {cls.__module__}.{cls.__name__}")
    loaded = hvd.load_model(path)
    if not getattr(loaded.optimizer, "_hvd_distributed", False):
        fail("hvd.load_model did not wrap the optimizer")
    steps = N_LOCAL // B
    loaded.fit(X_LOCAL, Y_LOCAL, batch_size=B, epochs=1, shuffle=False, verbose=0,
               callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    check_identical(loaded, "after load_model + fit")
    if int(loaded.optimizer.iterations.numpy()) != 2 * steps:
        fail(f"optimizer state not restored: iterations {loaded.optimizer.iterations.numpy()}")
    # Reference: the saved model resumed by plain Keras on the global batch.
    plain.fit(global_order(X, B), global_order(Y, B), batch_size=SIZE * B, epochs=1,
              shuffle=False, verbose=0)
    compare(loaded, plain, "resumed training")


def check_best_checkpoint_fit():
    ext = ".keras" if KERAS3 else ".h5"
    path = os.path.join(TMP, f"best_{RANK}{ext}")
    cb = hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=path)
    distributed_fit(OPTIMIZERS["SGD"], 2, callbacks=[cb])
    if not os.path.exists(path):
        fail(f"BestModelCheckpoint wrote nothing at {path}")
    else:
        keras.models.load_model(path)


def check_custom_loop():
    """A custom tf.function training loop with DistributedGradientTape and a plain optimizer,
    and one with a DistributedOptimizer's apply_gradients."""
    w0 = initial_weights(make_model(77))
    for variant in ("tape", "optimizer"):
        model = make_model(2000 + RANK)
        model.set_weights(w0)
        if variant == "tape":
            opt = keras.optimizers.Adam(0.01)
        else:
            opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
        loss_fn = keras.losses.MeanSquaredError()

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if variant == "tape":
                tape = hvd_tf.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for k in range(N_LOCAL // B):
            train_step(X_LOCAL[k * B:(k + 1) * B], Y_LOCAL[k * B:(k + 1) * B])
        check_identical(model, variant)
        ref, _ = reference_fit(lambda: keras.optimizers.Adam(0.01), w0, 1)
        compare(model, ref, f"custom loop ({variant})")


def check_sparse_and_modes():
    """Embedding gradients (tf.IndexedSlices: allgathered, or sparse_as_dense), several steps
    per execution (a while loop around the train step), and run_eagerly."""
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 20, size=(SIZE * N_LOCAL, 3))
    yy = rng.randn(SIZE * N_LOCAL, 1).astype("float32")
    lo = RANK * N_LOCAL

    def mk(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    w0 = initial_weights(mk(10 + RANK))
    runs = [("IndexedSlices", {}, lambda: keras.optimizers.SGD(0.1, momentum=0.5),
             {"steps_per_execution": 2}),
            ("sparse_as_dense", {"sparse_as_dense": True},
             lambda: keras.optimizers.SGD(0.1, momentum=0.5), {}),
            ("run_eagerly", {}, lambda: keras.optimizers.Adam(0.01), {"run_eagerly": True})]
    for what, kw, make_opt, compile_kw in runs:
        model = mk(1)
        model.set_weights(w0)
        model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), **kw), loss="mse",
                      **compile_kw)
        model.fit(ids[lo:lo + N_LOCAL], yy[lo:lo + N_LOCAL], batch_size=B, epochs=1,
                  shuffle=False, verbose=0)
        check_identical(model, what)
        ref = mk(1)
        ref.set_weights(w0)
        ref.compile(optimizer=make_opt(), loss="mse")
        ref.fit(global_order(ids, B), global_order(yy, B), batch_size=SIZE * B, epochs=1,
                shuffle=False, verbose=0)
        compare(model, ref, what)


def check_xla():
    adam = lambda: keras.optimizers.Adam(learning_rate=0.01)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _, w0, _ = distributed_fit(adam, 1, compile_kwargs={"jit_compile": True})
    if not any("jit_compile=False" in str(w.message) for w in caught):
        fail("no warning when turning XLA off")
    ref, _ = reference_fit(adam, w0, 1)
    compare(model, ref, "jit_compile=True with hvdlite callbacks")
    model = make_model(3)
    model.compile(optimizer=hvd.DistributedOptimizer(adam()), loss="mse", jit_compile=True)
    expect_raises(ValueError, lambda: model.fit(X_LOCAL, Y_LOCAL, batch_size=B, epochs=1,
                                                verbose=0),
                  "jit_compile=True without callbacks", "jit_compile=False")


def check_bad_optimizer():
    import torch
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)), "torch optimizer",
        "torch.optim.sgd.SGD")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                               op=hvd.Max),
                  "op=Max", "Average and Sum")
    if KERAS3:
        # A tf_keras optimizer is accepted too (Keras 2 code on the same TensorFlow).
        try:
            import tf_keras
            opt = hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.1))
            if type(opt).__name__ != "SGD":
                fail("tf_keras optimizer class name")
        except ImportError:
            pass


def main():
    if KERAS3:
        log(f"Keras {keras.__version__ if hasattr(keras, '__version__') else '?'}")
    for name in OPTIMIZERS if not QUICK else ["SGD", "Adam"]:
        check(f"fit_{name}", check_fit, name)
    if not QUICK:
        check("fit_options", check_fit_options)
    check("process_set", check_process_set)
    check("backward_passes_per_step", check_backward_passes)
    check("lr_callbacks", check_lr_callbacks)
    check("sync_batch_norm_fit", check_sync_bn_fit)
    check("save_load", check_save_load)
    check("best_checkpoint", check_best_checkpoint_fit)
    check("custom_loop", check_custom_loop)
    if KERAS3:
        check("sparse_and_modes", check_sparse_and_modes)
        check("xla", check_xla)
    check("bad_optimizer", check_bad_optimizer)
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main()
