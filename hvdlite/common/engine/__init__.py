"""The engine: one background thread per process that turns enqueued requests into collectives.

    frontend --enqueue--> queue --(control socket)--> coordinator --responses--> execute --> handles

The background thread sends new requests (or their cache bits) to the coordinator and launches
the responses it gets back, in order, on the process set's communicator; a finisher thread waits
for each launched transport call in the same order, copies results out and completes handles.
So negotiation of the next tensors overlaps the transport of the previous ones. Any failure
completes every pending handle with HorovodInternalError, so no caller waits forever.

Once the coordinator has put a process set into the steady state (Item.STEADY), the background
thread releases that set's cached tensors itself: rounds of a recursive-doubling AND of cache
bits over direct connections to the other ranks (steady.py documents the protocol), and falls
back to the coordinator the moment anything is not a cache hit. `counters` counts both paths.

A blocking allreduce of one cached tensor, with nothing else of its rank in flight, takes the
express lane (express): its caller runs the round and the collective, without a handle, the
queue or the bucket planner, and returns with the result; only where the general path must
take over does the entry get a handle and a place in the engine's tables (_attach). A blocking
call of several small float32 tensors that the round can carry (a grouped call of metrics)
takes the same lane (express_many).

Callers run rounds and collectives on their own threads (the express lane, _drive_inline), so an
exception from outside the engine (Ctrl-C, a signal handler's) can land there, most likely while
they poll. The rule: what a caller leaves, the engine finishes, as every other rank does its
part. A round goes to the round waiter and its entries to the general path (_left_lane), a
transfer to the finisher (_left_transfer), and a wait gives its handle up (Handle.wait): the
handle's names free when it completes, and a new call of one of them waits for it (_orphan).
A caller that applies the peers' round messages itself (_read_peers) holds signals back while
it does (interrupts.py): a message read off its socket is always applied. Only a collective
interrupted inside its own steps, which cannot be resumed, fails the job on every rank, as a
transport error does.
"""
from .core import Engine
from .handles import Completion, Entry, Finished, own_device
from .windows import BLOCKING_POLL_S, DRIVE_WAIT_S, INLINE_POLL_BYTES, PEER_READ_S, \
    SHUT_DOWN_MESSAGE

__all__ = ["Engine", "Completion", "Entry", "Finished", "own_device", "BLOCKING_POLL_S",
           "DRIVE_WAIT_S", "INLINE_POLL_BYTES", "PEER_READ_S", "SHUT_DOWN_MESSAGE"]
