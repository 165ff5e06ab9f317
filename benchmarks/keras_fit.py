"""Keras 3 `model.fit` and `DistributedGradientTape` through hvdlite, against the torch frontend
and one plain process, on the same MLP (512 -> 1024 -> 1024 -> 1024 -> 10, 3.7 M parameters,
SGD, batch 64 per rank).

    python benchmarks/keras_fit.py [--rounds 5] [--steps 40] [--json out.json]

Ranks are separate processes, so this is a driver: each round it launches every configuration
once, one after the other (A B C D E F, A B C D E F, ...), each through `hvdlite-run` (or as one
plain process), and collects the samples/s that the run's rank 0 prints as a JSON line. Each run
warms up (one fit/loop that traces the graph and fills the engine's caches), collects the garbage
that tracing left (see _settle), then times `--steps` steps: for Keras from the first batch's
start to the last batch's end (the whole fit() call, with Keras' set-up and the end of its
tf.data iterator, is printed beside it; see _step_marks). samples/s counts the samples of all
ranks. The table gives the median over the rounds,
the spread (min-max) and the ratios the targets are stated in.

Configurations (every rank, and the plain process unless it says otherwise, use 1 thread):
  keras_np1   Keras model.fit, hvdlite DistributedOptimizer, 1 rank
  keras_np2   the same, 2 ranks
  tape_np2    custom loop, hvd.DistributedGradientTape inside tf.function, 2 ranks
  torch_np2   hvdlite.torch DistributedOptimizer, same model shape, 2 ranks
  plain_1t    Keras model.fit, no hvdlite, one process, 1 thread
  plain_2t    the same with 2 threads (what one process makes of both cores)
  compute_np2 2 ranks of keras_np2 with a plain optimizer: no gradient exchange, the ranks only
              start and stop together. Both cores compute, so this is the most any 2-rank
              job reaches on this machine: the physical limit for keras_np2
  jax_keras_np1, jax_keras_np2, jax_plain_1t, jax_compute_np2
              the same four on Keras 3's JAX backend (KERAS_BACKEND=jax, hvdlite.keras, the
              step compiled by jax.jit, its gradients reduced by a host callback inside it),
              in the same alternation as the TensorFlow backend's, so the two compare
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 64
SIZES = (512, 1024, 1024, 1024, 10)
MARK = "KERAS_FIT_RESULT "

CONFIGS = {
    # name: (worker mode, ranks, threads)
    "keras_np1": ("keras", 1, 1),
    "keras_np2": ("keras", 2, 1),
    "tape_np2": ("tape", 2, 1),
    "torch_np2": ("torch", 2, 1),
    "plain_1t": ("plain", 0, 1),
    "plain_2t": ("plain", 0, 2),
    "compute_np2": ("compute", 2, 1),
    "jax_keras_np1": ("jax_keras", 1, 1),
    "jax_keras_np2": ("jax_keras", 2, 1),
    "jax_plain_1t": ("jax_plain", 0, 1),
    "jax_compute_np2": ("jax_compute", 2, 1),
}
# One thread for XLA's CPU client too (its Eigen pool and its intra-op threads).
JAX_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


# ---------------------------------------------------------------------- workers
def _settle() -> None:
    """Collect the warm-up's garbage before timing, in every configuration alike.

    Tracing a Keras/TF graph leaves many Python objects behind, and the first full (generation
    2) collection after it takes 0.25-0.6 s in a process that has imported TF, Keras and torch
    (measured with gc.callbacks). Left to chance it lands inside the 40 timed steps, at a
    different step on each rank, and in a data-parallel job every rank waits for the one that
    is collecting, so one pause costs each rank's pause on the whole job. A long training run
    pays it once; a 1.5-second measurement would be dominated by it."""
    gc.collect()


def _tf_setup(threads: int):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def _keras_model(tf):
    import keras
    keras.utils.set_random_seed(0)
    layers = [keras.Input((SIZES[0],))]
    layers += [keras.layers.Dense(n, activation="relu") for n in SIZES[1:-1]]
    layers.append(keras.layers.Dense(SIZES[-1]))
    return keras.Sequential(layers)


def _data(steps: int, rank: int):
    import numpy as np
    rng = np.random.RandomState(rank)
    x = rng.randn(steps * BATCH, SIZES[0]).astype("float32")
    y = rng.randint(0, SIZES[-1], size=(steps * BATCH,)).astype("int64")
    return x, y


def _step_marks(keras):
    """A callback that times fit's steps: from the first batch's start to the last one's end.

    The whole `fit()` call also holds Keras' set-up and the end of its tf.data iterator. In
    TensorFlow 2.21 that end waits for the tf.data autotuner's thread to finish its current
    sleep (seen in a native stack: ~RootDataset::Iterator waiting on Model::OptimizeLoop), 0 to
    ~0.6 s per fit() call at random, in a plain process as in a distributed one. It is reported
    beside the step rate ("fit_samples_per_s"), not mixed into it: the step rate is what the
    distributed optimizer changes, and what the tape and torch loops measure."""
    class StepMarks(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.first = self.last = None

        def on_train_batch_begin(self, batch, logs=None):
            if self.first is None:
                self.first = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()

    return StepMarks()


def worker_keras(args, distributed: bool, reduce: bool = True, backend: str = "tensorflow"
                 ) -> dict:
    import numpy as np
    tf = _tf_setup(args.threads) if backend == "tensorflow" else None
    import keras
    rank, size, callbacks = 0, 1, []
    opt = keras.optimizers.SGD(0.01)
    if distributed:
        if backend == "tensorflow":
            import hvdlite.tensorflow.keras as hvd
        else:
            import hvdlite.keras as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        if reduce:
            opt = hvd.DistributedOptimizer(opt)
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    model = _keras_model(tf)
    # (On JAX an uncompiled step runs op by op; compiled is how Keras runs there.)
    model.compile(optimizer=opt, jit_compile=backend == "jax",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(args.steps, rank)
    model.fit(x[:args.warmup * BATCH], y[:args.warmup * BATCH], batch_size=BATCH, epochs=1,
              verbose=0, shuffle=False, callbacks=callbacks)
    _settle()
    if distributed:
        hvd.allreduce(np.zeros(1, np.float32), name="keras_fit.sync")
    marks = _step_marks(keras)
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[marks])
    dt_fit = time.perf_counter() - t0
    dt = marks.last - marks.first
    if distributed:
        both = hvd.allreduce(np.array([dt, dt_fit], np.float32), op=hvd.Max,
                             name="keras_fit.time")
        dt, dt_fit = (float(v) for v in np.asarray(both))
        hvd.shutdown()
    return {"rank": rank, "size": size, "seconds": dt, "fit_seconds": dt_fit,
            "samples_per_s": args.steps * BATCH * size / dt,
            "fit_samples_per_s": args.steps * BATCH * size / dt_fit}


def worker_tape(args) -> dict:
    tf = _tf_setup(args.threads)
    import keras
    import hvdlite.tensorflow as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = _keras_model(tf)
    opt = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = _data(args.steps, rank)
    xs = [tf.constant(x[i * BATCH:(i + 1) * BATCH]) for i in range(args.steps)]
    ys = [tf.constant(y[i * BATCH:(i + 1) * BATCH]) for i in range(args.steps)]

    @tf.function(jit_compile=False)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step(xs[0], ys[0])
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables, root_rank=0)
    for i in range(args.warmup):
        step(xs[i], ys[i])
    _settle()
    hvd.allreduce(tf.constant(0.0), name="keras_fit.sync")
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(xs[i], ys[i])
    float(loss)
    dt = time.perf_counter() - t0
    dt = float(hvd.allreduce(tf.constant(dt), op=hvd.Max, name="keras_fit.time"))
    hvd.shutdown()
    return {"rank": rank, "size": size, "seconds": dt,
            "samples_per_s": args.steps * BATCH * size / dt}


def worker_torch(args) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import hvdlite.torch as hvd
    torch.set_num_threads(args.threads)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    mods = []
    for i in range(len(SIZES) - 1):
        mods.append(nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = _data(args.steps, rank)
    xs = [torch.from_numpy(x[i * BATCH:(i + 1) * BATCH]) for i in range(args.steps)]
    ys = [torch.from_numpy(y[i * BATCH:(i + 1) * BATCH]) for i in range(args.steps)]

    def step(i):
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
        return loss

    for i in range(args.warmup):
        step(i)
    _settle()
    hvd.allreduce(torch.zeros(1), name="keras_fit.sync")
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i)
    dt = time.perf_counter() - t0
    dt = float(hvd.allreduce(torch.tensor([dt]), op=hvd.Max, name="keras_fit.time"))
    hvd.shutdown()
    return {"rank": rank, "size": size, "seconds": dt,
            "samples_per_s": args.steps * BATCH * size / dt}


def run_worker(args) -> None:
    if args.worker == "keras":
        res = worker_keras(args, distributed=True)
    elif args.worker == "compute":
        res = worker_keras(args, distributed=True, reduce=False)
    elif args.worker == "plain":
        res = worker_keras(args, distributed=False)
    elif args.worker == "tape":
        res = worker_tape(args)
    elif args.worker == "torch":
        res = worker_torch(args)
    elif args.worker in ("jax_keras", "jax_compute", "jax_plain"):
        res = worker_keras(args, distributed=args.worker != "jax_plain",
                           reduce=args.worker == "jax_keras", backend="jax")
    else:
        raise SystemExit(f"unknown worker {args.worker!r}")
    if res["rank"] == 0:
        print(MARK + json.dumps(res), flush=True)


# ---------------------------------------------------------------------- driver
def launch(name: str, args) -> dict:
    root = ROOT
    if name.endswith("@base"):
        # The same configuration on another hvdlite tree (say, the last release), for a
        # before/after comparison in the same alternation.
        name, root = name[:-len("@base")], os.path.abspath(args.base_root)
    mode, ranks, threads = CONFIGS[name]
    worker = [sys.executable, os.path.abspath(__file__), "--worker", mode,
              "--threads", str(threads), "--steps", str(args.steps), "--warmup",
              str(args.warmup)]
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["OMP_NUM_THREADS"] = str(threads)
    if mode.startswith("jax"):
        env["KERAS_BACKEND"] = "jax"
        env["JAX_PLATFORMS"] = "cpu"
        if threads == 1:
            env["XLA_FLAGS"] = JAX_ONE_THREAD
    else:
        env["KERAS_BACKEND"] = "tensorflow"
    if ranks:
        cmd = [sys.executable, "-m", "hvdlite.runner", "-np", str(ranks)] + worker
    else:
        cmd = worker
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        idx = line.find(MARK)
        if idx >= 0:
            return json.loads(line[idx + len(MARK):])
    raise RuntimeError(f"{name}: no result (exit {proc.returncode})\n"
                       f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def spread(xs: list) -> str:
    return f"{min(xs):,.0f}-{max(xs):,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps per run")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--base-root", default=None,
                   help="another hvdlite tree: configs named NAME@base run on it")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.worker:
        return run_worker(args)
    names = args.configs.split(",")
    if any(n.endswith("@base") for n in names) and not args.base_root:
        raise SystemExit("configs NAME@base need --base-root")
    got: dict = {n: [] for n in names}
    whole: dict = {}        # Keras configs: samples/s over the whole fit() call
    print(f"Keras fit benchmark: MLP {'->'.join(map(str, SIZES))}, batch {BATCH}/rank, "
          f"{args.steps} timed steps, {args.rounds} alternating rounds; "
          f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    for r in range(args.rounds):
        for n in names:
            res = launch(n, args)
            got[n].append(float(res["samples_per_s"]))
            if "fit_samples_per_s" in res:
                whole.setdefault(n, []).append(float(res["fit_samples_per_s"]))
        print(f"round {r + 1}: " + "  ".join(f"{n}={got[n][-1]:,.0f}" for n in names),
              flush=True)
    med = {n: statistics.median(v) for n, v in got.items()}
    print(f"\nsamples/s over all ranks (median of {args.rounds}, min-max); "
          f"load after: {os.getloadavg()[0]:.2f}")
    print(f"{'config':<15} {'median':>9} {'spread':>15}")
    for n in names:
        print(f"{n:<15} {med[n]:>9,.0f} {spread(got[n]):>15}")
    if whole:
        print("Keras configs over the whole fit() call (with Keras' set-up and the tf.data "
              "iterator's end):")
        for n, v in whole.items():
            print(f"{n + ' (fit)':<15} {statistics.median(v):>9,.0f} {spread(v):>15}")
    ratios = {}
    for a, b in (("keras_np2", "torch_np2"), ("tape_np2", "torch_np2"),
                 ("keras_np2", "plain_1t"), ("tape_np2", "plain_1t"),
                 ("keras_np2", "plain_2t"), ("tape_np2", "plain_2t"),
                 ("torch_np2", "plain_1t"), ("keras_np2", "keras_np1"),
                 ("plain_2t", "plain_1t"), ("keras_np2", "compute_np2"),
                 ("tape_np2", "compute_np2"), ("torch_np2", "compute_np2"),
                 ("compute_np2", "plain_1t"), ("keras_np2", "keras_np2@base"),
                 ("tape_np2", "tape_np2@base"),
                 ("jax_keras_np2", "jax_plain_1t"), ("jax_keras_np2", "jax_keras_np1"),
                 ("jax_keras_np2", "jax_compute_np2"), ("jax_keras_np2", "keras_np2"),
                 ("jax_plain_1t", "plain_1t"), ("jax_keras_np2", "torch_np2")):
        if a in med and b in med:
            # the ratio of medians, and its range over the rounds (each round's pair)
            per_round = [x / y for x, y in zip(got[a], got[b])]
            ratios[f"{a}/{b}"] = {"median": med[a] / med[b], "rounds": per_round}
            print(f"{a + ' / ' + b:<30} {med[a] / med[b]:>5.2f}   "
                  f"(per round {min(per_round):.2f}-{max(per_round):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": BATCH, "steps": args.steps, "rounds": args.rounds,
                       "samples_per_s": got, "median": med, "ratios": ratios,
                       "fit_samples_per_s": whole,
                       "fit_median": {n: statistics.median(v) for n, v in whole.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
