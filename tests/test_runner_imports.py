"""The launcher imports no framework: `hvdlite-run --help` and the drivers start without torch,
TensorFlow or the engine (they would cost seconds at every start, and load CUDA)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from util import clean_env

ROOT = Path(__file__).resolve().parent.parent
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
FORBIDDEN = ("torch", "tensorflow", "numpy", "hvdlite.common.engine", "hvdlite.common.basics")


def _env(extra_path: str = "") -> dict[str, str]:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
    return env


@pytest.mark.timeout(60)
def test_help_without_torch_importable(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch is not importable in this test')\n")
    out = subprocess.run([HVDLITE_RUN, "--help"], capture_output=True, text=True, timeout=50,
                         env=_env(str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "--hierarchical-allreduce" in out.stdout and "usage: hvdlite-run" in out.stdout


@pytest.mark.timeout(60)
def test_runner_modules_import_no_framework():
    code = ("import sys, hvdlite.runner.launch, hvdlite.runner.driver, "
            "hvdlite.runner.elastic_driver, hvdlite.runner.api\n"
            f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
            "assert not bad, f'the runner imported {bad}'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, env=_env())
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(60)
def test_steady_state_protocol_imports_no_framework():
    """steady.py (the steady state's rounds, which benchmarks/control_plane.py drives with
    hundreds of simulated ranks) and arith.py, whose rank-order sum it uses on numpy payloads,
    load no framework."""
    code = ("import sys, hvdlite.common.steady, hvdlite.common.arith\n"
            "bad = [m for m in ('torch', 'tensorflow') if m in sys.modules]\n"
            "assert not bad, f'the steady-state protocol imported {bad}'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, env=_env())
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(60)
def test_a_job_with_a_local_rank0_starts_without_torch_in_the_launcher(tmp_path):
    """A fixed job whose rank 0 runs here: the launcher only opens the store's socket and rank 0
    serves the store, so the launcher runs even where torch cannot be imported (the ranks here
    import nothing). This is what saves ~1.5 s at every start."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch is not importable in this test')\n")
    code = "import os; print('fd' if 'HVDLITE_STORE_FD' in os.environ else 'nofd')"
    out = subprocess.run([HVDLITE_RUN, "-np", "2", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=50, env=_env(str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "[0]<stdout>:fd" in out.stdout and "[1]<stdout>:nofd" in out.stdout, out.stdout


@pytest.mark.timeout(60)
def test_rank0_store_falls_back_to_binding_the_port_without_master_listen_fd():
    """A torch before 2.4 has no `master_listen_fd`: rank 0 closes the handed-over socket and
    binds its port itself; a rank that connected to the socket early is still served (torch's
    client retries). The real TCPStore, with the keyword refused the way pybind11 refuses it."""
    import datetime
    import socket
    import threading

    import torch.distributed as dist

    from hvdlite.common.rendezvous import serve_store_on

    calls = []

    def old_tcp_store(*args, **kwargs):
        calls.append(sorted(kwargs))
        if "master_listen_fd" in kwargs:
            raise TypeError("__init__(): incompatible constructor arguments.")
        return dist.TCPStore(*args, **kwargs)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    timeout = datetime.timedelta(seconds=20)
    got = {}

    def peer():
        client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        client.set("from_peer", b"1")
        got["value"] = client.get("from_rank0")

    thread = threading.Thread(target=peer)
    thread.start()
    store = serve_store_on(old_tcp_store, "127.0.0.1", port, listener.detach(), timeout)
    store.set("from_rank0", b"0")
    thread.join(30)
    assert got.get("value") == b"0" and store.get("from_peer") == b"1"
    assert len(calls) == 2 and "master_listen_fd" in calls[0] and \
        "master_listen_fd" not in calls[1]
