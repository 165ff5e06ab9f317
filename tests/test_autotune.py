"""Autotune: the Bayesian optimiser, the coordinator's tuner on a scripted clock, and a real
2-rank training run whose parameters change under it while every result stays exact."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from hvdlite.common.autotune import (CSV_HEADER, CYCLE_MS_BOUNDS, FUSION_MB_BOUNDS,
                                     SAMPLES_PER_SCORE, SEED_POINTS, Autotuner,
                                     BayesianOptimizer, GaussianProcess)
from hvdlite.common.config import Settings
from hvdlite.common.messages import ALLREDUCE, BARRIER, Response

from util import hvdlite_run, rank_lines


# ---------------------------------------------------------------------------- optimiser
@pytest.mark.timeout(60)
def test_gaussian_process_fits_and_is_uncertain_away_from_data():
    x = np.array([[0.1, 0.1], [0.5, 0.5], [0.9, 0.2], [0.3, 0.8]])
    y = np.array([1.0, 3.0, 2.0, 0.5])
    gp = GaussianProcess(noise=0.05).fit(x, y)
    mu, sd = gp.predict(x)
    assert np.allclose(mu, y, atol=0.2)
    _, far = gp.predict(np.array([[1.0, 1.0]]))
    assert far[0] > sd.max()


@pytest.mark.timeout(60)
def test_bayesian_optimisation_finds_the_peak_of_a_smooth_function():
    def score(p):      # peak at 40 MB, 20 ms
        return 100 - ((p[0] - 40) / 64) ** 2 * 80 - ((p[1] - 20) / 100) ** 2 * 80

    bo = BayesianOptimizer([FUSION_MB_BOUNDS, CYCLE_MS_BOUNDS], noise=0.1)
    for p in SEED_POINTS:
        bo.add_sample(np.array(p), score(p))
    for _ in range(12):
        p = bo.next_sample()
        assert FUSION_MB_BOUNDS[0] <= p[0] <= FUSION_MB_BOUNDS[1]
        assert CYCLE_MS_BOUNDS[0] <= p[1] <= CYCLE_MS_BOUNDS[1]
        bo.add_sample(p, score(p))
    best = bo.xs[int(np.argmax(bo.ys))]
    assert max(bo.ys) > max(score(p) for p in SEED_POINTS)
    assert abs(best[0] - 40) < 12 and abs(best[1] - 20) < 20, best


# ---------------------------------------------------------------------------- the tuner
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _settings(tmp_path, **kw) -> Settings:
    s = Settings()
    s.autotune = True
    s.autotune_log = str(tmp_path / "autotune.csv")
    s.autotune_warmup_samples = 1
    s.autotune_steps_per_sample = 2
    s.autotune_bayes_opt_max_samples = 6
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def _step(tuner: Autotuner, clock: Clock, names=("w", "b"), nbytes=4096):
    """One training step: the coordinator releases every tensor once; time depends on the
    parameters (best near 16 MB, 10 ms) so the tuner has something to find."""
    mb, ms = tuner.fusion_threshold / 2 ** 20, tuner.cycle_time_ms
    clock.t += 0.01 + ((mb - 16) / 64) ** 2 * 0.01 + ((ms - 10) / 100) ** 2 * 0.01
    pushes = []
    for n in names:
        r = Response(type=ALLREDUCE, names=[n], shapes=[(nbytes // 4,)])
        pushes.append(tuner.observe([r, Response(type=BARRIER, names=["barrier.x"])]))
    return [p for p in pushes if p is not None]


def _rows(path):
    with open(path) as f:
        return list(csv.reader(f))


@pytest.mark.timeout(60)
def test_tuner_warms_up_tries_seed_points_then_bayes_and_keeps_the_best(tmp_path):
    clock = Clock()
    tuner = Autotuner(_settings(tmp_path), clock=clock)
    assert (tuner.fusion_threshold, tuner.cycle_time_ms) == (4 * 2 ** 20, 5.0)
    pushed = []
    for _ in range(400):
        pushed += _step(tuner, clock)
        if not tuner.active:
            break
    assert not tuner.active, "tuning did not finish"
    tuner.close()
    rows = _rows(tmp_path / "autotune.csv")
    assert rows[0] == CSV_HEADER
    body = rows[1:]
    phases = [r[1] for r in body]
    assert phases == ["warmup"] + ["sample"] * 7 + ["best"]
    samples = [int(r[0]) for r in body[:-1]]
    assert samples == sorted(samples) and len(set(samples)) == len(samples)
    tried = [(float(r[3]), float(r[2])) for r in body[1:-1]]     # (MB, ms)
    assert tried[:4] == [tuple(p) for p in SEED_POINTS]
    assert all(0 <= mb <= 64 and 1 <= ms <= 100 for mb, ms in tried)
    assert len(set(tried)) >= 6
    scores = [float(r[4]) for r in body[1:-1]]
    best = body[-1]
    assert float(best[4]) == max(scores)
    assert (float(best[3]), float(best[2])) == tried[scores.index(max(scores))]
    assert int(best[0]) == samples[1:][scores.index(max(scores))]
    # After tuning: the best parameters are in force, and were pushed last.
    assert tuner.cycle_time_ms == float(best[2])
    assert abs(tuner.fusion_threshold / 2 ** 20 - float(best[3])) < 1e-3
    assert pushed[0] == 5.0 and pushed[-1] == tuner.cycle_time_ms
    assert all(int(r[5]) > 0 and float(r[6]) > 0 for r in body[:-1])   # bytes, seconds


@pytest.mark.timeout(60)
def test_a_parameter_set_by_the_user_is_held_constant(tmp_path):
    clock = Clock()
    s = _settings(tmp_path, cycle_time_ms=3.0, cycle_time_fixed=True)
    tuner = Autotuner(s, clock=clock)
    pushed = []
    for _ in range(400):
        pushed += _step(tuner, clock)
        if not tuner.active:
            break
    assert not tuner.active and pushed == []         # the ranks' cycle time is never touched
    rows = _rows(tmp_path / "autotune.csv")[1:]
    assert {r[2] for r in rows} == {"3.000"}
    assert [float(r[3]) for r in rows[1:5]] == [p[0] for p in SEED_POINTS]

    both = _settings(tmp_path, cycle_time_fixed=True, fusion_threshold_fixed=True)
    idle = Autotuner(both, clock=clock)
    assert not idle.active and idle.fusion_threshold == both.fusion_threshold
    assert idle.take_push() is None


@pytest.mark.timeout(60)
def test_unnamed_collectives_count_as_steps_of_their_call_site(tmp_path):
    assert Autotuner.step_key("allreduce.noname.train.py:42.17") == "allreduce.noname.train.py:42"
    assert Autotuner.step_key("allreduce.noname.0.3") == "allreduce.noname.0.3"
    clock = Clock()
    tuner = Autotuner(_settings(tmp_path, autotune_log=None), clock=clock)
    for i in range(4 * SAMPLES_PER_SCORE):
        clock.t += 0.01
        tuner.observe([Response(type=ALLREDUCE, names=[f"allreduce.noname.t.py:7.{i}"],
                                shapes=[(8,)])])
    assert tuner.row >= 1                             # samples ended: the call site repeated


# ---------------------------------------------------------------------------- real run
@pytest.mark.timeout(240)
def test_autotune_changes_parameters_during_training_and_results_stay_exact(tmp_path):
    log_path = tmp_path / "tune.csv"
    proc = hvdlite_run("autotune_train.py", np=2, timeout=220, env={
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": str(log_path),
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5",
    })
    for r in range(2):
        lines = rank_lines(proc.stdout, r)
        assert any(line.startswith("DONE") for line in lines), proc.stdout[-3000:]
        assert not any("MISMATCH" in line for line in lines), "\n".join(lines)
    # Rank 1 is not the coordinator: its engine's cycle time came down the response stream.
    cycles = next(line for line in rank_lines(proc.stdout, 1) if line.startswith("CYCLES"))
    seen = {float(v) for v in cycles.split()[1:]}
    assert len(seen) >= 3, cycles
    rows = _rows(log_path)
    assert rows[0] == CSV_HEADER
    body = rows[1:]
    assert [r[1] for r in body] == ["warmup"] + ["sample"] * 6 + ["best"], rows
    samples = [int(r[0]) for r in body[:-1]]
    assert samples == list(range(1, len(samples) + 1))
    params = [(float(r[3]), float(r[2])) for r in body[1:-1]]      # (MB, ms)
    assert params[:4] == [tuple(p) for p in SEED_POINTS]            # the parameters changed
    assert all(0 <= mb <= 64 and 1 <= ms <= 100 for mb, ms in params)
    assert all(float(r[4]) > 0 for r in body)
    # The tuned cycle time on rank 1 at the end is the best row's.
    assert float(cycles.split()[-1]) == float(body[-1][2])
