"""CUDA tensors through hvdlite: results equal CPU references, on the caller's own stream.

Modes (environment):
  HVDLITE_TEST_SHARED_GPU=1   every rank uses GPU 0; hvdlite must notice that NCCL cannot serve
                              ranks that share a GPU and stage through host memory instead.
  HVDLITE_TEST_NCCL_ONE_RANK=1  one rank, with the job's one-rank CUDA communicator replaced by a
                              real one-rank NCCLCommunicator, so hvdlite's NCCL code runs on a
                              machine with a single GPU (NCCL refuses two ranks on one GPU).
  HVDLITE_TEST_NCCL_HOSTID=1  every rank uses GPU 0 under its own NCCL_HOSTID: NCCL takes the
                              ranks for hosts of their own and connects them over loopback
                              sockets, so a real multi-rank NCCL communicator runs on one GPU,
                              and hvdlite must hand them to NCCL instead of staging.
Prints "OK <communicator class of the CUDA tensors>".
"""
import os

if os.environ.get("HVDLITE_TEST_NCCL_HOSTID") == "1":
    # Before anything starts NCCL: it reads its host id once per process.
    os.environ["NCCL_HOSTID"] = f"hvdlite-test-rank{os.environ['HOROVOD_RANK']}"

import torch

import hvdlite.torch as hvd

shared = os.environ.get("HVDLITE_TEST_SHARED_GPU") == "1"
hostids = os.environ.get("HVDLITE_TEST_NCCL_HOSTID") == "1"
if os.environ.get("HVDLITE_TEST_NCCL_ONE_RANK") == "1":
    import hvdlite.common.backends.select as select
    from hvdlite.common.backends import nccl

    make = select.comm_factory

    def comm_factory(transport, **kw):
        build = make(transport, **kw)

        def one_rank_nccl(set_id, ranks, kind="cpu", device=-1):
            if kind == "cuda" and len(ranks) == 1:
                return nccl.NCCLCommunicator(kw["store"], f"{kw['prefix']}nccl1/{set_id}/", 0, 1,
                                             kw["timeout_s"])
            return build(set_id, ranks, kind, device)
        return one_rank_nccl

    select.comm_factory = comm_factory

hvd.init()
r, s = hvd.rank(), hvd.size()
dev = torch.device("cuda", 0 if shared or hostids else hvd.local_rank())
torch.cuda.set_device(dev)
root = s - 1
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
    avg = [torch.full((7, 3), float(r + i), device=dev) for i in range(3)]
    hs = [hvd.allreduce_async(t, name=f"avg{i}") for i, t in enumerate(avg)]   # op=Average
    for i, h in enumerate(hs):
        assert torch.equal(hvd.synchronize(h).cpu(), torch.full((7, 3), i + (s - 1) / 2))
    big = torch.arange(1 << 22, dtype=torch.float32, device=dev) + r
    hvd.allreduce_(big, op=hvd.Sum, name="big")
    ref = (torch.arange(1 << 22, dtype=torch.float64) * s + s * (s - 1) / 2).float()
    assert torch.equal(big.cpu(), ref)
    g = hvd.allgather(torch.full((r + 1, 3), float(r), device=dev), name="g")
    assert g.shape == (s * (s + 1) // 2, 3) and g.is_cuda
    ref = torch.cat([torch.full((k + 1, 3), float(k)) for k in range(s)])
    assert torch.equal(g.cpu(), ref)
    for dtype in (torch.float32, torch.int16, torch.bool):
        b = hvd.broadcast(torch.full((5,), r, device=dev).to(dtype), root_rank=root,
                          name=f"b.{dtype}")
        assert torch.equal(b.cpu(), torch.full((5,), root).to(dtype)), dtype
    rs = hvd.reducescatter(torch.ones(2 * s, device=dev), op=hvd.Sum, name="rs")
    assert torch.equal(rs.cpu(), torch.full((2,), float(s)))
    a = hvd.alltoall(torch.full((s,), float(r), device=dev), name="a2a")
    assert torch.equal(a.cpu(), torch.arange(s, dtype=torch.float32))
    if shared or hostids:
        # A rank that joined contributes zeros to the others' CUDA allreduces (on the host when
        # they are staged, on its GPU for NCCL).
        if r == 0:
            for k in range(3):
                x = torch.full((64,), float(k), device=dev)
                y = hvd.allreduce(x, op=hvd.Sum, name="after_join")
                assert torch.equal(y.cpu(), torch.full((64,), float(k))), y
        assert hvd.join() == 0
torch.cuda.synchronize()
from hvdlite.common import basics  # noqa: E402
comm = basics._require().engine.comms.get((0, "cuda"))
if shared:
    # Fused CUDA allreduces went through pinned host memory in one copy each way.
    assert basics.engine_counters()["staged_allreduces"] > 0, basics.engine_counters()
if hostids:
    # Built on this rank's own GPU, whichever rank's request the responses were built from.
    assert comm.device == str(dev), (comm.device, dev)
print("OK", type(comm).__name__, flush=True)
hvd.shutdown()
