"""Horovod's own test files, run on hvdlite with only their imports rewritten
(`import horovod.tensorflow.keras as hvd` -> `import hvdlite.tensorflow.keras as hvd`, and
`horovod.common.util` -> tests/horovod_suites/horovod_util.py), under `hvdlite-run -np 2` as
Horovod ran them under horovodrun. The files are in tests/horovod_suites/ (Apache 2.0, from
horovod/horovod's test/parallel/, Horovod 0.28), named so that the main pytest run does not
collect them in a single process.

- tensorflow2_keras.py (test/parallel/test_tensorflow2_keras.py) with TF_USE_LEGACY_KERAS=1
  (tf_keras, as Horovod itself was tested): Horovod passes 12 of its 14.
"""
from __future__ import annotations

import importlib.util
import re
import pytest

from util import ROOT, hvdlite_run

SUITES = ROOT / "tests" / "horovod_suites"
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1",
          "HVDLITE_START_TIMEOUT": "120", "PYTHONWARNINGS": "ignore::DeprecationWarning"}


def _missing(*modules: str) -> list:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _results(output: str, rank: int) -> dict:
    """{test id: PASSED|FAILED|SKIPPED|ERROR} from one rank's `pytest -rA` summary."""
    out = {}
    for line in output.splitlines():
        m = re.match(rf"\[{rank}\]<stdout>:(PASSED|FAILED|SKIPPED|ERROR) (?:\[\d+\] )?(\S+)",
                     line)
        if m:
            out[m.group(2)] = m.group(1)
    return out


@pytest.mark.timeout(600)
def test_horovod_tensorflow2_keras_suite_on_tf_keras():
    missing = _missing("tensorflow", "tf_keras", "parameterized", "packaging")
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup.sh installs them)")
    env = dict(TF_ENV, TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=f"{ROOT}:{SUITES}")
    proc = hvdlite_run(SUITES / "run_suite.py", np=2, timeout=560, check=False, env=env,
                       args=["-q", "-rA", "-p", "no:cacheprovider",
                             str(SUITES / "tensorflow2_keras.py")])
    for rank in (0, 1):
        results = _results(proc.stdout, rank)
        passed = [t for t, r in results.items() if r == "PASSED"]
        failed = [t for t, r in results.items() if r in ("FAILED", "ERROR")]
        assert len(results) >= 14 and len(passed) >= 12 and not failed, (
            f"rank {rank}: {len(passed)} of {len(results)} passed, failed: {failed}\n"
            + proc.stdout[-6000:] + proc.stderr[-3000:])
