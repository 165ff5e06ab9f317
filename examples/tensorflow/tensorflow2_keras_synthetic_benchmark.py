"""Keras `model.fit` training throughput on synthetic data, in the shape of Horovod's
tensorflow2_keras_synthetic_benchmark.py (no data set, no download).

    hvdlite-run -np 1 python examples/tensorflow/tensorflow2_keras_synthetic_benchmark.py
    hvdlite-run -np 2 python examples/tensorflow/tensorflow2_keras_synthetic_benchmark.py

Every rank trains on its own batches (`--batch-size` each); the printed total is samples per
second over all ranks (the sum of every rank's median over `--num-iters` timed epochs of
`--num-batches-per-iter` steps; the mean and its spread are printed too). Compare the totals of
-np 1 and -np 2 at the same per-rank batch and the same `--threads` per rank to see the scaling.
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser(description="Keras model.fit synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=20)
parser.add_argument("--num-iters", type=int, default=5)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
args = parser.parse_args()

tf.config.threading.set_intra_op_parallelism_threads(args.threads)
tf.config.threading.set_inter_op_parallelism_threads(args.threads)

import hvdlite.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras


def build_model():
    if args.model == "cnn":
        s = args.image_size
        return keras.Sequential([
            keras.Input((s, s, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ])
    return keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(1024, activation="relu"),
                             keras.layers.Dense(10)])


class Timer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def main():
    hvd.init()
    model = build_model()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9),
                                   compression=compression)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    shape = (args.image_size, args.image_size, 3) if args.model == "cnn" else (1024,)
    n = args.batch_size * args.num_batches_per_iter
    rng = np.random.RandomState(hvd.rank())
    x = rng.rand(n, *shape).astype("float32")
    y = rng.randint(0, 10, size=n)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).cache().repeat()

    params = model.count_params()
    if hvd.rank() == 0:
        print(f"Model: {args.model} ({params / 1e6:.2f} M parameters, "
              f"{params * 4 / 2 ** 20:.1f} MiB of gradients per step)")
        print(f"Batch size: {args.batch_size} per rank; ranks: {hvd.size()}; "
              f"TensorFlow threads per rank: {args.threads}")

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    model.fit(dataset, steps_per_epoch=args.num_warmup_batches, epochs=1, verbose=0,
              callbacks=callbacks)
    timer = Timer()
    model.fit(dataset, steps_per_epoch=args.num_batches_per_iter, epochs=args.num_iters,
              verbose=0, callbacks=[timer])

    rates = np.array([args.batch_size * args.num_batches_per_iter / t for t in timer.times])
    # Every rank's median rate (robust to other load on a shared machine), summed: the job's
    # throughput.
    total = float(hvd.allreduce(np.float64(np.median(rates)), op=hvd.Sum, name="bench.total"))
    if hvd.rank() == 0:
        for i, r in enumerate(rates):
            print(f"Iter #{i}: {r:.1f} samples/sec per rank")
        conf = 1.96 * rates.std()
        print(f"Samples/sec per rank: median {np.median(rates):.1f}, mean {rates.mean():.1f} "
              f"+-{conf:.1f}")
        print(f"Total samples/sec on {hvd.size()} rank(s): {total:.1f}")


if __name__ == "__main__":
    main()
