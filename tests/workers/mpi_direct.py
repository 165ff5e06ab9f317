"""A job started by mpiexec directly runs its collectives on MPI and gets exact results.
Prints how many collectives went through hvdlite's shared-memory channel instead of MPI: with
small tensors only, then in all, after collectives of 1 MiB and more (past the test's
HVDLITE_MPI_SHM_MIN_MB),
some of them submitted between small ones, and a large allreduce after a rank joined."""
import sys

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics

hvd.init(process_sets="dynamic")
r, s = hvd.rank(), hvd.size()
assert hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled()
assert hvd.mpi_threads_supported() is True           # MPI_THREAD_MULTIPLE, which hvdlite asks


def inputs(rank, dtype, shape=(3, 4)):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-5, 6, shape, generator=g).to(dtype)


for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64):
    vals = [inputs(k, dtype).abs() if dtype == torch.uint8 else inputs(k, dtype)
            for k in range(s)]
    mine = vals[r]
    stack = torch.stack([v.double() for v in vals])
    for op, ref in ((hvd.Sum, stack.sum(0)), (hvd.Min, stack.min(0).values),
                    (hvd.Max, stack.max(0).values), (hvd.Product, stack.prod(0))):
        out = hvd.allreduce(mine, op=op, name=f"ar.{dtype}.{op}")
        assert torch.equal(out.double(), ref.to(dtype).double()), (dtype, op, out, ref)
    avg = hvd.allreduce(mine.double() if not mine.is_floating_point() else mine,
                        name=f"avg.{dtype}")
    assert torch.allclose(avg.double(), stack.mean(0), atol=1e-2), (dtype, avg)

g = hvd.allgather(torch.full((r + 1, 2), float(r)), name="ag")
assert g.shape == (s * (s + 1) // 2, 2)
assert torch.equal(g[:, 0], torch.cat([torch.full((k + 1,), float(k)) for k in range(s)]))
b = hvd.broadcast(torch.tensor([float(r)] * 3), root_rank=s - 1, name="bc")
assert b.tolist() == [float(s - 1)] * 3
splits = [k + 1 for k in range(s)]
out, recv = hvd.alltoall(torch.full((sum(splits), 2), float(r)), splits=splits, name="a2a")
assert recv.tolist() == [r + 1] * s and out[:, 0].tolist() == sum(([float(k)] * (r + 1)
                                                                   for k in range(s)), [])
rs = hvd.reducescatter(torch.arange(2 * s + 1, dtype=torch.float32), op=hvd.Sum, name="rs")
rows = [(2 * s + 1) // s + (1 if k < (2 * s + 1) % s else 0) for k in range(s)]
start = sum(rows[:r])
assert rs.tolist() == [float(v * s) for v in range(start, start + rows[r])], rs
handles = [hvd.allreduce_async(torch.ones(100) * i, name=f"many.{i}", op=hvd.Sum)
           for i in range(50)]
assert all(torch.equal(hvd.synchronize(h), torch.ones(100) * i * s)
           for i, h in enumerate(handles))
small_shm_ops = basics.engine_counters()["shm_collectives"]

# Large collectives (past the test's HVDLITE_MPI_SHM_MIN_MB), interleaved with small ones: where waits spin,
# the large ones take the shared-memory channel and the small ones MPI, and no rank may wait on
# the other path for a collective the other rank has not reached.
n = 400_000                                             # 1.6 MB of float32
big = [torch.arange(n, dtype=torch.float32) + 7 * k for k in range(s)]
handles = []
for i in range(4):
    handles.append(hvd.allreduce_async(big[r] * (i + 1), name=f"big.{i}", op=hvd.Sum))
    handles.append(hvd.allreduce_async(torch.full((10,), float(r + i)), name=f"small.{i}",
                                       op=hvd.Sum))
want_big = torch.stack(big).sum(0)
for i in range(4):
    assert torch.equal(hvd.synchronize(handles[2 * i]), want_big * (i + 1)), i
    assert torch.equal(hvd.synchronize(handles[2 * i + 1]),
                       torch.full((10,), float(sum(range(s)) + s * i))), i
avg = hvd.allreduce(big[r].double(), name="big.avg")
assert torch.allclose(avg, torch.stack(big).double().mean(0)), "big average"
parts = [torch.full((70_000,), float(r + k)) for k in range(6)]      # fused: 1.7 MB in all
outs = hvd.grouped_allreduce(parts, op=hvd.Sum, name="big.group")
for k, o in enumerate(outs):
    assert torch.equal(o, torch.full((70_000,), float(sum(range(s)) + s * k))), k
gathered = hvd.allgather(big[r].view(-1, 4), name="big.ag")
assert torch.equal(gathered, torch.cat([b.view(-1, 4) for b in big])), "big allgather"
bc = hvd.broadcast(big[r], root_rank=s - 1, name="big.bc")
assert torch.equal(bc, big[s - 1]), "big broadcast"
m = n // s * s
rsc = hvd.reducescatter(big[r][:m], op=hvd.Sum, name="big.rs")
assert torch.equal(rsc, want_big[:m].view(s, -1)[r]), "big reducescatter"

odd = hvd.add_process_set([k for k in range(s) if k % 2 == 1])
if r % 2 == 1:
    x = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=odd, name="odd")
    assert x.item() == sum(k for k in range(s) if k % 2 == 1)
hvd.barrier()
hvd.remove_process_set(odd)
if r == 0:
    hvd.join()
else:
    hvd.allreduce(torch.ones(2), name="after_join", op=hvd.Sum)
    # Lone tensors past the in-place size (64 KiB) and past 1 MiB: the joined rank's zeros
    # must make the very calls the others make (they once went to another communicator).
    for k in (100_000, n):
        late = hvd.allreduce(torch.ones(k), name=f"after_join.{k}", op=hvd.Sum)
        assert torch.equal(late, torch.ones(k) * (s - 1)), f"the joined rank adds zeros ({k})"
    hvd.join()
shm_ops = basics.engine_counters()["shm_collectives"]
# Where the global set's channel starts (0: no channel, or MPI for all), as the ranks agreed.
comm = basics.engine().comms.get((0, "cpu"))
start = getattr(comm, "shm_min_bytes", 0) if getattr(comm, "shm", None) is not None else 0
print(f"OK rank {r} shm_collectives {small_shm_ops} {shm_ops} from {start}", flush=True)
hvd.shutdown()
sys.exit(0)
