"""A custom TensorFlow 2 training loop (`tf.function` + `tf.GradientTape`) on several ranks.

    hvdlite-run -np 2 python examples/tensorflow/tensorflow2_train.py

hvd.DistributedGradientTape averages the gradients over the ranks inside the compiled step;
hvd.broadcast_variables starts every rank from rank 0's weights and optimizer state (after the
first step, once the optimizer has its slots, as in Horovod's example).
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402  (was: import horovod.tensorflow as hvd)

parser = argparse.ArgumentParser(description="hvdlite TensorFlow 2 GradientTape example")
parser.add_argument("--steps", type=int, default=300, help="training steps")
parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
parser.add_argument("--lr", type=float, default=0.005, help="learning rate for one rank")
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
    return np.concatenate(xs).astype("float32"), np.concatenate(ys).astype("int64")


def main():
    hvd.init()
    keras = tf.keras

    x, y = make_spirals(4096, seed=args.seed)
    # Every rank shuffles differently (its own seed) and takes its own batches.
    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .shard(hvd.size(), hvd.rank())
               .repeat()
               .shuffle(2048, seed=args.seed + hvd.rank())
               .batch(args.batch_size))

    keras.utils.set_random_seed(args.seed + hvd.rank())
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(3)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Scale the learning rate with the number of ranks (the global batch grows with it).
    opt = keras.optimizers.Adam(args.lr * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        # Average the gradients over the ranks.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Broadcast the initial variables from rank 0 after the first step, when the optimizer
        # has created its slots (a graph branch that runs once).
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    for step, (images, labels) in enumerate(dataset.take(args.steps)):
        loss = training_step(images, labels, step == 0)
        if step % 50 == 0 and hvd.rank() == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}")

    # Evaluate on the whole set, averaged over the ranks.
    acc = tf.reduce_mean(tf.cast(tf.argmax(model(x), axis=1) == y, tf.float32))
    acc = hvd.allreduce(acc, name="accuracy")
    if hvd.rank() == 0:
        print(f"final loss {float(loss):.4f}  accuracy {float(acc):.3f}  ranks {hvd.size()}")


if __name__ == "__main__":
    main()
