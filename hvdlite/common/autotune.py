"""Autotune: Bayesian optimisation of the fusion threshold and the cycle time (Horovod's
ParameterManager, `HOROVOD_AUTOTUNE=1`).

Only the coordinator tunes: it sees every response it releases, so it can score the current
parameters by the tensor bytes it releases per unit of time without asking anyone. The fusion
threshold is the coordinator's own setting; the cycle time belongs to every rank's engine, so the
coordinator pushes each new value down its response stream as a `(Item.CYCLE_TIME, cycle_time_ms)` (`protocol.Item`) item, which
`engine.py` applies.

Search, as in Horovod (parameter_manager.cc, optim/bayesian_optimization.cc,
optim/gaussian_process.cc): a joint search over fusion threshold in [0, 64] MB and cycle time in
[1, 100] ms, starting with the seed points (4 MB, 5 ms), (32, 50), (16, 25), (8, 10), then
Gaussian-process regression with a squared-exponential kernel and the expected-improvement
acquisition (xi = 0.01). A sample ends when some tensor has been released `steps_per_sample` more
times; the median of 5 samples is one score; the first `warmup_samples` scores are discarded;
after `bayes_opt_max_samples` scores the best parameters are kept for the rest of the job. A
parameter fixed by the user's environment is left out of the search and held constant.

Differences from Horovod, on purpose: inputs are scaled to [0, 1] and scores standardised before
the GP is fitted (so the GP noise is relative to the spread of the observed scores and does not
depend on the machine's bandwidth), the kernel's length scale and amplitude are chosen by maximum
likelihood over a grid rather than L-BFGS, and expected improvement is maximised by bounded
pattern search from 25 starts taken from a random sweep. Unnamed collectives (whose names change on
every call) count as steps of their call site.
"""
from __future__ import annotations

import csv
import logging
import math
import os
import re
import time
from typing import Callable, Iterable

import numpy as np

from .messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, REDUCESCATTER,
                       Response)

log = logging.getLogger(__name__)

FUSION_MB_BOUNDS = (0.0, 64.0)
CYCLE_MS_BOUNDS = (1.0, 100.0)
# (fusion threshold MB, cycle time ms), Horovod's seed points in Horovod's order.
SEED_POINTS = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0))
SAMPLES_PER_SCORE = 5           # Horovod's SAMPLES: one score is the median of this many samples
EI_XI = 0.01
DATA_TYPES = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER, ALLTOALL})
CSV_HEADER = ["sample", "phase", "cycle_time_ms", "fusion_threshold_mb", "score", "bytes",
              "seconds"]
_AUTO_NAME = re.compile(r"^(.*\.noname\..*:\d+)\.\d+$")


# ---------------------------------------------------------------------- Gaussian process
def _norm_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(-z / math.sqrt(2.0))


def _norm_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


