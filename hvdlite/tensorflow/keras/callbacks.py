"""Horovod's Keras callbacks (horovod.tensorflow.keras.callbacks), for Keras 3 and tf_keras.

They subclass the callbacks of the Keras that `tf.keras` resolves to. Callbacks run eagerly
(between steps), so their collectives are plain eager ones.
"""
from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from ...common import basics as _basics
from .. import mpi_ops as _ops
from ..functions import broadcast_variables
from .optimizer import is_distributed, is_keras3

_keras = tf.keras


def _optimizer_variables(opt) -> list:
    v = opt.variables
    return list(v() if callable(v) else v)


def _avoid_xla(model) -> None:
    """hvdlite's gradient allreduce cannot run under XLA; Keras 3 turns XLA on by itself on GPUs
    (jit_compile="auto"). Turn it off for a model that trains with a DistributedOptimizer."""
    opt = getattr(model, "optimizer", None)
    if opt is None or not is_distributed(opt) or not is_keras3():
        return
    try:
        jit = model.jit_compile
    except Exception:
        return
    if jit:
        warnings.warn("hvdlite: compiling this model's train step without XLA "
                      "(jit_compile=False): hvdlite's gradient allreduce cannot run inside XLA.")
        model.jit_compile = False
        model.train_function = None


class _HvdCallback(_keras.callbacks.Callback):
    def set_model(self, model):
        super().set_model(model)
        _avoid_xla(model)


class BroadcastGlobalVariablesCallback(_HvdCallback):
    """Broadcast the model's and the optimizer's variables from `root_rank`, so every rank starts
    from the same state (random initialisation, or a checkpoint that only `root_rank` loaded).

    Keras 3 builds the optimizer before training, so everything is broadcast in
    `on_train_begin`; when the optimizer only creates its slots in the first step (tf_keras), the
    optimizer variables follow at the end of the first batch, as in Horovod.
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self.local_variables = [] if local_variables is None else list(local_variables)

    def register_local_var(self, var):
        """Exclude `var` from the broadcast (a per-rank variable)."""
        self.local_variables.append(var)

    def _filtered(self, variables):
        from ..gradients import var_ref
        local = {var_ref(v) for v in self.local_variables}
        return [v for v in variables if var_ref(v) not in local]

    def _broadcast(self, with_optimizer: bool) -> None:
        broadcast_variables(self._filtered(self.model.variables), root_rank=self.root_rank)
        opt = getattr(self.model, "optimizer", None)
        if with_optimizer and opt is not None:
            variables = self._filtered(_optimizer_variables(opt))
            if variables:
                broadcast_variables(variables, root_rank=self.root_rank)

    def _optimizer_ready(self) -> bool:
        opt = getattr(self.model, "optimizer", None)
        if opt is None:
            return True
        if getattr(opt, "built", None) is True:
            return True
        return bool(_optimizer_variables(opt)) and not hasattr(opt, "_create_all_weights")

    def _build_optimizer(self) -> None:
        """Keras 3 builds the optimizer while tracing the first step (without a distribution
        strategy); build it now, as Keras does under a strategy, so its state (e.g. restored
        from a checkpoint on the root rank only) is broadcast before the first update."""
        opt = getattr(self.model, "optimizer", None)
        if opt is None or not is_keras3() or getattr(opt, "built", True) or \
                not getattr(self.model, "built", False):
            return
        import keras
        with keras.name_scope(opt.name, caller=opt):
            opt.build(self.model.trainable_variables)

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        self._build_optimizer()
        ready = self._optimizer_ready()
        self._broadcast(with_optimizer=ready)
        self.broadcast_done = ready

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast(with_optimizer=True)
        self.broadcast_done = True


class MetricAverageCallback(_HvdCallback):
    """Average the epoch's metrics (`logs`) over the ranks at the end of every epoch, so every
    rank (and every later callback) sees the global values. Put it before callbacks that read
    the metrics (checkpointing, early stopping, learning-rate schedules)."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def _average_metrics_in_place(self, logs):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                      np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        reduced = _ops._allreduce(values, name="MetricAverageCallback.metrics", op=_ops.Average)
        for k, v in zip(keys, reduced.numpy().tolist()):
            logs[k] = v

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


