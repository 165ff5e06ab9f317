"""Test-side helpers for the TensorFlow tests (no TensorFlow import here: the tests only start
workers). One launch of a worker runs many named checks; each test judges one check."""
from __future__ import annotations

import importlib.util
import os

import pytest

from util import Run as _Run

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
HAVE_TF_KERAS = importlib.util.find_spec("tf_keras") is not None
SKIP_NO_TF = pytest.mark.skipif(
    not HAVE_TF, reason="TensorFlow is not installed (scripts/setup.sh installs tensorflow-cpu; "
                        "or pip install 'hvdlite[tensorflow]')")

# Quiet, single-threaded TensorFlow in every worker (2-core machine, several ranks).
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1",
          "HVDLITE_START_TIMEOUT": "120", "PYTHONWARNINGS": "ignore::DeprecationWarning"}


class Run(_Run):
    """One TensorFlow worker launch (quiet, single-threaded TensorFlow); judged per check."""

    def __init__(self, script: str, np: int = 2, args=None, env=None, timeout: float = 300):
        full_env = dict(TF_ENV)
        full_env.update(env or {})
        super().__init__(script, np=np, args=args, env=full_env, timeout=timeout,
                         check_exit=False, detail_lines=40)


def worker_path(name: str) -> str:
    return os.path.join(os.path.dirname(__file__), name)
