"""Test-side helpers for the TensorFlow tests (no TensorFlow import here: the tests only start
workers). One launch of a worker runs many named checks; each test judges one check."""
from __future__ import annotations

import importlib.util
import os

import pytest

from util import hvdlite_run, rank_lines

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
HAVE_TF_KERAS = importlib.util.find_spec("tf_keras") is not None
SKIP_NO_TF = pytest.mark.skipif(
    not HAVE_TF, reason="TensorFlow is not installed (scripts/setup.sh installs tensorflow-cpu; "
                        "or pip install 'hvdlite[tensorflow]')")

# Quiet, single-threaded TensorFlow in every worker (2-core machine, several ranks).
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1",
          "HVDLITE_START_TIMEOUT": "120", "PYTHONWARNINGS": "ignore::DeprecationWarning"}


class Run:
    """The output of one worker launch, split by rank."""

    def __init__(self, script: str, np: int = 2, args=None, env=None, timeout: float = 300):
        self.script, self.np = script, np
        full_env = dict(TF_ENV)
        full_env.update(env or {})
        proc = hvdlite_run(script, np=np, args=args, env=full_env, timeout=timeout, check=False)
        self.returncode = proc.returncode
        self.output = proc.stdout + "\n--- stderr\n" + proc.stderr
        self.lines = {r: rank_lines(proc.stdout, r) for r in range(np)}

    def check(self, name: str) -> None:
        """Every rank ran check `name` and reported OK."""
        problems = []
        for r, lines in self.lines.items():
            mine = [i for i, line in enumerate(lines) if line.startswith(f"CHECK {name} ")]
            if not mine:
                problems.append(f"rank {r}: no result for check {name!r}")
                continue
            i = mine[-1]
            if not lines[i].startswith(f"CHECK {name} OK"):
                detail = [lines[i]] + [line for line in lines[i + 1:i + 40]
                                       if line.startswith("  |")]
                problems.append(f"rank {r}:\n" + "\n".join(detail))
        if problems:
            tail = "" if all("no result" not in p for p in problems) else \
                "\n--- end of the output\n" + self.output[-5000:]
            pytest.fail(f"{self.script} -np {self.np}: check {name!r} failed\n"
                        + "\n".join(problems) + tail, pytrace=False)

    def finished(self) -> None:
        """Every rank got to the end of the script, and the launcher exited cleanly."""
        missing = [r for r, lines in self.lines.items()
                   if not any(line.startswith("FINISHED ") for line in lines)]
        if missing or self.returncode != 0:
            pytest.fail(f"{self.script} -np {self.np}: exit code {self.returncode}, ranks "
                        f"{missing} did not finish\n{self.output[-8000:]}", pytrace=False)


def worker_path(name: str) -> str:
    return os.path.join(os.path.dirname(__file__), name)
