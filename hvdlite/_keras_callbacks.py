"""What Horovod's Keras callbacks (and its elastic ones) do, once, for both Keras frontends.

hvdlite has two: `hvdlite.tensorflow.keras.callbacks` (Keras 3 or tf_keras on TensorFlow) and
`hvdlite.keras.callbacks` on Keras 3's torch backend. Their callbacks have the same names,
arguments and behaviour, so the behaviour lives here, in mixins that import no framework and
no Keras; each frontend subclasses them with the Keras callback class it runs on and supplies
the few operations that differ (how a variable is broadcast, how numbers are averaged, how a
learning rate is read and set).

Why one place: while each frontend kept its own copy, the torch backend's copy fell behind
(no momentum correction for RMSprop's `_momentums`, no steps-per-epoch from `samples` and
`batch_size`, Keras' own error instead of ours for a learning-rate schedule).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .common import basics as _basics


def optimizer_variables(opt) -> list:
    """An optimizer's variables: a property on Keras 3, a method on tf_keras' legacy ones.
    (Also a model's: `variables` is a property there.)"""
    v = opt.variables
    return list(v() if callable(v) else v)


def local_layer_list(local_layers, layer_cls) -> list:
    """Horovod's `local_layers` argument (None, one Keras layer or a collection of them) as a
    list, refusing anything that is not a `layer_cls` (Horovod's message)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, layer_cls):
        return [local_layers]
    layers = list(local_layers)
    bad = [type(layer).__name__ for layer in layers if not isinstance(layer, layer_cls)]
    if bad:
        raise ValueError(f"All local layers must be of tf.keras.layers.Layer type, got "
                         f"{', '.join(bad)}")
    return layers


def built_layer_variables(layers: list) -> tuple[list, list]:
    """(the trainable variables of the built layers among `layers`, the layers not built yet).

    Why: PartialDistributedOptimizer registers its local layers' variables when they exist.
    A Keras 3 layer has none before the model's first call, and a model is often wrapped
    before; Horovod collected them at wrap time only, found nothing then, and averaged every
    "local" layer without a word."""
    found, waiting = [], []
    for layer in layers:
        if getattr(layer, "built", True):
            found.extend(layer.trainable_weights)
        else:
            waiting.append(layer)
    return found, waiting


def require_built(model) -> None:
    """An elastic state's model must be built, as Horovod's TensorFlowKerasState requires (its
    message): an unbuilt model has no variables, so its saved state would be empty, silently."""
    if hasattr(model, "build") and not model.built:
        raise ValueError("Model must be built first. Run `model.build(input_shape)`.")


def momentum_buffers(opt) -> list:
    """The variables holding the learning-rate-scaled momentum: SGD's `momentums`, RMSprop's
    `_momentums` (Keras 3), else the optimizer variables named like a momentum."""
    for attr in ("momentums", "_momentums"):
        bufs = getattr(opt, attr, None)
        if bufs:
            return [b for b in bufs if b is not None]
    out = []
    for v in optimizer_variables(opt):
        name = str(getattr(v, "path", None) or getattr(v, "name", ""))
        if "momentum" in name.rsplit("/", 1)[-1].lower():
            out.append(v)
    return out


def check_settable_lr(opt) -> None:
    """Raise a clear error when `opt`'s learning rate cannot be set to a number: it was created
    with a learning-rate schedule or another callable (Keras would raise a TypeError of its own
    in the middle of training, tf_keras would replace the schedule silently)."""
    for attr in ("_learning_rate", "learning_rate"):
        lr = getattr(opt, attr, None)
        if callable(lr) and not hasattr(lr, "assign") and not hasattr(lr, "numpy"):
            raise ValueError(f"{type(opt).__name__} was created with a learning-rate schedule "
                             f"({type(lr).__name__}); hvdlite's learning-rate callbacks need a "
                             f"float learning rate")


def numeric_metric_keys(logs: Optional[dict]) -> list:
    """The keys of `logs` holding one number, sorted: the same order on every rank."""
    if not logs:
        return []
    return sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                  np.issubdtype(np.asarray(v).dtype, np.number))


class BroadcastGlobalVariablesLogic:
    """Broadcast the model's and the optimizer's variables from `root_rank`, so every rank
    starts from the same state (random initialisation, or a checkpoint that only `root_rank`
    loaded).

    Keras 3 builds the optimizer before training (here, if Keras has not yet), so everything
    is broadcast in `on_train_begin`; when the optimizer only creates its slots in the first
    step (tf_keras), its variables follow at the end of the first batch, as in Horovod.

    A frontend supplies `_broadcast_variables(variables)`, and may override `_var_key(v)` (a
    hashable identity), `_build_optimizer()` and `_optimizer_ready()`."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self.local_variables = [] if local_variables is None else list(local_variables)

    def register_local_var(self, var):
        """Exclude `var` from the broadcast (a per-rank variable)."""
        self.local_variables.append(var)

    @staticmethod
    def _var_key(v) -> Any:
        return id(v)

    def _broadcast_variables(self, variables: list) -> None:
        raise NotImplementedError

    def _filtered(self, variables) -> list:
        local = {self._var_key(v) for v in self.local_variables}
        return [v for v in variables if self._var_key(v) not in local]

    def _broadcast(self, with_optimizer: bool) -> None:
        self._broadcast_variables(self._filtered(self.model.variables))
        opt = getattr(self.model, "optimizer", None)
        if with_optimizer and opt is not None:
            variables = self._filtered(optimizer_variables(opt))
            if variables:
                self._broadcast_variables(variables)

    def _optimizer_ready(self) -> bool:
        opt = getattr(self.model, "optimizer", None)
        if opt is None:
            return True
        if getattr(opt, "built", None) is True:
            return True
        return bool(optimizer_variables(opt)) and not hasattr(opt, "_create_all_weights")

    def _build_optimizer(self) -> None:
        """Keras 3 builds the optimizer while tracing the first step; build it now, so its
        state (e.g. restored from a checkpoint on the root rank only) is broadcast before the
        first update."""
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not getattr(opt, "built", True) and \
                getattr(self.model, "built", False):
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


class MetricAverageLogic:
    """Average the epoch's metrics (`logs`) over the ranks at the end of every epoch, so every
    rank (and every later callback) sees the global values. Put it before callbacks that read
    the metrics (checkpointing, early stopping, learning-rate schedules).

    A frontend supplies `_allreduce_average(values)`: float64 numbers in, their averages out."""

    METRICS_NAME = "MetricAverageCallback.metrics"

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def _allreduce_average(self, values: list) -> list:
        raise NotImplementedError

    def _average_metrics_in_place(self, logs):
        keys = numeric_metric_keys(logs)
        if not keys:
            return
        for k, v in zip(keys, self._allreduce_average([float(logs[k]) for k in keys])):
            logs[k] = v

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


class LearningRateScheduleLogic:
    """Set the learning rate to `initial_lr * multiplier(epoch)` between `start_epoch` and
    `end_epoch` (exclusive), at each epoch start (`staircase`) or each batch (smoothly).

    `multiplier` is a number (exponential decay: `multiplier ** epoch`) or a function of the
    (fractional) epoch. With `momentum_correction` (Goyal et al., 2017) the momentum is rescaled
    when the learning rate changes: on Keras 3 optimizers, whose momentum coefficient is a
    constant of the compiled step, by scaling the momentum buffers (momentum_buffers) by
    new_lr / old_lr, which is the same update as Horovod's scaling of the coefficient for one
    batch. A frontend supplies `_get_lr(opt)` and `_set_lr(opt, value)`, and may override
    `_correct_momentum(opt, old_lr, new_lr)` and `_restore_momentum_if_needed()`."""

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
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        # A constant is exponential decay from start_epoch on (Horovod's: the exponent counts
        # the epochs since start_epoch, so the schedule begins at initial_lr).
        self.multiplier: Callable[[float], float] = \
            multiplier if callable(multiplier) else \
            (lambda epoch: multiplier ** (epoch - start_epoch))

    @staticmethod
    def _get_lr(opt) -> float:
        raise NotImplementedError

    @staticmethod
    def _set_lr(opt, value: float) -> None:
        raise NotImplementedError

    def _correct_momentum(self, opt, old_lr: float, new_lr: float) -> None:
        if float(getattr(opt, "momentum", 0.0) or 0.0) == 0.0:
            return
        ratio = new_lr / old_lr
        for buf in momentum_buffers(opt):
            buf.assign(buf.value * ratio)

    def _restore_momentum_if_needed(self) -> None:
        pass

    def _autodetect_steps_per_epoch(self) -> int:
        if self.params.get("steps"):
            return self.params["steps"]
        if self.params.get("samples") and self.params.get("batch_size"):
            return self.params["samples"] // self.params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch: float) -> None:
        opt = self.model.optimizer
        check_settable_lr(opt)
        old_lr = self._get_lr(opt)
        new_lr = self.initial_lr * self.multiplier(epoch)
        self._set_lr(opt, new_lr)
        if self.momentum_correction and old_lr != 0 and new_lr != old_lr:
            self._correct_momentum(opt, old_lr, new_lr)

    def on_train_begin(self, logs=None):
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
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._get_lr(self.model.optimizer)


class LearningRateWarmupLogic:
    """Gradual learning-rate warmup (Goyal et al., 2017): from `initial_lr / size` to
    `initial_lr` over `warmup_epochs`, adjusted every batch. Mixed into a frontend's
    LearningRateScheduleCallback."""

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
                  f"{self._get_lr(self.model.optimizer):g}.")


