"""The package as a whole: every module imports, and every name an `__all__` lists exists
(a stale entry makes `from module import *` raise AttributeError)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from util import ROOT, clean_env

# Modules that need an optional part may fail to import only for want of that part.
OPTIONAL = ("tensorflow", "keras", "tf_keras", "ray", "mpi4py", "jax", "optax")

_PROBE = f"""
import importlib, pkgutil, hvdlite
for m in pkgutil.walk_packages(hvdlite.__path__, "hvdlite."):
    if m.name.endswith("__main__"):
        continue
    try:
        mod = importlib.import_module(m.name)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] in {OPTIONAL!r}:
            print("OPTIONAL", m.name, exc.name)
            continue
        if m.name.startswith("hvdlite.tensorflow.keras") and "KERAS_BACKEND" in str(exc):
            print("REFUSED", m.name)   # (by design: Keras runs on another backend)
            continue
        print("BROKEN", m.name, repr(exc))
        continue
    for name in getattr(mod, "__all__", ()):
        if not hasattr(mod, name):
            print("MISSING", m.name + "." + name)
print("DONE")
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
def test_every_module_imports_and_exports_what_its_all_lists(backend):
    """Under each Keras backend (hvdlite.keras picks its implementation from it)."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=170, cwd=str(ROOT),
                         env=clean_env({"TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": backend}))
    assert out.returncode == 0 and "DONE" in out.stdout, out.stdout + out.stderr[-3000:]
    problems = [line for line in out.stdout.splitlines()
                if line.startswith(("BROKEN", "MISSING"))]
    assert not problems, problems