class GaussianProcess:
    """GP regression with an isotropic squared-exponential kernel and fixed observation noise.

    Inputs are expected in [0, 1]^d; targets are standardised internally. The kernel's length
    scale and amplitude maximise the log marginal likelihood over a log-spaced grid.
    """

    LENGTHS = np.logspace(-1.5, 0.5, 17)
    AMPLITUDES = np.logspace(-0.5, 0.5, 7)

    def __init__(self, noise: float):
        self.noise = max(float(noise), 1e-6)
        self.length = 1.0
        self.amplitude = 1.0

    def _kernel(self, a: np.ndarray, b: np.ndarray, length: float, amplitude: float) -> np.ndarray:
        sq = (np.sum(a * a, 1)[:, None] + np.sum(b * b, 1)[None, :] - 2.0 * a @ b.T)
        return amplitude ** 2 * np.exp(-0.5 * np.maximum(sq, 0.0) / length ** 2)

    def fit(self, x: np.ndarray, y: np.ndarray) -> "GaussianProcess":
        self.x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        self.y_mean = float(y.mean())
        self.y_std = float(y.std()) or 1.0
        yn = (y - self.y_mean) / self.y_std
        n = len(yn)
        best = None
        for length in self.LENGTHS:
            for amp in self.AMPLITUDES:
                k = self._kernel(self.x, self.x, length, amp) + self.noise ** 2 * np.eye(n)
                try:
                    chol = np.linalg.cholesky(k)
                except np.linalg.LinAlgError:
                    continue
                alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, yn))
                ll = (-0.5 * yn @ alpha - np.log(np.diag(chol)).sum()
                      - 0.5 * n * math.log(2 * math.pi))
                if best is None or ll > best[0]:
                    best = (ll, length, amp, chol, alpha)
        if best is None:  # cannot happen with noise > 0; keep a usable model anyway
            raise np.linalg.LinAlgError("no kernel parameters gave a positive-definite matrix")
        _, self.length, self.amplitude, self._chol, self._alpha = best
        return self

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation at x, in the targets' units."""
        x = np.asarray(x, dtype=np.float64)
        ks = self._kernel(self.x, x, self.length, self.amplitude)
        mu = ks.T @ self._alpha
        v = np.linalg.solve(self._chol, ks)
        var = self.amplitude ** 2 + 1e-8 - np.sum(v * v, 0)
        sigma = np.sqrt(np.maximum(var, 0.0))
        return mu * self.y_std + self.y_mean, sigma * self.y_std


class BayesianOptimizer:
    """Maximise an expensive noisy function on a box: GP surrogate + expected improvement."""

    def __init__(self, bounds: list[tuple[float, float]], noise: float, xi: float = EI_XI,
                 seed: int = 0, restarts: int = 25, sweep: int = 1024):
        self.lo = np.array([b[0] for b in bounds], dtype=np.float64)
        self.hi = np.array([b[1] for b in bounds], dtype=np.float64)
        self.gp = GaussianProcess(noise)
        self.xi = xi
        self.rng = np.random.default_rng(seed)
        self.restarts = restarts
        self.sweep = sweep
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []

    @property
    def dims(self) -> int:
        return len(self.lo)

    def _unit(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, dtype=np.float64) - self.lo) / np.maximum(self.hi - self.lo, 1e-12)

    def _scale(self, u: np.ndarray) -> np.ndarray:
        return self.lo + np.asarray(u) * (self.hi - self.lo)

    def add_sample(self, x, y: float) -> None:
        self.xs.append(np.asarray(x, dtype=np.float64))
        self.ys.append(float(y))

    def clear(self) -> None:
        self.xs.clear()
        self.ys.clear()

    def expected_improvement(self, u: np.ndarray) -> np.ndarray:
        """EI at points u (unit cube), in standardised score units (needs a fitted GP)."""
        mu, sigma = self.gp.predict(u)
        mu_s, _ = self.gp.predict(self._u_samples)
        scale = self.gp.y_std
        # Noisy observations: improve on the best posterior mean at a sample, not the best
        # observed score (Brochu, Cora, de Freitas 2010, section 2.4), as Horovod does.
        imp = (mu - mu_s.max()) / scale - self.xi
        sd = sigma / scale
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(sd > 0, imp / np.where(sd > 0, sd, 1.0), 0.0)
        ei = imp * _norm_cdf(z) + sd * _norm_pdf(z)
        return np.where(sd > 1e-12, ei, 0.0)

    def next_sample(self) -> np.ndarray:
        """The point (in the original units) with the largest expected improvement."""
        if not self.xs:
            return self._scale(self.rng.uniform(size=self.dims))
        self._u_samples = np.array([self._unit(x) for x in self.xs])
        self.gp.fit(self._u_samples, np.array(self.ys))
        cand = self.rng.uniform(size=(self.sweep, self.dims))
        ei = self.expected_improvement(cand)
        starts = cand[np.argsort(-ei)[:self.restarts]]
        best_u, best_ei = starts[0], -1.0
        for u in starts:
            u, val = self._pattern_search(u)
            if val > best_ei:
                best_u, best_ei = u, val
        return self._scale(best_u)

    def _pattern_search(self, u: np.ndarray, step: float = 0.05, tol: float = 1e-3,
                        max_iter: int = 60) -> tuple[np.ndarray, float]:
        """Compass search for max EI, clipped to the unit box."""
        u = np.array(u, dtype=np.float64)
        val = float(self.expected_improvement(u[None, :])[0])
        moves = np.vstack([np.eye(self.dims), -np.eye(self.dims)])
        for _ in range(max_iter):
            if step < tol:
                break
            trial = np.clip(u[None, :] + step * moves, 0.0, 1.0)
            vals = self.expected_improvement(trial)
            i = int(np.argmax(vals))
            if vals[i] > val:
                u, val = trial[i], float(vals[i])
            else:
                step /= 2
        return u, val


