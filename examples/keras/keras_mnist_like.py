"""A Keras training script written for `horovod.keras`, unchanged but for the import.

    hvdlite-run -np 2 python examples/keras/keras_mnist_like.py                        # TF
    KERAS_BACKEND=torch hvdlite-run -np 2 python examples/keras/keras_mnist_like.py    # PyTorch

Synthetic MNIST-shaped data (no download): 10 classes of noisy prototypes.
"""
import os

import keras
import numpy as np

import hvdlite.keras as hvd          # was: import horovod.keras as hvd

hvd.init()

# Data: each rank reads its own shard.
rng = np.random.RandomState(1234)
prototypes = rng.rand(10, 28 * 28).astype("float32")
labels = rng.randint(0, 10, size=4096)
images = (prototypes[labels] + 0.3 * rng.randn(4096, 28 * 28)).astype("float32")
x_train, y_train = images[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]

model = keras.Sequential([
    keras.Input((28 * 28,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])

# Horovod: scale the learning rate by the number of workers, wrap the optimizer.
opt = keras.optimizers.SGD(learning_rate=0.01 * hvd.size(), momentum=0.9)
opt = hvd.DistributedOptimizer(opt)
model.compile(loss="sparse_categorical_crossentropy", optimizer=opt, metrics=["accuracy"])

callbacks = [
    # Horovod: start every rank from rank 0's weights.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average the metrics over the ranks at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: warm the learning rate up from 0.01 to 0.01 * size over the first epoch.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=1,
                                             verbose=1),
]
# Horovod: save checkpoints only on rank 0.
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(os.environ.get("CHECKPOINT_DIR", "/tmp"), "checkpoint-{epoch}.keras")))

history = model.fit(x_train, y_train, batch_size=64, epochs=int(os.environ.get("EPOCHS", 3)),
                    callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
if hvd.rank() == 0:
    print(f"backend {keras.backend.backend()}: final loss {history.history['loss'][-1]:.4f}, "
          f"accuracy {history.history['accuracy'][-1]:.3f}")
