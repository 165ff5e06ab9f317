"""The shared-memory data path of the gloo transport (hvdlite/common/backends/shm.py).

Run with a tiny slot (HVDLITE_SHM_SLOT_MB set by the test), so every collective below runs in
several chunks whose split over the ranks is uneven. Results are compared with a reference
computed locally from every rank's input. Arguments:
  --expect on|off     whether the path must have carried the collectives (engine counter)
  --off-on-rank R     rank R sets HVDLITE_SHM=0 before init: every communicator with rank R
                      must then keep gloo (on every rank), the others may still share memory
"""
from __future__ import annotations

import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("--expect", choices=["on", "off"], default="on")
p.add_argument("--off-on-rank", type=int, default=-1)
args = p.parse_args()
if int(os.environ.get("HOROVOD_RANK", "-1")) == args.off_on_rank:
    os.environ["HVDLITE_SHM"] = "0"

import torch  # noqa: E402

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.common import basics  # noqa: E402
from ops_common import (all_inputs, check, close, fail, finish, gen, my_rows,  # noqa: E402
                        reduce_ref, same, wait_until)

pair = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[pair])
rank, size = hvd.rank(), hvd.size()
assert size == 3, "shm_ops.py needs 3 ranks"
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}
# 2 elements (fewer than ranks), a few chunks with an uneven tail, and a 2-D tensor.
SHAPES = [(2,), (5003,), (37, 129)]


def allreduce_every_dtype_and_op():
    for dtype in DTYPES:
        for name, op in OPS.items():
            if name == "Average" and not dtype.is_floating_point:
                continue
            for i, shape in enumerate(SHAPES):
                lo, hi = (-1, 1) if name == "Product" else (-4, 4)
                x = gen(rank, shape, dtype, salt=(name, i), lo=lo, hi=hi)
                got = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{name}.{i}")
                ref = reduce_ref(all_inputs(size, shape, dtype, salt=(name, i), lo=lo, hi=hi), op)
                if name == "Average":     # x * (1/3) in float32 vs float64 then rounded
                    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
                    close(got, ref, f"allreduce {name} {dtype} {shape}", rtol=tol, atol=tol)
                else:
                    same(got, ref, f"allreduce {name} {dtype} {shape}")


def fused_in_place_and_scaled():
    handles = []
    for i, shape in enumerate([(3,), (4000,), (17, 19), (1,)]):
        x = gen(rank, shape, torch.float32, salt=("fused", i))
        handles.append((shape, i, hvd.allreduce_async_(x, op=hvd.Sum, name=f"fu.{i}",
                                                       prescale_factor=0.5,
                                                       postscale_factor=4.0), x))
    for shape, i, h, x in handles:
        got = hvd.synchronize(h)
        ref = reduce_ref(all_inputs(size, shape, torch.float32, salt=("fused", i)), hvd.Sum,
                         pre=0.5, post=4.0)
        same(x, ref, f"in-place fused {shape}")
        same(got, ref, f"fused result {shape}")
    # Not prescaled: each rank's own part of a chunk is read from the inputs where they are
    # large there, else the chunk is copied in whole and reduced in one call (shm.py,
    # OWN_PIECE_BYTES; 4 KiB slots here, so members straddle chunks either way); the results
    # go out through multi-tensor copies, and an integer postscale part by part.
    for dtype, post in ((torch.float32, 1.0), (torch.float64, 0.25), (torch.int32, 3.0)):
        shapes = [(3,), (1000,), (7, 7), (1,), (2500,), (40, 50)]
        handles = []
        for i, shape in enumerate(shapes):
            x = gen(rank, shape, dtype, salt=("own", dtype, i))
            handles.append((shape, i, hvd.allreduce_async_(
                x, op=hvd.Sum, name=f"own.{dtype}.{i}", postscale_factor=post), x))
        for shape, i, h, x in handles:
            hvd.synchronize(h)
            ref = reduce_ref(all_inputs(size, shape, dtype, salt=("own", dtype, i)), hvd.Sum,
                             post=post)
            same(x, ref, f"fused, not prescaled, {dtype} x{post} {shape}")


def reducescatter():
    for dtype in (torch.float32, torch.int32):
        for shape in [(3 * 700, 5), (10, 3), (2,)]:
            x = gen(rank, shape, dtype, salt=("rs", shape))
            got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{dtype}.{shape}")
            full = reduce_ref(all_inputs(size, shape, dtype, salt=("rs", shape)), hvd.Sum)
            same(got, my_rows(full, size, rank), f"reducescatter {dtype} {shape}")