# ---------------------------------------------------------------------- the tuner
class Autotuner:
    """The coordinator's parameter manager; `observe()` is called with every released batch."""

    def __init__(self, settings, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.warmup_remaining = max(0, int(settings.autotune_warmup_samples))
        self.steps_per_sample = max(1, int(settings.autotune_steps_per_sample))
        self.max_samples = max(0, int(settings.autotune_bayes_opt_max_samples))
        # Variables: (name, bounds, fixed value or None). Fixed ones stay out of the search.
        fixed_mb = settings.fusion_threshold / (1024 * 1024) \
            if settings.fusion_threshold_fixed else None
        fixed_ms = settings.cycle_time_ms if settings.cycle_time_fixed else None
        self.fixed = {"fusion_mb": fixed_mb, "cycle_ms": fixed_ms}
        self.free = [name for name in ("fusion_mb", "cycle_ms") if self.fixed[name] is None]
        bounds = {"fusion_mb": FUSION_MB_BOUNDS, "cycle_ms": CYCLE_MS_BOUNDS}
        self.seeds = [self._filter(dict(zip(("fusion_mb", "cycle_ms"), p))) for p in SEED_POINTS]
        self.bayes = BayesianOptimizer([bounds[n] for n in self.free],
                                       settings.autotune_gaussian_process_noise)
        self.iteration = 0
        self.active = bool(self.free)
        self.value = self.seeds[0] if self.free else np.zeros(0)
        self.best_value = self.value.copy()
        self.best_score = 0.0
        self.best_row = 0
        self.row = 0
        self._pushed: float | None = None
        self._file = None
        self._writer = None
        if settings.autotune_log:
            path = settings.autotune_log
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "w", newline="")
            self._writer = csv.writer(self._file)
            self._writer.writerow(CSV_HEADER)
            self._file.flush()
        if not self.free:
            log.warning("Autotuner: HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME are both set, "
                        "so there is nothing to tune; autotune is off.")
        else:
            log.info("Autotuner: tuning %s (held constant: %s)", ", ".join(self.free),
                     ", ".join(f"{k}={v}" for k, v in self.fixed.items() if v is not None)
                     or "nothing")
        self._reset()

    # ------------------------------------------------------------------ current parameters
    def _filter(self, point: dict) -> np.ndarray:
        return np.array([point[n] for n in self.free], dtype=np.float64)

    def _get(self, name: str, vector: np.ndarray) -> float:
        if self.fixed[name] is not None:
            return float(self.fixed[name])
        return float(vector[self.free.index(name)])

    def _current(self) -> np.ndarray:
        return self.value if self.active else self.best_value

    @property
    def fusion_threshold(self) -> int:
        """Bytes: what the coordinator fuses up to now."""
        return int(self._get("fusion_mb", self._current()) * 1024 * 1024)

    @property
    def cycle_time_ms(self) -> float:
        return self._get("cycle_ms", self._current())

    def take_push(self) -> float | None:
        """A cycle time the ranks have not been told yet (then it counts as told)."""
        if "cycle_ms" not in self.free:
            return None
        ms = self.cycle_time_ms
        if self._pushed is not None and ms == self._pushed:
            return None
        self._pushed = ms
        return ms

    # ------------------------------------------------------------------ scoring
    def _reset(self) -> None:
        self.counts: dict[str, int] = {}
        self.sample = 0
        self.scores: list[float] = []
        self.total_bytes = 0
        self.sample_bytes = 0
        self.sample_start = self.clock()
        self.score_start = self.sample_start

    @staticmethod
    def step_key(name: str) -> str:
        m = _AUTO_NAME.match(name)
        return m.group(1) if m else name

    def observe(self, responses: Iterable[Response]) -> float | None:
        """Account one batch of released responses; returns a cycle time (ms) to push to every
        rank, or None."""
        if not self.active:
            return self.take_push()
        names, nbytes = [], 0
        for resp in responses:
            if resp.type in DATA_TYPES and not resp.error:
                names.extend(resp.names)
                nbytes += resp.nbytes()
        for name in names:
            key = self.step_key(name)
            step = self.counts.get(key, 0)
            self.counts[key] = step + 1
            if step >= (self.sample + 1) * self.steps_per_sample:
                now = self.clock()
                micros = (now - self.sample_start) * 1e6
                self.scores.append(self.sample_bytes / micros if micros > 0 else 0.0)
                self.sample_bytes = 0
                self.sample_start = now
                self.sample += 1
                break
        self.sample_bytes += nbytes
        self.total_bytes += nbytes
        if self.sample >= SAMPLES_PER_SCORE:
            # Bytes and time of the SAMPLES_PER_SCORE samples (the batch that ended the last one
            # already counts towards the next).
            score = float(np.median(self.scores))
            self._tune(score, self.total_bytes - self.sample_bytes,
                       self.sample_start - self.score_start)
            self._reset()
        return self.take_push()

    def _tune(self, score: float, nbytes: int, seconds: float) -> None:
        self.row += 1
        if self.warmup_remaining > 0:
            self.warmup_remaining -= 1
            self._log_row("warmup", self.value, score, nbytes, seconds)
            log.info("Autotuner: warming up (%d remaining), score %.2f", self.warmup_remaining,
                     score)
            return
        self._log_row("sample", self.value, score, nbytes, seconds)
        if score > self.best_score:
            self.best_score, self.best_value, self.best_row = score, self.value.copy(), self.row
        self.bayes.add_sample(self.value, score)
        self.iteration += 1
        if self.iteration > self.max_samples:
            self.active = False
            self._log_row("best", self.best_value, self.best_score, None, None,
                          sample=self.best_row)
            log.info("Autotuner: best parameters: cycle time %.3f ms, fusion threshold %.3f MB "
                     "(score %.2f bytes/us)", self._get("cycle_ms", self.best_value),
                     self._get("fusion_mb", self.best_value), self.best_score)
            return
        if self.iteration < len(self.seeds):
            self.value = self.seeds[self.iteration].copy()
        else:
            self.value = np.round(self.bayes.next_sample(), 3)

    def _log_row(self, phase: str, value: np.ndarray, score: float, nbytes, seconds,
                 sample: int | None = None) -> None:
        cycle, fusion = self._get("cycle_ms", value), self._get("fusion_mb", value)
        log.info("Autotuner: [%s] cycle time %.3f ms, fusion threshold %.3f MB: score %.2f",
                 phase, cycle, fusion, score)
        if self._writer is None:
            return
        self._writer.writerow([self.row if sample is None else sample, phase, f"{cycle:.3f}",
                               f"{fusion:.3f}", f"{score:.4f}",
                               "" if nbytes is None else nbytes,
                               "" if seconds is None else f"{seconds:.4f}"])
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._writer = None


def create(settings) -> Autotuner | None:
    """The coordinator's tuner, or None when autotune is off."""
    return Autotuner(settings) if settings.autotune else None
