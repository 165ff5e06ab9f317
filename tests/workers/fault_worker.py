"""Worker for tests/test_faults.py: a hung rank, a divergence, a straggler.

    fault_worker.py sigstop     the highest rank stops itself (SIGSTOP) after 5 steps
    fault_worker.py diverge     rank 0 allreduces 'grad.a', rank 1 allgathers 'ids.b'
    fault_worker.py straggler   rank 1 sleeps FAULT_SLEEP s before each step's allreduce
    fault_worker.py until FILE  allreduce steps until FILE exists (a live job for the channel test)
    fault_worker.py peer_replay rank 0 plays an attacker who knows the job secret's traffic but
                                not a fresh nonce: it opens rank 1's steady-state listener with
                                a bad greeting, a genuine connection, that connection's bytes
                                replayed, and frames signed with the bare job key; the job goes on

Each step's allreduce is checked against the value every rank computes locally.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

import hvdlite.torch as hvd


def step(i: int) -> None:
    t = torch.full((4,), float(hvd.rank() + i))
    out = hvd.allreduce(t, name="grad.w", op=hvd.Sum)
    expected = float(sum(range(hvd.size())) + hvd.size() * i)
    assert torch.equal(out, torch.full((4,), expected)), (out, expected)


def attack_peer_listener(target: int) -> None:
    """Connections to rank `target`'s steady-state listener that it must refuse (and one it
    must accept), each closed at once; rank `target` logs every refusal."""
    import socket

    from hvdlite.common import basics, rendezvous
    from hvdlite.common.protocol import Msg
    from hvdlite.common.wire import Channel

    engine = basics._require().engine
    _, addr, port, nonce = engine.peer_addrs[target]

    def send(raw: bytes) -> None:
        with socket.create_connection((addr, port), timeout=10) as s:
            s.sendall(raw)
            time.sleep(0.2)

    def frames(key: bytes, prefix: bytes) -> bytes:
        """What a Channel keyed with `key` writes after `prefix`: one hello frame."""
        with socket.create_server(("127.0.0.1", 0)) as server:
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
        with a, b:
            Channel(a, key).send((Msg.PEER_HELLO, 0))
            return prefix + b.recv(65536)

    send(b"GET / HTTP/1.0\r\n\r\n")                                   # not hvdlite
    client_nonce = os.urandom(rendezvous.PEER_NONCE)
    head = rendezvous.PEER_MAGIC + client_nonce
    genuine = frames(rendezvous.peer_session_key(engine.key, bytes.fromhex(nonce),
                                                 client_nonce), head)
    send(genuine)                                                          # accepted
    send(genuine)                                                          # replayed
    send(frames(engine.key, rendezvous.PEER_MAGIC + os.urandom(rendezvous.PEER_NONCE)))
    print("ATTACKED", flush=True)


def main() -> int:
    mode = sys.argv[1]
    hvd.init()
    if mode == "sigstop":
        for i in range(1000):
            step(i)
            if i == 5 and hvd.rank() == hvd.size() - 1:
                os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "diverge":
        step(0)
        if hvd.rank() == 0:
            hvd.allreduce(torch.ones(3), name="grad.a")
        else:
            hvd.allgather(torch.ones(2, dtype=torch.int64), name="ids.b")
    elif mode == "straggler":
        for i in range(int(os.environ.get("FAULT_STEPS", "25"))):
            if hvd.rank() == 1:
                time.sleep(float(os.environ.get("FAULT_SLEEP", "0.1")))
            step(i)
    elif mode == "until":
        # Train until the file argv[2] exists (decided together, by a collective), bounded.
        # After the first step every rank has joined: say so with a file per rank.
        for i in range(600):
            step(i)
            if i == 0:
                with open(f"{sys.argv[2]}.started.{hvd.rank()}", "w") as f:
                    f.write("ok")
            flag = torch.tensor([1.0 if os.path.exists(sys.argv[2]) else 0.0])
            if hvd.allreduce(flag, name="release", op=hvd.Max).item() > 0:
                break
            time.sleep(0.1)
    elif mode == "peer_replay":
        for i in range(5):
            step(i)              # the steady state is on: ranks talk to each other directly
        if hvd.rank() == 0:
            attack_peer_listener(1)
        hvd.barrier()
        for i in range(5, 15):
            step(i)
    print(f"DONE rank {hvd.rank()}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