class BestModelCheckpointLogic:
    """Save the model with the best value of `monitor` seen so far (ModelCheckpoint with
    `save_best_only=True`). `filepath` may be given here or set later (`callback.filepath =`),
    as Horovod's estimators do; it must be set before training starts. Mixed into the Keras
    `ModelCheckpoint` a frontend runs on; `_placeholder(save_weights_only)` names the file
    Keras is given until then (it checks the suffix)."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", filepath=None):
        if isinstance(save_weights_only, str) and save_weights_only in ("auto", "min", "max"):
            # horovod.keras's order, (monitor, verbose, mode, save_freq), which has no
            # save_weights_only (horovod.tensorflow.keras's, this one, has): a mode passed
            # third would have made every save a weights-only one in the default mode.
            if mode != "auto":
                save_freq = mode
            save_weights_only, mode = False, save_weights_only
        elif not isinstance(save_weights_only, bool):
            raise ValueError(f"BestModelCheckpoint: save_weights_only must be True or False, "
                             f"got {save_weights_only!r}")
        super().__init__(filepath=filepath or self._placeholder(save_weights_only),
                         monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    @staticmethod
    def _placeholder(save_weights_only: bool) -> str:
        return "best.weights.h5" if save_weights_only else "best.keras"

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint needs a filepath: pass filepath=... or set "
                             "callback.filepath before model.fit()")
        parent = getattr(super(), "on_train_begin", None)
        if parent is not None:
            parent(logs)


# ---------------------------------------------------------------------- elastic training
class CommitStateLogic:
    """Commit `state` every `batches_per_commit` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit <= 0:
            raise ValueError("batches_per_commit must be > 0")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # Every rank starts counting afresh after a reset, so they commit at the same steps.
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        self.state.commit()


class UpdateBatchStateLogic:
    """Track the batch of the current epoch in `state.batch` (0 at epoch ends); when training
    resumes mid-epoch, shorten that epoch by the batches already done (where Keras reads
    `params['steps']`: tf_keras)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateLogic:
    """Track the global epoch in `state.epoch` across resets (Keras counts from 0 at every
    `fit`): use `model.fit(..., epochs=total - state.epoch)`."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
