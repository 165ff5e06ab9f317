"""Train a Keras 3 classifier on a Ray cluster with hvdlite.tensorflow.keras: a Horovod Keras
script, run by RayExecutor (default) or Ray Train (--ray-train).

    ray start --head
    python examples/ray/keras_ray_train.py --num-workers 2
    python examples/ray/keras_ray_train.py --num-workers 2 --ray-train
"""
import argparse
import os

import numpy as np
import ray

parser = argparse.ArgumentParser(description="hvdlite on Ray: Keras")
parser.add_argument("--address", default=None)
parser.add_argument("--num-workers", type=int, default=2)
parser.add_argument("--cpus-per-worker", type=float, default=1)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--ray-train", action="store_true")
args = parser.parse_args()


def make_spirals(n=3000, classes=3, seed=0):
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


def train(epochs: int, report=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import hvdlite.tensorflow.keras as hvd

    hvd.init()
    keras = tf.keras
    x, y = make_spirals()
    n = len(x) - len(x) % hvd.size()
    x, y = x[hvd.rank():n:hvd.size()], y[hvd.rank():n:hvd.size()]
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01 * hvd.size()))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if report is not None:
        class Report(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                report({"epoch": epoch, **{k: float(v) for k, v in (logs or {}).items()}})
        callbacks.append(Report())
    history = model.fit(x, y, batch_size=64, epochs=epochs, callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    return float(history.history["accuracy"][-1])


def ray_train_loop(config):
    import ray.train

    train(config["epochs"], report=ray.train.report)


def main():
    ray.init(address=args.address)
    if args.ray_train:
        from ray.train import ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        from hvdlite.ray import HvdliteConfig

        result = DataParallelTrainer(
            ray_train_loop, train_loop_config={"epochs": args.epochs},
            backend_config=HvdliteConfig(),
            scaling_config=ScalingConfig(num_workers=args.num_workers,
                                         resources_per_worker={"CPU": args.cpus_per_worker}),
        ).fit()
        print("Ray Train result:", result.metrics, "error:", result.error)
        return
    from hvdlite.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120),
                           num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker)
    executor.start()
    try:
        print("final accuracy per rank:", executor.run(train, args=[args.epochs]))
    finally:
        executor.shutdown()


if __name__ == "__main__":
    main()
