"""Shared-memory data path for the ranks of a gloo (or MPI) communicator that share one host.

Why: on one host gloo moves every byte through TCP loopback (about 1.1-1.4 GB/s on this
project's machine, and 0.6-1.6 ms even for 4 KiB), while the ranks could read each other's
memory: MPICH does so and reduces 16 MiB in ~2 ms. torch DDP over gloo pays the TCP cost;
hvdlite need not. gloo keeps everything this path does not cover (alltoall, ranks on several
hosts, dtypes torch cannot reduce elementwise).

How. The ranks map one file of /dev/shm: a header page (one progress counter per rank, each on
its own cache line), one input slot of `slot_bytes` per rank, and one result area of the same
size. A collective runs in chunks of at most one slot:

  1. wait until every peer has finished the previous chunk (it no longer reads my slot or the
     result area);
  2. copy my part of the chunk into my slot; publish; wait for every peer;
  3. (reductions) reduce my 1/N of the chunk, reading that range of every slot, into the
     result area; publish; wait for every peer. (An allreduce reads my own 1/N from my input
     instead, where it lies in one input tensor and is not prescaled, and step 2 skips it:
     no peer reads that range of my slot. 2 ranks, 4-64 MiB: 1.14-1.18 x faster.)
  4. copy the results out (of the result area, or of the peers' slots); publish (nobody waits
     here: step 1 of the next chunk does, usually long after).

A fused allreduce copies its tensors straight into the slot and its results straight out of the
result area (with Average's or a postscale's factor applied while copying), so the engine's
fusion buffer and its two extra passes over memory are not used.

"Publish" raises my counter (every rank runs the same phases in the same order, so the counters
agree) and writes one byte into every peer's FIFO. A waiter re-reads the counters and sleeps in
select() on its own FIFO between checks: a waiting rank leaves the core to the others (4 ranks
on 2 cores stay fast), and no wake-up is lost (a byte written before the select makes it return
at once). Every element is reduced by exactly one rank and copied by the others, so all ranks
get identical bits.

Set-up is collective, beside the gloo process group's: rank 0 creates and maps the file and
posts its path, size and a random token in the job's store; every other rank maps it and checks
the token; each rank creates a FIFO and opens every peer's. One gloo allreduce then tells every rank whether all of them succeeded; if any did not
(ranks on several hosts, containers with separate /dev/shm, /dev/shm full, HVDLITE_SHM=0), the
whole communicator keeps gloo. Space is reserved with posix_fallocate, so a full /dev/shm is a
refusal at set-up, never a SIGBUS later, and the slot shrinks to fit a small /dev/shm (a
container's default is 64 MiB). Files are unlinked as soon as every rank has mapped
them, so a crash leaves nothing behind. Waits are bounded by the transport timeout and check
once a second that the peers' processes are alive, so a dead or stuck peer becomes an error
naming its rank and pid instead of a hang.

Ordering: a peer reads my data after it sees my counter; x86-64 keeps stores in order as other
cores see them, so `auto` enables this path there only (HVDLITE_SHM=1 forces it elsewhere).
"""
from .agreement import ShmAgreement, ShmAgreementRequest
from .channel import ShmChannel, ShmError
from .routing import ShmRouted
from .segment import MIN_SLOT, connect
from .settings import (AGREE_BITS, CALIBRATE_BYTES, CALIBRATE_ROUNDS, DIRECT_BYTES, INLINE_BYTES,
                       INLINE_POLL_S, SHM_DIR, SPIN_CHUNK_BYTES, chunk_setting, header_bytes,
                       mode, slot_bytes)

__all__ = ["ShmAgreement", "ShmAgreementRequest", "ShmChannel", "ShmError", "ShmRouted",
           "MIN_SLOT", "connect", "AGREE_BITS", "CALIBRATE_BYTES", "CALIBRATE_ROUNDS",
           "DIRECT_BYTES", "INLINE_BYTES", "INLINE_POLL_S", "SHM_DIR", "SPIN_CHUNK_BYTES",
           "chunk_setting", "header_bytes", "mode", "slot_bytes"]
