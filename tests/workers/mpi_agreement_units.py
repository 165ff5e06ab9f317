"""backends/mpi.Agreement on one process (MPI's COMM_SELF): how a round encodes and decodes its
bits, its fallback flag and its payload's tag (one bit or several), the limit on a tagged
round's bits, and the error for a round started before the last one ended; with persistent
requests and without. Then backends/mpi._Sequence, the chained in-place allreduces of a fused
response: it starts only when first tested or waited for, runs every call, and stays complete
once done. Run as a plain process (MPI's singleton start), so the test process itself never
initializes MPI."""
from __future__ import annotations

import torch
from mpi4py import MPI

from hvdlite.common.backends import mpi as backend
from hvdlite.common.backends.mpi import Agreement
from hvdlite.common.protocol import INLINE_FLOATS


def done(req):
    for _ in range(1000):
        if req.test():
            return req
    raise AssertionError("a round on COMM_SELF did not complete")


def check(persistent: bool) -> None:
    ag = Agreement(MPI.COMM_SELF)
    if not persistent:              # an MPI before version 4: a new Iallreduce per round
        ag._persistent = False

    # One bit, tagged: the payload is the allreduce (of one rank: the tensor itself).
    payload = ag.payload_for(10)
    assert payload is not None and payload.numel() == INLINE_FLOATS
    assert payload.dtype == torch.float32
    assert (ag._round is not None) == persistent
    payload[:3] = torch.tensor([1.5, -2.0, 4.0])
    req = done(ag.start(1 << 3, False, 10, tag=3))
    assert req.value() == (1 << 3, False) and req.inline == 3, (req.value(), req.inline)
    assert torch.equal(ag.payload_for(10)[:3], torch.tensor([1.5, -2.0, 4.0]))

    # Two bits, tagged with the lowest: the payload holds both tensors, one after the other.
    payload[:5] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    req = done(ag.start((1 << 0) | (1 << 9), False, 10, tag=0))
    assert req.value() == ((1 << 0) | (1 << 9), False) and req.inline == 0, req.value()
    assert torch.equal(ag.payload_for(10)[:5], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    # A tag that is not the round's lowest bit is no tag: decoded from the flags.
    req = done(ag.start((1 << 0) | (1 << 9), False, 10, tag=9))
    assert req.value() == ((1 << 0) | (1 << 9), False) and req.inline == -1, req.value()

    # A round that asks for the fallback carries no payload, even when tagged.
    req = done(ag.start(1 << 4, True, 10, tag=4))
    assert req.value() == (1 << 4, True) and req.inline == -1, (req.value(), req.inline)

    # The fallback flag, and a round with no bit.
    req = done(ag.start(1 << 2, True, 10))
    assert req.value() == (1 << 2, True) and req.inline == -1
    req = done(ag.start(0, False, 10))
    assert req.value() == (0, False)

    # Wider rounds re-lay the buffer: 200 bits (numpy's unpacking path).
    bits = sum(1 << b for b in range(0, 200, 7))
    req = done(ag.start(bits, False, 200))
    assert req.value() == (bits, False)

    # A tag is the number of bits offered, and the tags' sums are exact in float32 only while
    # size * bits ** 2 < 2 ** 24: any width may tag a round of one bit, and a round of more
    # bits than that bound is a plain round (4095 on one rank).
    assert ag._max_tagged == 4095
    req = done(ag.start(1 << 4000, False, 4096, tag=4000))
    assert req.value() == (1 << 4000, False) and req.inline == 4000
    every = (1 << 4096) - 1
    req = done(ag.start(every, False, 4096, tag=0))       # 4096 bits: too many to tag
    assert req.value() == (every, False) and req.inline == -1
    req = done(ag.start(every >> 1, False, 4096, tag=0))  # 4095: tagged
    assert req.value() == (every >> 1, False) and req.inline == 0

    # A persistent round cannot start again before the last one was seen to end.
    if persistent and ag._round is not None:
        ag.payload_for(10)
        first = ag.start(1, False, 10)
        try:
            ag.start(1, False, 10)
        except RuntimeError as exc:
            assert "previous one had not finished" in str(exc), exc
        else:
            raise AssertionError("a second round started while the first was in flight")
        done(first)
        done(ag.start(1, False, 10))
        print("persistent rounds: yes")
    ag.close()


def check_sequence(driven_by: str) -> None:
    comm = MPI.COMM_SELF.Dup()
    ts = [torch.arange(n, dtype=torch.float32) for n in (5, 70000, 3)]
    launched = []

    class Counting:                   # COMM_SELF, counting the calls the sequence makes
        def Iallreduce(self, *args):
            launched.append(args[1])
            return comm.Iallreduce(*args)

    seq = backend._Sequence(Counting(), [t.numpy() for t in ts], MPI.SUM,
                            backend._Waiter(yielding=False, timeout_s=30.0, rank=0))
    assert not launched, "the sequence started before anyone tested or waited for it"
    if driven_by == "test":
        for _ in range(10000):
            if seq.is_completed():
                break
        else:
            raise AssertionError("a sequence on COMM_SELF did not complete")
    else:
        seq.wait()
    assert len(launched) == 3 and [a.size for a in launched] == [5, 70000, 3], launched
    for _ in range(3):                # complete for good: no call more, nothing raises
        assert seq.is_completed()
        seq.wait()
    assert len(launched) == 3
    for n, t in zip((5, 70000, 3), ts):
        assert torch.equal(t, torch.arange(n, dtype=torch.float32))
    comm.Free()
    print(f"sequence driven by {driven_by}: ok")


check(persistent=True)
check(persistent=False)
check_sequence("test")
check_sequence("wait")
print("AGREEMENT UNITS OK", flush=True)
