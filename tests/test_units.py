"""Single-process checks of pure pieces of the engine (the multi-process tests cover the rest)."""
import torch

from hvdlite.common.collectives import FusionBuffer
from hvdlite.common.fusion import fuse_responses
from hvdlite.common.messages import ALLREDUCE, BROADCAST, Response


def test_fusion_buffers_are_lent_and_reused_without_comparing_tensors():
    pool = FusionBuffer()
    bufs = [pool.acquire(n) for n in (1 << 20, 3 << 20, 1 << 16, 2 << 20, 5 << 20, 1 << 18)]
    assert len({id(b) for b in bufs}) == len(bufs)
    for b in bufs:
        pool.release(b)
    again = pool.acquire(2 << 20)           # the smallest idle buffer that fits
    assert again.numel() >= 2 << 20 and any(again is b for b in bufs)
    pool.release(again)
    assert sum(len(v) for v in pool._free.values()) <= FusionBuffer.KEEP


def _resp(name, dtype="float32", n=4, rtype=ALLREDUCE, root=-1):
    return Response(type=rtype, names=[name], dtype=dtype, shapes=[(n,)], root_rank=root,
                    cache_bits=[-1])


def test_fusion_respects_threshold_dtype_and_looks_ahead():
    rs = [_resp("a"), _resp("h1", "float16"), _resp("b"), _resp("h2", "float16"),
          _resp("big", n=1000)]
    fused = fuse_responses(rs, threshold=64)
    names = [f.names for f in fused]
    assert names[0] == ["a", "b"]            # looked past the fp16 tensor
    assert ["h1", "h2"] in names
    assert ["big"] in names                  # over the threshold: alone
    assert fuse_responses(rs, threshold=0) == rs or all(len(f.names) == 1 for f in
                                                        fuse_responses(rs, threshold=0))


def test_broadcasts_fuse_only_with_the_same_root():
    rs = [_resp("x", rtype=BROADCAST, root=0), _resp("y", rtype=BROADCAST, root=1),
          _resp("z", rtype=BROADCAST, root=0)]
    names = [f.names for f in fuse_responses(rs, threshold=1 << 20)]
    assert names == [["x", "z"], ["y"]]