def _get_lr(opt) -> float:
    lr = getattr(opt, "learning_rate", None)
    if lr is None:
        lr = getattr(opt, "lr")
    if callable(lr) and not hasattr(lr, "numpy") and not isinstance(lr, tf.Variable):
        raise ValueError(f"{type(opt).__name__} was created with a learning-rate schedule "
                         f"({type(lr).__name__}); hvdlite's learning-rate callbacks need a "
                         f"float learning rate")
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def _set_lr(opt, value: float) -> None:
    if hasattr(opt, "learning_rate"):
        lr = opt.learning_rate
        if hasattr(lr, "assign"):
            lr.assign(value)
        else:
            opt.learning_rate = value
    else:
        tf.keras.backend.set_value(opt.lr, value)


def _momentum_buffers(opt) -> list:
    """The variables holding the lr-scaled momentum of SGD / RMSprop-with-momentum."""
    for attr in ("momentums", "_momentums"):
        bufs = getattr(opt, attr, None)
        if bufs:
            return [b for b in bufs if b is not None]
    out = []
    for v in _optimizer_variables(opt):
        name = str(getattr(v, "path", None) or getattr(v, "name", ""))
        if "momentum" in name.rsplit("/", 1)[-1].lower():
            out.append(v)
    return out


class LearningRateScheduleCallback(_HvdCallback):
    """Set the learning rate to `initial_lr * multiplier(epoch)` between `start_epoch` and
    `end_epoch` (exclusive), at each epoch start (`staircase`) or each batch (smoothly).

    `multiplier` is a number (exponential decay: `multiplier ** epoch`) or a function of the
    (fractional) epoch. With `momentum_correction` (Goyal et al., 2017) the momentum is rescaled
    when the learning rate changes: on optimizers whose momentum is a variable (tf_keras legacy)
    by scaling the coefficient for one batch, as Horovod; on Keras 3 optimizers (whose momentum
    coefficient is a constant of the compiled step) by scaling the momentum buffers by
    new_lr / old_lr, which is the same update.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.initial_lr = initial_lr
        self.restore_momentum = None
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if not callable(multiplier):
            self.multiplier = lambda epoch: multiplier ** epoch
        else:
            self.multiplier = multiplier

    def _autodetect_steps_per_epoch(self):
        if self.params.get("steps"):
            return self.params["steps"]
        if self.params.get("samples") and self.params.get("batch_size"):
            return self.params["samples"] // self.params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        opt = self.model.optimizer
        old_lr = _get_lr(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(opt, new_lr)
        if not self.momentum_correction or old_lr == 0 or new_lr == old_lr:
            return
        momentum = getattr(opt, "momentum", None)
        if momentum is None:
            return
        if hasattr(momentum, "assign") or isinstance(momentum, tf.Variable):
            # Variable coefficient (tf_keras legacy optimizers): scale it for this batch.
            self.restore_momentum = tf.keras.backend.get_value(momentum)
            tf.keras.backend.set_value(momentum, self.restore_momentum * new_lr / old_lr)
        elif float(momentum) != 0.0:
            ratio = new_lr / old_lr
            for buf in _momentum_buffers(opt):
                buf.assign(buf * tf.cast(ratio, tf.as_dtype(buf.dtype)))

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            tf.keras.backend.set_value(self.model.optimizer.momentum, self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = _get_lr(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch or
                (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            epoch = self.current_epoch + float(batch) / self.steps_per_epoch
            self._adjust_learning_rate(epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual learning-rate warmup (Goyal et al., 2017): from `initial_lr / size` to
    `initial_lr` over `warmup_epochs`, adjusted every batch."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Round numbers at the end of each epoch, as Horovod (nicer TensorBoard curves).
            epoch += 1.0 / self.steps_per_epoch
            size = _basics.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(_keras.callbacks.ModelCheckpoint):
    """Save the model with the best value of `monitor` seen so far (ModelCheckpoint with
    `save_best_only=True`). `filepath` may be given here or set later (`callback.filepath =`),
    as Horovod's estimators do; it must be set before training starts."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        placeholder = filepath
        if placeholder is None:
            placeholder = "best.weights.h5" if save_weights_only else "best.keras"
            if not is_keras3():
                placeholder = "best.h5"
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint needs a filepath: pass filepath=... or set "
                             "callback.filepath before model.fit()")
        parent = getattr(super(), "on_train_begin", None)
        if parent is not None:
            parent(logs)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]