def allgather_uneven():
    for dtype in (torch.float32, torch.uint8, torch.bool):
        rows = [1000 + 7 * r for r in range(size)]
        x = gen(rank, (rows[rank], 3), dtype, salt=("ag", dtype))
        got = hvd.allgather(x, name=f"ag.{dtype}")
        ref = torch.cat([gen(r, (rows[r], 3), dtype, salt=("ag", dtype)) for r in range(size)])
        same(got, ref, f"allgather {dtype}")


def broadcast_from_each_root():
    for root in range(size):
        x = gen(rank, (6001,), torch.float64, salt=("bc", root))
        got = hvd.broadcast(x, root_rank=root, name=f"bc.{root}")
        same(got, gen(root, (6001,), torch.float64, salt=("bc", root)), f"broadcast root {root}")
        obj = hvd.broadcast_object({"from": rank, "blob": list(range(3000))}, root_rank=root)
        if obj != {"from": root, "blob": list(range(3000))}:
            fail(f"broadcast_object from {root}: got {str(obj)[:80]}")


def process_set():
    if rank in (0, 2):
        for i in range(3):
            x = gen(rank, (4099,), torch.float32, salt=("ps", i))
            got = hvd.allreduce(x, op=hvd.Average, name=f"ps.{i}", process_set=pair)
            ref = reduce_ref([gen(r, (4099,), torch.float32, salt=("ps", i)) for r in (0, 2)],
                             hvd.Average)
            close(got, ref, f"process set [0, 2] step {i}")
    hvd.barrier()


def training_matches_one_process():
    """A few SGD steps of a small model on 3 ranks equal one process on the whole batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        xs, ys = torch.randn(size * 8, 20, generator=g), torch.randint(0, 3, (size * 8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[rank * 8:(rank + 1) * 8]),
                                          ys[rank * 8:(rank + 1) * 8]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(xs), ys).backward()
        ref_opt.step()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        close(a.detach(), b.detach(), f"weights {n}", rtol=1e-5, atol=1e-6)


def releases_buffers():
    """A finished collective keeps no reference to its tensors. The worker used to keep the
    last one's views until the next collective, which pinned a step's last gradients and
    output buffers (the TensorFlow frontend's buffer reuse and TensorFlow's allocator then got
    fresh memory every step). Storage use counts must return to what they were."""
    from hvdlite.common import ops as cops

    def count(t):
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    for fused in (False, True):
        ins = [torch.full((3000 + k,), float(rank + k)) for k in range(3 if fused else 1)]
        outs = [torch.empty_like(t) for t in ins]
        before = [count(t) for t in ins + outs]
        names = [f"release.{int(fused)}.{k}" for k in range(len(ins))]
        handle = cops.allreduce(ins, names=names, op=hvd.Sum, outputs=outs)
        handle.wait()
        del handle
        want = [sum(r + k for r in range(size)) for k in range(len(ins))]
        for k, o in enumerate(outs):
            if not torch.equal(o, torch.full_like(o, float(want[k]))):
                fail(f"{names[k]}: wrong result {o[:3].tolist()}, want {want[k]}")
        # The worker thread finishes just after us.
        wait_until(lambda: [count(t) for t in ins + outs] == before, 5.0, pause=0.01)
        after = [count(t) for t in ins + outs]
        if after != before:
            fail(f"{'fused' if fused else 'single'} allreduce: storage use counts {after} "
                 f"after the collective finished, {before} before: something still holds the "
                 f"tensors")


def path_used():
    ran = basics.engine_counters()["shm_collectives"]
    if args.expect == "on" and ran < 50:
        fail(f"the shared-memory path ran only {ran} collectives; expected it to carry them")
    if args.expect == "off":
        # Agreement is per communicator: with rank 1 off, the global set keeps gloo, while the
        # set [0, 2], whose ranks both have it on, carries its 3 allreduces in shared memory.
        want = 3 if args.off_on_rank == 1 and rank in (0, 2) else 0
        if ran != want:
            fail(f"the shared-memory path ran {ran} collectives; expected {want} with it "
                 f"turned off on rank {args.off_on_rank if args.off_on_rank >= 0 else 'all'}")


check("allreduce", allreduce_every_dtype_and_op)
check("fused", fused_in_place_and_scaled)
check("reducescatter", reducescatter)
check("allgather", allgather_uneven)
check("broadcast", broadcast_from_each_root)
check("process_set", process_set)
check("training", training_matches_one_process)
check("releases_buffers", releases_buffers)
check("path_used", path_used)
finish()
hvd.shutdown()
