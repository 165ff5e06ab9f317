"""The gloo transport's shared-memory data path (hvdlite/common/backends/shm.py).

Worker: tests/workers/shm_ops.py on 3 real ranks with a 4 KiB slot, so every collective runs in
several chunks split unevenly over the ranks; results against a local reference, and a short
training run against one process. Then the same worker with the path turned off on every rank,
and on one rank only (every rank must then keep gloo). Last, two ranks in this test's own
processes: a peer that never arrives is named after the transport timeout, a peer that exited
is named within seconds, and no file is left in /dev/shm.
"""
from __future__ import annotations

import datetime
import glob
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from util import ROOT, Run, free_port

from hvdlite.common.backends import shm
from hvdlite.common.messages import SUM

CHECKS = ["allreduce", "fused", "reducescatter", "allgather", "broadcast", "process_set",
          "training", "releases_buffers", "path_used"]
SMALL_SLOT = {"HVDLITE_SHM_SLOT_MB": "0.004"}     # 4096 bytes


@pytest.fixture(scope="module")
def on_run():
    return Run("shm_ops.py", 3, env={**SMALL_SLOT, "HVDLITE_SHM": "1"}, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CHECKS)
def test_shm_path(on_run, name):
    on_run.check(name)


@pytest.mark.timeout(240)
def test_shm_path_finished(on_run):
    on_run.finished()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["off_everywhere", "off_on_one_rank"])
def test_shm_off_keeps_gloo(how):
    args = ["--expect", "off"] + (["--off-on-rank", "1"] if how == "off_on_one_rank" else [])
    env = {**SMALL_SLOT, "HVDLITE_SHM": "0" if how == "off_everywhere" else "1"}
    run = Run("shm_ops.py", 3, args=args, env=env, timeout=200)
    for name in CHECKS:
        run.check(name)
    run.finished()


def test_shm_mode_rejects_a_bad_value(monkeypatch):
    monkeypatch.setenv("HVDLITE_SHM", "maybe")
    with pytest.raises(ValueError, match="HVDLITE_SHM='maybe': use auto, 1 or 0"):
        shm.mode()


# ---------------------------------------------------------------------- in-process channels
def _store(port: int, master: bool):
    return dist.TCPStore("127.0.0.1", port, 2, master, datetime.timedelta(seconds=30),
                         wait_for_workers=False)


def _agree(store, rank: int, size: int):
    def agree(ok: bool) -> bool:
        store.set(f"ok/{rank}", "1" if ok else "0")
        return all(store.get(f"ok/{r}") == b"1" for r in range(size))
    return agree


def _my_files() -> list[str]:
    return glob.glob(os.path.join(shm.SHM_DIR, f"hvdlite-{os.getpid()}-*"))


@pytest.mark.timeout(60)
def test_a_peer_that_never_arrives_is_named(monkeypatch):
    monkeypatch.setenv("HVDLITE_SHM", "1")
    port = free_port()
    stores = [_store(port, True), None]
    stores[1] = _store(port, False)
    channels = [None, None]

    def connect(r):
        channels[r] = shm.connect(dist.PrefixStore("t1/", stores[r]), r, 2, 1.0,
                                  _agree(dist.PrefixStore("t1a/", stores[r]), r, 2))

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert channels[0] is not None and channels[1] is not None
    assert _my_files() == [], "segment files must be unlinked once every rank mapped them"
    try:
        # Both ranks run one allreduce together: the path works in this process.
        xs = [torch.full((3000,), float(r + 1)) for r in range(2)]
        works = [channels[r].allreduce(xs[r], SUM) for r in range(2)]
        for w in works:
            w.wait()
        assert torch.equal(xs[0], torch.full((3000,), 3.0)) and torch.equal(xs[0], xs[1])
        # Now rank 1 never comes: rank 0 fails after the 1 s timeout, naming rank 1.
        t0 = time.monotonic()
        with pytest.raises(shm.ShmError, match=r"rank\(s\) \[1\] .* did not arrive within 1 s"):
            channels[0].allreduce(torch.ones(10), SUM).wait()
        assert time.monotonic() - t0 < 10
        # The channel stays failed: a later call raises at once instead of pairing wrongly.
        with pytest.raises(shm.ShmError):
            channels[0].allreduce(torch.ones(10), SUM).wait()
    finally:
        for c in channels:
            c.close()


_CHILD = r"""
import datetime, os, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from hvdlite.common.backends import shm
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, datetime.timedelta(seconds=30))
def agree(ok):
    s = dist.PrefixStore("t2a/", store)
    s.set("ok/1", "1" if ok else "0")
    return all(s.get(f"ok/{r}") == b"1" for r in range(2))
ch = shm.connect(dist.PrefixStore("t2/", store), 1, 2, 30.0, agree)
print("CONNECTED", ch is not None, flush=True)
os._exit(0)       # gone without a word, like a killed rank
"""


@pytest.mark.timeout(90)
def test_a_peer_that_exited_is_named_within_seconds(monkeypatch):
    monkeypatch.setenv("HVDLITE_SHM", "1")
    port = free_port()
    store = _store(port, True)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(port), str(ROOT)],
                             env={**os.environ, "HVDLITE_SHM": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    channel = shm.connect(dist.PrefixStore("t2/", store), 0, 2, 30.0,
                          _agree(dist.PrefixStore("t2a/", store), 0, 2))
    out, err = child.communicate(timeout=60)
    assert "CONNECTED True" in out, err
    assert channel is not None
    try:
        t0 = time.monotonic()
        with pytest.raises(shm.ShmError, match=rf"rank\(s\) \[1\] \(pid \[{child.pid}\]\) exited"):
            channel.allreduce(torch.ones(100), SUM).wait()
        assert time.monotonic() - t0 < 10, "a dead peer must be named long before the timeout"
    finally:
        channel.close()
    assert _my_files() == []
