"""The gloo transport's shared-memory data path (hvdlite/common/backends/shm.py).

Worker: tests/workers/shm_ops.py on 3 real ranks with a 4 KiB slot, so every collective runs in
several chunks split unevenly over the ranks; results against a local reference, and a short
training run against one process. Then the same worker with the path turned off on every rank,
and on one rank only (every rank must then keep gloo). Last, two ranks in this test's own
processes: a small collective runs on the submitting thread, and a late peer hands it to the
worker ahead of later ones; the steady state's rounds through the segment (ShmAgreement); a
peer that never arrives is named after the transport timeout, a peer that exited is named
within seconds, and no file is left in /dev/shm.
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
    with pytest.raises(ValueError, match="HVDLITE_SHM='maybe' is not one of auto, 1, 0, on, "
                                         "off, true, false, yes, no"):
        shm.mode()


def test_the_chunk_setting_takes_auto_or_megabytes(monkeypatch):
    monkeypatch.delenv("HVDLITE_SHM_CHUNK_MB", raising=False)
    assert shm.chunk_setting() is None                    # auto: measured at set-up
    monkeypatch.setenv("HVDLITE_SHM_CHUNK_MB", "auto")
    assert shm.chunk_setting() is None
    monkeypatch.setenv("HVDLITE_SHM_CHUNK_MB", "2")
    assert shm.chunk_setting() == 2 << 20
    monkeypatch.setenv("HVDLITE_SHM_CHUNK_MB", "0")
    assert shm.chunk_setting() == 0                       # whole slots
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("HVDLITE_SHM_CHUNK_MB", bad)
        with pytest.raises(ValueError, match=rf"HVDLITE_SHM_CHUNK_MB='{bad}' is not auto or a "
                                             rf"size in MB"):
            shm.chunk_setting()


def test_mpi_takes_the_channel_from_32_mib_unless_told(monkeypatch):
    from hvdlite.common.backends import mpi
    monkeypatch.delenv("HVDLITE_MPI_SHM_MIN_MB", raising=False)
    assert mpi.large_bytes() == 32 << 20
    monkeypatch.setenv("HVDLITE_MPI_SHM_MIN_MB", "0.5")
    assert mpi.large_bytes() == 512 << 10
    monkeypatch.setenv("HVDLITE_MPI_SHM_MIN_MB", "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        mpi.large_bytes()


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


def _pair(monkeypatch, timeout_s: float) -> list:
    """Two ranks' channels of one segment, both in this process."""
    monkeypatch.setenv("HVDLITE_SHM", "1")
    port = free_port()
    stores = [_store(port, True), None]
    stores[1] = _store(port, False)
    channels = [None, None]

    def connect(r):
        channels[r] = shm.connect(dist.PrefixStore("t1/", stores[r]), r, 2, timeout_s,
                                  _agree(dist.PrefixStore("t1a/", stores[r]), r, 2))

    threads = [threading.Thread(target=connect, args=(r,), name=f"rank-{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert channels[0] is not None and channels[1] is not None
    assert _my_files() == [], "segment files must be unlinked once every rank mapped them"
    return channels


def _as_ranks(fn, size: int = 2) -> list:
    """Run fn(r) for each rank r on a thread of its own (the ranks of _pair's channels); the
    exceptions they raised."""
    errors = []

    def run(r):
        try:
            fn(r)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def _pair_asking(monkeypatch, asks: list) -> list:
    """_pair, with rank r's HVDLITE_SHM_CHUNK_MB read as asks[r] (bytes, or None for auto):
    the two ranks are threads of this process, so one environment cannot differ between them."""
    monkeypatch.setattr(shm.settings, "chunk_setting",
                        lambda: asks[int(threading.current_thread().name[-1])])
    return _pair(monkeypatch, 30.0)


@pytest.mark.timeout(120)
def test_the_chunk_size_is_measured_once_and_agreed(monkeypatch):
    """While every rank has a core, the channel times an allreduce in 2 MiB chunks against
    whole slots at set-up and both ranks take the same answer (each chunk's phases pair up
    across ranks); later channels of the same shape reuse it without measuring, unless a rank
    does not know it; HVDLITE_SHM_CHUNK_MB overrides it, the largest any rank asks for
    winning (0: whole slots)."""
    monkeypatch.setattr(shm.segment, "local_ranks", lambda size: size)
    monkeypatch.setattr(shm.segment, "usable_cores", lambda: 2)
    monkeypatch.setattr(shm.settings, "_settled", {})
    measured = []
    real = shm.ShmChannel._measure_chunk

    def measure(self):
        measured.append(self.rank)
        return real(self)
    monkeypatch.setattr(shm.ShmChannel, "_measure_chunk", measure)

    def chunks(asks):
        channels = _pair_asking(monkeypatch, asks)
        try:
            assert all(c.spin_s > 0 for c in channels)
            # The chunks pair up: a fused allreduce spanning several of them is exact.
            xs = [[torch.arange(3 << 20, dtype=torch.float32) * (r + 1), torch.full((5,), r)]
                  for r in range(2)]
            outs = [[torch.empty_like(t) for t in xs[r]] for r in range(2)]
            works = [channels[r].allreduce_tensors(xs[r], outs[r], SUM, 1.0, 1.0)
                     for r in range(2)]
            for w in works:
                w.wait()
            for r in range(2):
                assert torch.equal(outs[r][0], torch.arange(3 << 20, dtype=torch.float32) * 3)
                assert torch.equal(outs[r][1], torch.full((5,), 1.0))
            assert channels[0].ops == 1, "set-up collectives are not counted as the user's"
            return [c.chunk for c in channels], channels[0].slot
        finally:
            for c in channels:
                c.close()

    first, slot = chunks([None, None])
    assert sorted(measured) == [0, 1], "both ranks measure together, once"
    assert first[0] == first[1] and first[0] in (shm.SPIN_CHUNK_BYTES, slot)
    assert shm.settings._settled == {(2, slot): first[0]}
    again, _ = chunks([None, None])
    assert again == first and len(measured) == 2, "known on every rank: agreed, not measured"
    # One rank asks for 1 MiB, the other leaves it to the measurement: 1 MiB on both.
    assert chunks([1 << 20, None])[0] == [1 << 20, 1 << 20]
    # 1 MiB against whole slots (0): the largest, whole slots, on both.
    assert chunks([1 << 20, 0])[0] == [slot, slot]
    # A rank that does not know the answer yet (as in a new process): both measure again.
    monkeypatch.setattr(shm.settings, "_settled", _PerRank([{(2, slot): shm.SPIN_CHUNK_BYTES}, {}]))
    fresh, _ = chunks([None, None])
    assert fresh[0] == fresh[1] and len(measured) == 4


class _PerRank(dict):
    """A dict that is a different one for each in-process rank (thread name ends in the rank)."""

    def __init__(self, dicts: list):
        super().__init__()
        self._dicts = dicts

    def _mine(self) -> dict:
        return self._dicts[int(threading.current_thread().name[-1])]

    def get(self, key, default=None):
        return self._mine().get(key, default)

    def __setitem__(self, key, value):
        self._mine()[key] = value


@pytest.mark.timeout(60)
def test_a_late_peer_hands_the_collective_to_the_worker(monkeypatch):
    """A small collective runs on the submitting thread; when the peer is later than the spin
    window, the worker finishes it from the wait it reached, before anything queued after it."""
    channels = _pair(monkeypatch, 30.0)
    try:
        for c in channels:
            c.spin_s = 0.01
        a = [torch.full((1000,), float(r + 1)) for r in range(2)]
        b = [torch.full((70_000,), float(10 * (r + 1))) for r in range(2)]   # past DIRECT_BYTES
        first = channels[0].allreduce(a[0], SUM)           # spins 10 ms, then handed over
        assert not first.is_completed() and channels[0].inline_ops == 0
        second = channels[0].allreduce(b[0], SUM)          # queued behind the first
        time.sleep(0.05)
        late = [channels[1].allreduce(a[1], SUM), channels[1].allreduce(b[1], SUM)]
        for w in [first, second] + late:
            w.wait()
        for r in range(2):
            assert torch.equal(a[r], torch.full((1000,), 3.0))
            assert torch.equal(b[r], torch.full((70_000,), 30.0))
        assert channels[1].inline_ops >= 1, "the punctual rank ran its part on its own thread"
        # With both ranks there, a small one runs to the end on the submitting thread.
        x = [torch.full((10,), float(r)) for r in range(2)]
        done = []
        t = threading.Thread(target=lambda: done.append(channels[1].allreduce(x[1], SUM)))
        t.start()
        channels[0].allreduce(x[0], SUM).wait()
        t.join(10)
        done[0].wait()
        assert torch.equal(x[0], torch.full((10,), 1.0)) and torch.equal(x[1], x[0])
    finally:
        for c in channels:
            c.close()


@pytest.mark.timeout(120)
def test_fused_allreduce_reads_its_own_part_from_large_inputs_and_copies_small_ones(monkeypatch):
    """A fused allreduce that is not prescaled: where a rank's own part of a chunk lies in
    inputs of OWN_PIECE_BYTES or more on average it is reduced from them input by input, else
    the chunk is copied into the slot whole and the part reduced in one call; the results go
    out through multi-tensor copies (flat.unpack), an integer postscale part by part, a None
    output (a joined rank's) is dropped. Chunks of 256 KiB, so members straddle them. Every
    result equals the sum computed here, bit for bit."""
    channels = _pair(monkeypatch, 30.0)
    try:
        for c in channels:
            c.chunk = 256 << 10
        cases = [("large", torch.float32, [70_000, 90_000, 5, 130_000], 1.0),
                 ("small", torch.float32, [300 + 37 * k for k in range(60)], 1.0),
                 ("mixed", torch.float64, [3, 40_000, 11, 2, 25_000, 1], 0.5),
                 ("ints", torch.int32, [1000 * k + 1 for k in range(1, 30)], 3.0)]
        for label, dtype, counts, post in cases:
            ins = [[(torch.arange(n, dtype=torch.float64) * (r + 1) + k).to(dtype)
                    for k, n in enumerate(counts)] for r in range(2)]
            outs = [[torch.zeros(n, dtype=dtype) for n in counts] for _ in range(2)]
            outs[1][1] = None                         # rank 1 drops its second result
            errors = _as_ranks(lambda r: channels[r].allreduce_tensors(
                ins[r], outs[r], SUM, 1.0, post).wait())
            assert not errors, (label, errors)
            for r in range(2):
                for k, out in enumerate(outs[r]):
                    if out is None:
                        continue
                    want = ins[0][k] + ins[1][k]
                    want = torch.mul(want, post) if dtype.is_floating_point else \
                        (want.to(torch.float64) * post).to(dtype)
                    assert torch.equal(out, want), (label, r, k)
    finally:
        for c in channels:
            c.close()


@pytest.mark.timeout(60)
def test_spinning_waits_in_cache_sized_chunks(monkeypatch):
    """While every rank has a core, the worker's waits spin before they sleep and a large
    collective runs in chunks smaller than the slot (SPIN_CHUNK_BYTES). Here the chunk is 4 KiB,
    so each collective runs in many chunks with an uneven tail, and rank 1 starts 50 ms late
    (rank 0's first wait outlasts its spin and sleeps; the later ones find rank 1 in step).
    Results against references computed here."""
    channels = _pair(monkeypatch, 30.0)
    try:
        for c in channels:
            c.spin_s = 0.005
            c.chunk = 4096
        assert channels[0].chunk < channels[0].slot
        n = 5003
        ins = [torch.arange(n, dtype=torch.float32) * (r + 1) + r for r in range(2)]
        fused = [[torch.full((k * 700 + 11,), float(10 * r + k)) for k in range(3)]
                 for r in range(2)]
        fused_out = [[torch.empty_like(t) for t in fused[r]] for r in range(2)]
        rs_in = [torch.arange(2 * n, dtype=torch.float64) + 100 * r for r in range(2)]
        rs_out = [torch.empty(n, dtype=torch.float64) for _ in range(2)]
        ag_in = [torch.full((n,), r + 1, dtype=torch.int32) for r in range(2)]
        ag_out = [torch.empty(2 * n, dtype=torch.int32) for _ in range(2)]
        bc = [torch.arange(n, dtype=torch.int64) * (1 - r) for r in range(2)]

        def rank(r):
            if r == 1:
                time.sleep(0.05)
            c = channels[r]
            works = [c.allreduce(ins[r], SUM),
                     c.allreduce_tensors(fused[r], fused_out[r], SUM, 0.5, 4.0),
                     c.reducescatter(rs_out[r], rs_in[r], SUM),
                     c.allgather(ag_out[r], ag_in[r]),
                     c.broadcast(bc[r], 0)]
            for w in works:
                w.wait()

        errors = _as_ranks(rank)
        assert not errors, errors
        want = torch.arange(n, dtype=torch.float32) * 3 + 1
        rs_want = (torch.arange(2 * n, dtype=torch.float64) * 2 + 100).view(2, n)
        for r in range(2):
            assert torch.equal(ins[r], want)
            for k in range(3):
                assert torch.equal(fused_out[r][k], torch.full((k * 700 + 11,), 20.0 + 4 * k))
            assert torch.equal(rs_out[r], rs_want[r])
            assert torch.equal(ag_out[r], torch.cat([torch.full((n,), 1, dtype=torch.int32),
                                                     torch.full((n,), 2, dtype=torch.int32)]))
            assert torch.equal(bc[r], torch.arange(n, dtype=torch.int64))
    finally:
        for c in channels:
            c.close()


@pytest.mark.timeout(60)
def test_agreement_rounds(monkeypatch):
    """Rounds through the segment: AND of the bits, OR of the fallback flags, over more rounds
    than the two sets of words (each round's words are reused two rounds later), wide ones too."""
    channels = _pair(monkeypatch, 30.0)
    try:
        ags = [c.agreement for c in channels]
        for k in range(6):
            width = 64 if k < 4 else 300
            bits = [(1 << 299 | 0b1011) if r == 0 else (1 << 299 | 0b0110 | k << 8)
                    for r in range(2)]
            bits = [b & ((1 << width) - 1) for b in bits]
            req0 = ags[0].start(bits[0], fallback=(k == 3), width=width)
            assert not req0.test(), "a round is not over before every rank started it"
            req1 = ags[1].start(bits[1], fallback=False, width=width)
            assert req0.test() and req1.test()
            want = (bits[0] & bits[1], k == 3)
            assert req0.value() == want and req1.value() == want
        with pytest.raises(ValueError, match="exceeds"):
            ags[0].start(0, False, shm.AGREE_BITS + 1)
    finally:
        for c in channels:
            c.close()


@pytest.mark.timeout(60)
def test_agreement_rounds_carry_a_payload(monkeypatch):
    """A round both ranks tag, offering the same bits (one or several) with no fallback, carries
    their tensors: every rank reads the same sum of the payloads. A different tag, other bits
    (a count or a set that differs), a tag that is not a rank's lowest bit or a fallback flag
    on either rank leaves the payload unused. Over more rounds than the two parities."""
    channels = _pair(monkeypatch, 30.0)
    try:
        ags = [c.agreement for c in channels]
        two, other = 1 << 3 | 1 << 40, 1 << 3 | 1 << 41
        cases = [((3, 3), (1 << 3, 1 << 3), (False, False), 3),       # carried
                 ((3, 5), (1 << 3, 1 << 5), (False, False), -1),      # other tags
                 ((3, -1), (1 << 3, 1 << 3), (False, False), -1),     # one rank did not tag
                 ((3, 3), (1 << 3, 1 << 3 | 1), (False, False), -1),  # not rank 1's lowest
                 ((3, 3), (1 << 3, 1 << 3), (False, True), -1),       # a fallback
                 ((3, 3), (two, two), (False, False), 3),             # two bits, carried
                 ((3, 3), (two, 1 << 3), (False, False), -1),         # another count
                 ((3, 3), (two, other), (False, False), -1),          # the same count, other bits
                 ((3, 3), (two, two), (True, False), -1),             # two bits, a fallback
                 ((7, 7), (1 << 7, 1 << 7), (False, False), 7)]       # carried again
        for k, (tags, bits, falls, carried) in enumerate(cases):
            xs = [torch.arange(20, dtype=torch.float32) * (r + 1) + k for r in range(2)]
            for r in range(2):
                ags[r].payload_for(64)[:20].copy_(xs[r])
            req0 = ags[0].start(bits[0], falls[0], 64, tag=tags[0])
            req1 = ags[1].start(bits[1], falls[1], 64, tag=tags[1])
            assert req0.test() and req1.test()
            v0, v1 = req0.value(), req1.value()
            assert v0 == v1 == (bits[0] & bits[1], falls[0] or falls[1]), (k, v0, v1)
            assert req0.inline == req1.inline == carried, (k, req0.inline, req1.inline)
            if carried >= 0:
                s0, s1 = req0.payload()[:20].clone(), req1.payload()[:20].clone()
                assert torch.equal(s0, xs[0] + xs[1]) and torch.equal(s0, s1), k
    finally:
        for c in channels:
            c.close()


@pytest.mark.timeout(60)
def test_a_peer_that_never_arrives_is_named(monkeypatch):
    channels = _pair(monkeypatch, 1.0)
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
