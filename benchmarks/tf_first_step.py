"""The first step of a TensorFlow custom training loop: `hvd.DistributedGradientTape` inside
`tf.function` against the same step with a plain `tf.GradientTape`, in the same processes.

    python benchmarks/tf_first_step.py [--np 2] [--rounds 5] [--json out.json]

A step's first call traces it: TensorFlow runs the Python once to build the graph, and AutoGraph
first rewrites every function that Python calls, unless it comes from a library AutoGraph knows
(TensorFlow, Keras, NumPy, and now hvdlite). That cost comes once per process, so each round is
one job (`hvdlite-run -np N`), and the rounds give the median and the spread. In each job every
rank:

1. traces and runs a throwaway plain step on another model (TensorFlow's own one-time costs);
2. the peer: times the first call of a plain-tape step on a fresh model, then, after 10 more
   untimed calls (the collectives' first negotiations and the engine's steady state), 30 calls;
3. hvdlite: the same for the identical step with `hvd.DistributedGradientTape` (Average).

It prints each one's first call and steady step, and hvdlite / plain. The steady step includes
hvdlite's allreduce of the gradients (two ranks on one host: the shared-memory path), which the
plain step does not have.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MARK = "TF_FIRST_STEP "
WARM_CALLS = 10
STEADY_CALLS = 30


def _rank_program() -> None:
    import numpy as np
    import tensorflow as tf

    import hvdlite.tensorflow as hvd
    hvd.init()
    keras = tf.keras
    rng = np.random.RandomState(hvd.rank())
    x = tf.constant(rng.rand(64, 256).astype(np.float32))
    y = tf.constant(rng.rand(64, 10).astype(np.float32))

    def model():
        m = keras.Sequential([keras.Input((256,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        return m, keras.optimizers.SGD(0.01)

    def step_fn(distributed: bool):
        m, opt = model()
        loss_fn = keras.losses.MeanSquaredError()

        @tf.function
        def step(a, b):
            with tf.GradientTape() as tape:
                loss = loss_fn(b, m(a, training=True))
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
            return loss
        return step

    def first_and_steady(step) -> tuple[float, float]:
        t0 = time.perf_counter()
        step(x, y).numpy()
        first = time.perf_counter() - t0
        for _ in range(WARM_CALLS):
            step(x, y).numpy()
        times = []
        for _ in range(STEADY_CALLS):
            t0 = time.perf_counter()
            step(x, y).numpy()
            times.append(time.perf_counter() - t0)
        return first, statistics.median(times)

    step_fn(False)(x, y).numpy()          # TensorFlow's one-time costs, paid by neither
    plain_first, plain_steady = first_and_steady(step_fn(False))
    hvd_first, hvd_steady = first_and_steady(step_fn(True))
    if hvd.rank() == 0:
        print(MARK + json.dumps({"plain_first": plain_first, "plain_steady": plain_steady,
                                 "hvdlite_first": hvd_first, "hvdlite_steady": hvd_steady}),
              flush=True)
    hvd.shutdown()


def _one_job(np_: int) -> dict:
    launcher = os.path.join(os.path.dirname(sys.executable), "hvdlite-run")
    cmd = [launcher, "-np", str(np_), sys.executable, os.path.abspath(__file__), "--rank"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in out.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    raise SystemExit(f"tf_first_step: the job printed no result (exit {out.returncode})\n"
                     f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        return _rank_program()
    runs = [_one_job(args.np) for _ in range(args.rounds)]
    keys = ("plain_first", "hvdlite_first", "plain_steady", "hvdlite_steady")
    stats = {k: {"median": statistics.median(r[k] for r in runs),
                 "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)} for k in keys}
    ratios = {w: [r[f"hvdlite_{w}"] / r[f"plain_{w}"] for r in runs] for w in ("first", "steady")}
    print(f"TensorFlow custom loop, {args.np} ranks, {args.rounds} jobs: median (min-max)")
    for w in ("first", "steady"):
        unit, scale = ("s", 1.0) if w == "first" else ("ms", 1e3)
        p, h = stats[f"plain_{w}"], stats[f"hvdlite_{w}"]
        print(f"  {w} step: plain tape {p['median'] * scale:.3f} {unit} "
              f"({p['min'] * scale:.3f}-{p['max'] * scale:.3f}), DistributedGradientTape "
              f"{h['median'] * scale:.3f} {unit} ({h['min'] * scale:.3f}-{h['max'] * scale:.3f});"
              f" hvdlite / plain {statistics.median(ratios[w]):.2f} "
              f"({min(ratios[w]):.2f}-{max(ratios[w]):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "rounds": args.rounds, "seconds": stats,
                       "ratio_per_round": ratios, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
