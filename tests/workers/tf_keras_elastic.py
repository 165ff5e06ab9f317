"""Elastic Keras training (KerasState + the elastic callbacks + hvd.elastic.run) whose result is
known exactly: every rank trains on the same batches, so the averaged gradient equals the
single-process one whatever the membership, and the final weights must equal a plain Keras run.

Commits happen at epoch ends, so a rollback replays whole epochs. With TF_ELASTIC_STALL_AT=N the
rank 1 of a 2-rank job stops responding after global step N (the test kills it there); rank 0
then fails in its next allreduce inside model.fit, rolls back and finishes alone.

Environment: ELASTIC_MARK_DIR (pid.<worker>, step.<worker> = "<step> <size> <rank>"),
TF_ELASTIC_EPOCHS (5), TF_ELASTIC_STALL_AT.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

# KERAS_BACKEND=jax: the same job with hvdlite.keras on Keras 3's JAX backend, where the
# allreduce that fails runs as a host callback inside the jitted train step.
BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND == "tensorflow":
    import tf_common  # noqa: E402,F401  (quiet, single-threaded TensorFlow)
    import tensorflow as tf  # noqa: E402
    keras = tf.keras
else:
    import keras  # noqa: E402

EPOCHS = int(os.environ.get("TF_ELASTIC_EPOCHS", "5"))
STALL_AT = int(os.environ["TF_ELASTIC_STALL_AT"]) if os.environ.get("TF_ELASTIC_STALL_AT") \
    else None
MARK_DIR = os.environ.get("ELASTIC_MARK_DIR")
B, STEPS = 8, 4

rng = np.random.RandomState(3)
X = rng.randn(B * STEPS, 5).astype(np.float32)
Y = (X @ rng.randn(5, 1)).astype(np.float32)
W0 = [rng.randn(5, 4).astype(np.float32) * 0.5, np.zeros(4, np.float32),
      rng.randn(4, 1).astype(np.float32) * 0.5, np.zeros(1, np.float32)]


def make_model():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    model.set_weights(W0)
    return model


def make_opt():
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def mark(kind: str, text: str) -> None:
    if MARK_DIR:
        wid = os.environ.get("HVDLITE_ELASTIC_WORKER", "static").replace(":", "_")
        path = os.path.join(MARK_DIR, f"{kind}.{wid}")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def main() -> int:
    if BACKEND == "tensorflow":
        import hvdlite.tensorflow.keras as hvd
    else:
        import hvdlite.keras as hvd

    mark("pid", str(os.getpid()))
    hvd.init()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0, trace=[])
    sizes: list[int] = []
    state.register_reset_callbacks([lambda: sizes.append(hvd.size())])

    class Progress(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = state.epoch * STEPS + batch + 1
            mark("step", f"{step} {hvd.size()} {hvd.rank()}")
            if STALL_AT is not None and step == STALL_AT and hvd.size() == 2 and \
                    hvd.rank() == 1:
                time.sleep(300)    # the test kills this process here

        def on_epoch_end(self, epoch, logs=None):
            state.trace.append(state.epoch - 1)

    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 Progress(),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=STEPS)]

    @hvd.elastic.run
    def train(state):
        model.fit(X, Y, batch_size=B, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0,
                  callbacks=callbacks)

    train(state)
    if hvd.rank() == 0:
        ref = make_model()
        ref.compile(optimizer=make_opt(), loss="mse")
        ref.fit(X, Y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
        diff = max(float(np.abs(a - b).max())
                   for a, b in zip(model.get_weights(), ref.get_weights()))
        print("RESULT " + json.dumps({
            "epoch": state.epoch, "trace": state.trace, "size": hvd.size(),
            "reset_sizes": sizes, "max_diff": diff,
            "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            "ref_iterations": int(keras.ops.convert_to_numpy(ref.optimizer.iterations))}),
            flush=True)
    mark("done", "1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
