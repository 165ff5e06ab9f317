"""Train a small Keras 3 classifier with `model.fit` on several ranks: a Horovod Keras script
with one changed import.

    hvdlite-run -np 2 python examples/tensorflow/tensorflow2_keras_train.py

Each rank trains on its shard of a synthetic data set (spirals, built with a fixed seed so every
rank builds the same one). hvd.DistributedOptimizer averages the gradients inside the compiled
train step; the callbacks start every rank from rank 0's weights, average the metrics, warm the
learning rate up, and rank 0 alone writes the checkpoint. Keras 2 scripts run the same way with
TF_USE_LEGACY_KERAS=1 (and the tf_keras package).
"""
import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow.keras as hvd  # noqa: E402  (was: import horovod.tensorflow.keras)

parser = argparse.ArgumentParser(description="hvdlite Keras model.fit example")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
parser.add_argument("--samples", type=int, default=4096)
parser.add_argument("--warmup-epochs", type=int, default=2)
parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                         "hvdlite_keras_example.keras"))
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()


def make_spirals(n, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    per = n // classes
    xs, ys = [], []
    for c in range(classes):
        r = np.linspace(0.05, 1.0, per)
        theta = c * 2 * np.pi / classes + r * 4 + 0.2 * rng.randn(per)
        xs.append(np.stack([r * np.sin(theta), r * np.cos(theta)], axis=1))
        ys.append(np.full(per, c))
    x, y = np.concatenate(xs).astype("float32"), np.concatenate(ys).astype("int64")
    perm = rng.permutation(len(x))
    return x[perm], y[perm]


def main():
    hvd.init()
    keras = tf.keras

    x, y = make_spirals(args.samples, seed=args.seed)
    # Shard by rank, dropping the remainder so every rank runs the same number of steps.
    n = len(x) - len(x) % hvd.size()
    x_local, y_local = x[hvd.rank():n:hvd.size()], y[hvd.rank():n:hvd.size()]

    keras.utils.set_random_seed(args.seed + hvd.rank())   # rank 0's weights win (callback)
    model = keras.Sequential([
        keras.Input((2,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(3),
    ])
    # Scale the learning rate by the number of ranks (the global batch grows with it); the
    # warmup callback ramps it up from the one-rank value.
    opt = keras.optimizers.Adam(learning_rate=args.lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(opt, compression=compression)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [
        # Start every rank from rank 0's weights and optimizer state.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Average the epoch's metrics over the ranks (before anything reads them).
        hvd.callbacks.MetricAverageCallback(),
        # Gradual learning-rate warmup: large global batches are unstable at first.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * hvd.size(),
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        # Only one rank writes checkpoints.
        callbacks.append(keras.callbacks.ModelCheckpoint(args.checkpoint))

    history = model.fit(x_local, y_local, batch_size=args.batch_size, epochs=args.epochs,
                        callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        loss, acc = history.history["loss"][-1], history.history["accuracy"][-1]
        print(f"final loss {loss:.4f}  accuracy {acc:.3f}  ranks {hvd.size()}  "
              f"checkpoint {args.checkpoint}")
        # The checkpoint is a plain Keras model: no hvdlite needed to load it.
        restored = keras.models.load_model(args.checkpoint)
        print(f"checkpoint optimizer: {type(restored.optimizer).__name__}")


if __name__ == "__main__":
    main()
