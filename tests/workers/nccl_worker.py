"""CUDA tensors through hvdlite: results equal CPU references, on the caller's own stream."""
import os

import torch

import hvdlite.torch as hvd

hvd.init()
r, s = hvd.rank(), hvd.size()
shared = os.environ.get("HVDLITE_TEST_SHARED_GPU") == "1"
dev = torch.device("cuda", 0 if shared else hvd.local_rank())
torch.cuda.set_device(dev)
if shared:
    # Ranks sharing one GPU cannot use NCCL; force the host-staging path.
    import hvdlite.common.backends.nccl as nccl
    nccl.available = lambda: False
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    for dtype in (torch.float32, torch.float16, torch.int32, torch.int64):
        x = (torch.arange(1000, device=dev) % 7 + r).to(dtype)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"x.{dtype}")
        ref = sum((torch.arange(1000) % 7 + k).to(torch.float64) for k in range(s))
        assert torch.equal(y.cpu().double(), ref), dtype
    hs = [hvd.allreduce_async(torch.full((333,), float(i + r), device=dev), name=f"f{i}",
                              op=hvd.Sum) for i in range(20)]
    for i, h in enumerate(hs):
        expected = torch.full((333,), float(s * i + s * (s - 1) / 2))
        assert torch.equal(hvd.synchronize(h).cpu(), expected)
    g = hvd.allgather(torch.full((r + 1, 3), float(r), device=dev), name="g")
    assert g.shape == (s * (s + 1) // 2, 3) and g.is_cuda
    b = hvd.broadcast(torch.full((5,), float(r), device=dev), root_rank=1, name="b")
    assert torch.equal(b.cpu(), torch.ones(5))
    rs = hvd.reducescatter(torch.ones(2 * s, device=dev), op=hvd.Sum, name="rs")
    assert torch.equal(rs.cpu(), torch.full((2,), float(s)))
    a = hvd.alltoall(torch.full((s,), float(r), device=dev), name="a2a")
    assert torch.equal(a.cpu(), torch.arange(s, dtype=torch.float32))
print("OK", flush=True)
hvd.shutdown()
