"""Horovod's Keras callbacks on Keras 3's torch backend (collectives through hvdlite.torch).
Same names, arguments and behaviour as hvdlite.tensorflow.keras.callbacks."""
from __future__ import annotations

import keras
import numpy as np
import torch

from .. import torch as _hvd
from ._torch import broadcast_variables


def _variables(obj) -> list:
    v = obj.variables
    return list(v() if callable(v) else v)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from `root_rank` when training
    starts, so every rank starts from the same state."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self.local_variables = [] if local_variables is None else list(local_variables)

    def register_local_var(self, var):
        self.local_variables.append(var)

    def _filtered(self, variables):
        local = {id(v) for v in self.local_variables}
        return [v for v in variables if id(v) not in local]

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not getattr(opt, "built", True) and self.model.built:
            opt.build(self.model.trainable_variables)
        variables = self._filtered(self.model.variables)
        if opt is not None:
            variables += self._filtered(_variables(opt))
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over the ranks at the end of every epoch."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                      np.issubdtype(np.asarray(v).dtype, np.number))
        if not keys:
            return
        values = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64)
        reduced = _hvd.allreduce(values, name="MetricAverageCallback.metrics", op=_hvd.Average)
        for k, v in zip(keys, reduced.tolist()):
            logs[k] = v


def _get_lr(opt) -> float:
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


def _set_lr(opt, value: float) -> None:
    opt.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """`initial_lr * multiplier(epoch)` between start_epoch and end_epoch, at each epoch start
    (`staircase`) or each batch; momentum correction rescales SGD's momentum buffers by
    new_lr / old_lr (Keras 3's momentum coefficient is a constant)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.multiplier = multiplier if callable(multiplier) else (lambda e: multiplier ** e)

    def _adjust_learning_rate(self, epoch):
        opt = self.model.optimizer
        old_lr = _get_lr(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(opt, new_lr)
        if not self.momentum_correction or old_lr == 0 or new_lr == old_lr:
            return
        if float(getattr(opt, "momentum", 0.0) or 0.0) != 0.0:
            for buf in getattr(opt, "momentums", None) or []:
                buf.assign(buf.value * (new_lr / old_lr))

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"Could not autodetect the number of steps per epoch. Please "
                                 f"specify the steps_per_epoch parameter to the "
                                 f"{type(self).__name__}().")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch or
                (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup from `initial_lr / size` to `initial_lr` over `warmup_epochs`."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = _hvd.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint with save_best_only=True; filepath may be set later."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        placeholder = filepath or ("best.weights.h5" if save_weights_only else "best.keras")
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
