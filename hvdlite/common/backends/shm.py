"""Shared-memory data path for the ranks of a gloo communicator that share one host.

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
     result area; publish; wait for every peer;
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
from __future__ import annotations

import bisect
import logging
import mmap
import os
import platform
import queue
import secrets
import select
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch

from .. import config
from ..messages import MAX, MIN, PRODUCT, SUM

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
def header_bytes(size: int) -> int:
    """Token, then one counter per rank on its own cache line; pages, so slots stay aligned."""
    return (64 * (size + 1) + 4095) // 4096 * 4096
_FNS: dict[int, Callable] = {SUM: torch.add, MIN: torch.minimum, MAX: torch.maximum,
                             PRODUCT: torch.mul}
_REDUCIBLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64}
_RECHECK_S = 0.2                    # a select() never sleeps longer than this
_LIVENESS_S = 1.0                   # how often a long wait checks that peers are alive


def mode() -> str:
    """'on' or 'off' for this process: HVDLITE_SHM = auto (default) | 1 | 0."""
    choice = (config.env("SHM") or "auto").strip().lower()
    if choice in ("0", "off", "false", "no"):
        return "off"
    if choice in ("1", "on", "true", "yes"):
        return "on"
    if choice != "auto":
        raise ValueError(f"HVDLITE_SHM={choice!r}: use auto, 1 or 0")
    return "on" if platform.machine().lower() in ("x86_64", "amd64") else "off"


def slot_bytes() -> int:
    mb = config.env_float("SHM_SLOT_MB", 8.0)
    if mb <= 0:
        raise ValueError(f"HVDLITE_SHM_SLOT_MB={mb}: must be > 0")
    return max(4096, int(mb * 1024 * 1024) // 4096 * 4096)


class ShmError(RuntimeError):
    """A shared-memory collective could not finish (timeout, dead peer)."""


class _Work:
    """Pending shared-memory collective: `wait()` blocks until the channel's worker ran it."""

    def __init__(self, timeout_s: float):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._then: Optional[Callable[[], None]] = None

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        with self._lock:
            self._done.set()
            then, self._then = self._then, None
        if then is not None:
            then()

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the thread that completes this work (at once if it is complete).

        Why: the engine finishes the collective there (copies nothing more, completes the
        handles) instead of waking its finisher thread to do it: one thread wake-up less
        between the data landing and the caller seeing it."""
        with self._lock:
            if not self._done.is_set():
                self._then = fn
                return
        fn()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        # The worker bounds every phase by the timeout; the margin only guards against a bug.
        if not self._done.wait(self._timeout_s + 60.0):
            raise ShmError("shared-memory collective: the worker thread stopped answering")
        if self._error is not None:
            raise self._error


class ShmChannel:
    """The shared-memory data path of one communicator (see the module docstring).

    Collectives run in submission order on one worker thread per channel, as gloo runs them on
    its own threads, so collectives of different process sets never wait on each other.
    """

    def __init__(self, rank: int, size: int, timeout_s: float, slot: int, seg: mmap.mmap,
                 pids: dict[int, int], fifo_r: int, fifo_w: dict[int, int], own_w: int):
        self.rank, self.size, self.timeout_s, self.slot = rank, size, timeout_s, slot
        self._seg = seg
        self._pids = pids
        # Counters: int64 at byte 64 * (rank + 1) (byte 0 holds the token).
        self._ctr_all = np.ndarray((8 * (size + 1),), dtype=np.int64, buffer=seg)
        self._ctr = {r: self._ctr_all[8 * (r + 1):8 * (r + 1) + 1] for r in range(size)}
        self._slots = {r: torch.frombuffer(seg, dtype=torch.uint8, count=slot,
                                           offset=header_bytes(size) + r * slot) for r in range(size)}
        self._result = torch.frombuffer(seg, dtype=torch.uint8, count=slot,
                                        offset=header_bytes(size) + size * slot)
        self._fifo_r, self._fifo_w, self._own_w = fifo_r, fifo_w, own_w
        self._seq = 0
        self._end = 0                 # my counter after the last chunk's copy-out
        self._broken: Optional[BaseException] = None
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.ops = 0                  # collectives run, for tests and diagnostics

    # ------------------------------------------------------------------ public
    def handles(self, tensor: torch.Tensor, reduce: bool) -> bool:
        """Whether this path can run a collective on `tensor` (else the caller uses gloo)."""
        return (tensor.device.type == "cpu" and tensor.is_contiguous()
                and (not reduce or tensor.dtype in _REDUCIBLE))

    def allreduce(self, tensor: torch.Tensor, op: int) -> _Work:
        flat = tensor.view(-1)
        return self._submit(self._allreduce, [flat], [flat], _FNS[op], 1.0, 1.0)

    def allreduce_tensors(self, inputs: list, outputs: list, op: int, prescale: float,
                          postscale: float) -> _Work:
        """Allreduce `inputs` (all of one dtype) as one fused buffer into `outputs` (None:
        dropped), times prescale before and postscale after, without a fusion buffer."""
        return self._submit(self._allreduce,
                            [t.reshape(-1) for t in inputs],
                            [o.view(-1) if o is not None else None for o in outputs],
                            _FNS[op], prescale, postscale)

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int) -> _Work:
        return self._submit(self._reducescatter, output.view(-1), tensor.view(-1), _FNS[op])

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> _Work:
        return self._submit(self._allgather, output.view(-1), tensor.view(-1))

    def broadcast(self, tensor: torch.Tensor, root: int) -> _Work:
        return self._submit(self._broadcast, tensor.view(-1), root)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5.0)
            if thread.is_alive():
                # Still inside a wait (a peer died mid-collective): closing its FIFO could hand
                # the descriptor number to a new file that the worker would then read from.
                # Leave the descriptors and the mapping to the process; it raises on its own.
                log.debug("shared-memory worker still waiting at close; descriptors kept")
                return
        for fd in [self._fifo_r, self._own_w, *self._fifo_w.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fifo_w = {}
        self._slots.clear()
        self._ctr.clear()
        self._ctr_all = self._result = None
        try:
            self._seg.close()
        except (BufferError, ValueError):
            pass  # a tensor view still alive; the mapping goes with the process

    # ------------------------------------------------------------------ worker
    def _submit(self, fn, *args) -> _Work:
        work = _Work(self.timeout_s)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hvdlite-shm",
                                                daemon=True)
                self._thread.start()
        self._queue.put((work, fn, args))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fn, args = item
            if self._broken is not None:
                work._finish(self._broken)
            else:
                try:
                    fn(*args)
                    self.ops += 1
                    work._finish()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    # Counters are out of step once a phase failed: every later call fails
                    # alike.
                    self._broken = exc
                    work._finish(exc)
            # Unbind before waiting for the next collective: the arguments are views of the
            # caller's inputs and outputs. Left bound, the last collective of a step kept its
            # buffers referenced until the next step: the TensorFlow frontend could not reuse
            # its output buffers (it checks their reference count) and TensorFlow could not
            # reuse its gradients' memory, so every step faulted in fresh pages (~750 page
            # faults and ~8 ms of system time per step on the Keras benchmark's MLP).
            item = work = fn = args = None

    # ------------------------------------------------------------------ phases
    def _publish(self) -> int:
        self._seq += 1
        self._ctr[self.rank][0] = self._seq
        for fd in self._fifo_w.values():
            try:
                os.write(fd, b"\0")
            except (BlockingIOError, BrokenPipeError):
                pass  # a full FIFO already wakes its reader; a dead peer is found by the wait
        return self._seq

    def _wait(self, target: int, what: str) -> None:
        """Until every peer's counter reached `target` (bounded; see the module docstring)."""
        ctr = self._ctr
        lagging = [r for r in ctr if r != self.rank and ctr[r][0] < target]
        if not lagging:
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        liveness = start + _LIVENESS_S
        while lagging:
            ready, _, _ = select.select([self._fifo_r], [], [], _RECHECK_S)
            if ready:
                try:
                    os.read(self._fifo_r, 4096)
                except BlockingIOError:
                    pass
            lagging = [r for r in lagging if ctr[r][0] < target]
            now = time.monotonic()
            if lagging and now >= liveness:
                liveness = now + _LIVENESS_S
                dead = [r for r in lagging if self._pids[r] and not _alive(self._pids[r])]
                if dead:
                    raise ShmError(
                        f"shared-memory {what}: rank(s) {dead} (pid "
                        f"{[self._pids[r] for r in dead]}) exited while rank {self.rank} waited "
                        f"for them; see that rank's output for its error")
            if lagging and now >= deadline:
                raise ShmError(
                    f"shared-memory {what}: rank(s) {lagging} (pid "
                    f"{[self._pids[r] for r in lagging]}) did not arrive within "
                    f"{self.timeout_s:.0f} s; rank {self.rank} gave up (raise the transport "
                    f"timeout, HOROVOD_GLOO_TIMEOUT_SECONDS, if they are only slow)")

    def _begin_chunk(self, what: str) -> None:
        self._wait(self._end, what)   # peers finished the previous chunk

    def _end_chunk(self) -> None:
        self._end = self._publish()

    def _view(self, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slots[r][:nbytes].view(dtype)

    # ------------------------------------------------------------------ collectives
    def _allreduce(self, ins: list, outs: list, fn: Callable, pre: float, post: float) -> None:
        """Fused allreduce of the flat tensors `ins` into `outs` (see allreduce_tensors)."""
        counts = [t.numel() for t in ins]
        n, size, rank = sum(counts), self.size, self.rank
        if n == 0:
            return
        dtype = ins[0].dtype
        item = ins[0].element_size()
        per = max(size, self.slot // item)          # elements per chunk
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        for lo in range(0, n, per):
            m = min(per, n - lo)
            self._begin_chunk("allreduce")
            mine = self._view(rank, m * item, dtype)
            if m == n:
                torch.cat(ins, out=mine) if len(ins) > 1 else mine.copy_(ins[0])
            else:
                for i, a, b in _pieces(offsets, lo, lo + m):
                    mine[a - lo:b - lo].copy_(ins[i][a - offsets[i]:b - offsets[i]])
            _scale(mine, pre)
            self._wait(self._publish(), "allreduce (inputs)")
            a, b = rank * m // size, (rank + 1) * m // size
            if b > a:
                res = self._result[:m * item].view(dtype)[a:b]
                fn(self._view(0, m * item, dtype)[a:b], self._view(1, m * item, dtype)[a:b],
                   out=res)
                for r in range(2, size):
                    fn(res, self._view(r, m * item, dtype)[a:b], out=res)
            self._wait(self._publish(), "allreduce (reduction)")
            res = self._result[:m * item].view(dtype)
            for i, a, b in _pieces(offsets, lo, lo + m):
                if outs[i] is not None:
                    _copy_scaled(outs[i][a - offsets[i]:b - offsets[i]], res[a - lo:b - lo], post)
            self._end_chunk()

    def _reducescatter(self, output: torch.Tensor, flat: torch.Tensor, fn: Callable) -> None:
        size, rank = self.size, self.rank
        n = output.numel()
        if n == 0:
            return
        item = flat.element_size()
        parts = flat.view(size, n)
        per = max(1, self.slot // (item * size))    # elements per part per chunk
        for lo in range(0, n, per):
            m = min(per, n - lo)
            self._begin_chunk("reducescatter")
            self._view(rank, size * m * item, flat.dtype).view(size, m).copy_(parts[:, lo:lo + m])
            self._wait(self._publish(), "reducescatter (inputs)")
            out = output[lo:lo + m]
            first = True
            for r in [rank] + [r for r in range(size) if r != rank]:
                mine = self._view(r, size * m * item, flat.dtype).view(size, m)[rank]
                if first:
                    out.copy_(mine)
                    first = False
                else:
                    fn(out, mine, out=out)
            self._end_chunk()

    def _allgather(self, output: torch.Tensor, flat: torch.Tensor) -> None:
        n, size, rank = flat.numel(), self.size, self.rank
        if n == 0:
            return
        rows = output.view(size, n)
        for lo in range(0, n, self.slot):
            m = min(self.slot, n - lo)
            self._begin_chunk("allgather")
            self._slots[rank][:m].copy_(flat[lo:lo + m])
            self._wait(self._publish(), "allgather (inputs)")
            for r in range(size):
                rows[r, lo:lo + m].copy_(flat[lo:lo + m] if r == rank else self._slots[r][:m])
            self._end_chunk()

    def _broadcast(self, flat: torch.Tensor, root: int) -> None:
        n, rank = flat.numel(), self.rank
        for lo in range(0, n, self.slot):
            m = min(self.slot, n - lo)
            self._begin_chunk("broadcast")
            if rank == root:
                self._slots[rank][:m].copy_(flat[lo:lo + m])
            self._wait(self._publish(), "broadcast (root's data)")
            if rank != root:
                flat[lo:lo + m].copy_(self._slots[root][:m])
            self._end_chunk()


def _pieces(offsets: list[int], lo: int, hi: int):
    """(tensor index, start, end) of the parts of consecutive tensors (starting at `offsets`)
    that fall in the flat range [lo, hi)."""
    i = bisect.bisect_right(offsets, lo) - 1
    while i < len(offsets) - 1 and offsets[i] < hi:
        a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
        if b > a:
            yield i, a, b
        i += 1


def _scale(t: torch.Tensor, factor: float) -> None:
    """In place, truncating for integers as Horovod does (collectives.scale_'s rule)."""
    if factor == 1.0:
        return
    if t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_((t.to(torch.float64) * factor).to(t.dtype))


def _copy_scaled(dst: torch.Tensor, src: torch.Tensor, factor: float) -> None:
    """dst = src * factor in one pass for floats; src (shared) is never written."""
    if factor == 1.0:
        dst.copy_(src)
    elif dst.is_floating_point():
        torch.mul(src, factor, out=dst)
    else:
        dst.copy_(src)
        _scale(dst, factor)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _fit_slot(wanted: int, size: int) -> int:
    """The slot size that fits /dev/shm: at most a quarter of its free space for the whole
    segment (so several communicators and other programs fit beside it)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    free = st.f_bavail * st.f_frsize
    fit = (free // 4 - header_bytes(size)) // (size + 1) // 4096 * 4096
    return min(wanted, fit)


MIN_SLOT = 64 * 1024


def connect(store, rank: int, size: int, timeout_s: float,
            agree: Callable[[bool], bool]) -> Optional[ShmChannel]:
    """Collective over the communicator's ranks: a ShmChannel, or None on every rank when any
    rank cannot share memory with all the others (or HVDLITE_SHM=0).

    `store` is a c10d store private to this communicator; `agree(ok)` must return True only
    when `ok` is True on every rank (the caller runs one gloo allreduce). Every rank must call
    this, even with the path turned off, so the agreement pairs up.
    """
    wanted = mode() == "on" and size > 1
    base = os.path.join(SHM_DIR, f"hvdlite-{os.getpid()}-{secrets.token_hex(6)}")
    seg_path, fifo_path = base + ".seg", base + ".fifo"
    seg: Optional[mmap.mmap] = None
    fifo_r = -1
    pids: dict[int, int] = {}
    fifo_w: dict[int, int] = {}
    why = "" if wanted else "HVDLITE_SHM=0"
    slot = 0
    try:
        if rank == 0:
            entry = "-"
            if wanted:
                slot = _fit_slot(slot_bytes(), size)
                if slot < min(slot_bytes(), MIN_SLOT):
                    why = f"{SHM_DIR} is missing or nearly full"
                else:
                    try:
                        fd = os.open(seg_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                        try:
                            os.posix_fallocate(fd, 0, header_bytes(size) + (size + 1) * slot)
                            seg = mmap.mmap(fd, header_bytes(size) + (size + 1) * slot)
                        finally:
                            os.close(fd)
                        token = secrets.randbits(62)
                        np.ndarray((1,), dtype=np.int64, buffer=seg)[0] = token
                        entry = f"{seg_path}|{slot}|{token}"
                    except OSError as exc:
                        why = f"rank 0 could not create {seg_path} ({exc})"
            store.set("seg", entry)
        entry = store.get("seg").decode()
        if not why and entry == "-":
            why = "rank 0 has no shared-memory segment"
        if not why and wanted:
            try:
                if rank != 0:
                    path, slot_s, token_s = entry.split("|")
                    slot = int(slot_s)
                    fd = os.open(path, os.O_RDWR)
                    try:
                        seg = mmap.mmap(fd, header_bytes(size) + (size + 1) * slot)
                    finally:
                        os.close(fd)
                    if int(np.ndarray((1,), dtype=np.int64, buffer=seg)[0]) != int(token_s):
                        why = "the segment holds another token: another host?"
                if not why:
                    os.mkfifo(fifo_path, 0o600)
                    # Read end first (a writer's open fails until it exists); our own write end
                    # too, so the FIFO never reads EOF when peers close theirs.
                    fifo_r = os.open(fifo_path, os.O_RDONLY | os.O_NONBLOCK)
                    fifo_w[rank] = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)
            except (OSError, ValueError) as exc:
                why = f"rank {rank} cannot map rank 0's segment ({exc}): another host?"
        store.set(f"fifo/{rank}", "-" if why else f"{fifo_path}|{os.getpid()}|{_pid_ns()}")
        if not why:
            for r in range(size):
                if r == rank:
                    continue
                peer = store.get(f"fifo/{r}").decode()
                if peer == "-":
                    why = f"rank {r} cannot share memory"
                    break
                p_fifo, p_pid, p_ns = peer.split("|", 2)
                # A pid means something here only in the same pid namespace (containers may
                # share /dev/shm but not pids); 0 = cannot check, the timeout still bounds it.
                pids[r] = int(p_pid) if p_ns == _pid_ns() else 0
                try:
                    fifo_w[r] = os.open(p_fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as exc:
                    why = f"rank {r}'s FIFO is not reachable ({exc})"
                    break
        ok = agree(not why)
    finally:
        for path in (seg_path, fifo_path):    # everyone mapped (or gave up): nothing to leak
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if ok and not why:
        own_w = fifo_w.pop(rank)             # held open, never written: no EOF on our FIFO
        return ShmChannel(rank, size, timeout_s, slot, seg, pids, fifo_r, fifo_w, own_w)
    if wanted:
        log.info("shared-memory data path off for this communicator (%s); gloo carries it",
                 why or "another rank could not share memory with all the others")
    if seg is not None:
        try:
            seg.close()
        except (BufferError, ValueError):
            pass
    for f in [fifo_r, *fifo_w.values()]:
        if f >= 0:
            try:
                os.close(f)
            except OSError:
                pass
    return None
