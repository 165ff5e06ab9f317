"""hvdlite.ray is optional: hvdlite never imports Ray on its own, and `import hvdlite.ray`
without Ray fails with one line that names the extra to install. Fast: plain subprocesses."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_hvdlite_never_imports_ray():
    proc = _python("import sys, hvdlite, hvdlite.torch, hvdlite.runner.launch, "
                   "hvdlite.runner.api, hvdlite.runner.elastic_driver\n"
                   "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_import_without_ray_names_the_extra():
    # sys.modules['ray'] = None makes `import ray` fail as it does where Ray is not installed.
    proc = _python("import sys; sys.modules['ray'] = None\n"
                   "try:\n    import hvdlite.ray\n"
                   "except ImportError as e:\n    print('ERR', e)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("ERR hvdlite.ray needs Ray, which is not installed: "
                                   "pip install 'hvdlite[ray]'"), proc.stdout
