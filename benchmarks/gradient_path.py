"""Which hvdlite files one gradient crosses, from the torch hook to the transport call.

Run on 2 ranks: `hvdlite-run -np 2 python benchmarks/gradient_path.py`. A profile hook is set
on every thread before `init()` (so the engine's and the coordinator's threads carry it too) and
records only during one `loss.backward(); opt.step()` after a warm-up step; rank 0 prints the
hvdlite files whose functions ran, in first-seen order, with the threads that ran them. The
docs/concepts.md ("One gradient, file by file") follows this path.
"""
from __future__ import annotations

import os
import sys
import threading

import torch

import hvdlite.torch as hvd

PKG = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(hvd.__file__)))) + os.sep
_recording = False
_seen: dict[str, set] = {}
_lock = threading.Lock()


def _profile(frame, event, arg):
    if not _recording or event != "call":
        return
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(PKG + "hvdlite" + os.sep):
        rel = path[len(PKG):]
        with _lock:
            _seen.setdefault(rel, set()).add(threading.current_thread().name)


def main() -> None:
    global _recording
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(8, 4)

    def step():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    step()      # warm-up: communicators, response cache
    hvd.barrier()
    _recording = True
    step()
    _recording = False
    hvd.barrier()
    if hvd.rank() == 0:
        print(f"FILES {len(_seen)}")
        for f in _seen:
            print(f"  {f}  [{', '.join(sorted(_seen[f]))}]")
        threads = sorted({t for ts in _seen.values() for t in ts})
        print(f"THREADS {len(threads)}: {threads}")
    sys.setprofile(None)
    threading.setprofile(None)
    hvd.shutdown()


if __name__ == "__main__":
    main()
