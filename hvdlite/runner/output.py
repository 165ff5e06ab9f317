"""Forwarding of each rank's stdout/stderr to the launcher's, one whole line at a time.

Lines are prefixed the way `horovodrun --gloo` does (`[3]<stdout>:`), so log scrapers written for
Horovod keep working, and a line from one rank is never interleaved with another's. A segment that
ends in a carriage return (a tqdm progress-bar update) counts as a line too and is forwarded as
soon as it arrives, prefix and `\r` included, as horovodrun does, so bars move live.
"""
from __future__ import annotations

import os
import select
import sys
import threading
import time
from typing import IO, BinaryIO, Optional, TextIO

_TIMESTAMP = "%a %b %d %H:%M:%S %Y"
_IDLE_S = 0.1  # a progress-bar update with nothing after it for this long is shown as it is


def _split(data: bytes) -> Optional[int]:
    """Length of the first forwarded unit in `data`: text up to and including a newline or a
    carriage return (\\r\\n stays whole), or None while no unit is complete. A trailing \\r
    waits for the next byte, which may be its \\n."""
    n, r = data.find(b"\n"), data.find(b"\r")
    if r < 0 or (0 <= n < r):
        return None if n < 0 else n + 1
    if r + 1 == len(data):
        return None
    return r + 2 if data[r + 1:r + 2] == b"\n" else r + 1


class Console:
    """The launcher's own stdout/stderr, shared by all reader threads under one lock."""

    def __init__(self, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> None:
        self._streams = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self._lock = threading.Lock()

    def write(self, which: str, data: bytes) -> None:
        stream = self._streams[which]
        with self._lock:
            try:
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    stream.flush()  # keep order with text already written to the stream
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # our reader went away (e.g. `| head`): keep draining so ranks never block

    def message(self, text: str) -> None:
        """A launcher message on stderr, never torn by rank output."""
        self.write("stderr", (text.rstrip("\n") + "\n").encode("utf-8", "replace"))


def rank_dir_name(rank: int, size: int) -> str:
    """`rank.<N>`, zero-padded like horovodrun so directories sort in rank order."""
    return f"rank.{rank:0{len(str(max(size - 1, 0)))}d}"


class RankOutput:
    """Two reader threads (stdout, stderr) for one rank, plus optional per-rank files."""

    def __init__(self, rank: int, size: int, stdout: BinaryIO, stderr: BinaryIO, console: Console,
                 output_dir: Optional[str] = None, timestamp: bool = False,
                 label: Optional[str] = None, dir_name: Optional[str] = None) -> None:
        """`label` replaces the rank in the line prefix and `dir_name` the `rank.<N>` directory
        (elastic workers, whose rank changes, are labelled by host and slot); files are appended
        to when `dir_name` is given, so a restarted worker keeps its earlier output."""
        self.rank = rank
        self.label = label if label is not None else str(rank)
        self._console = console
        self._timestamp = timestamp
        self._files: list[IO[bytes]] = []
        self._threads: list[threading.Thread] = []
        for which, pipe in (("stdout", stdout), ("stderr", stderr)):
            file = None
            if output_dir:
                directory = os.path.join(output_dir, dir_name or rank_dir_name(rank, size))
                os.makedirs(directory, exist_ok=True)
                file = open(os.path.join(directory, which), "ab" if dir_name else "wb")
                self._files.append(file)
            t = threading.Thread(target=self._pump, args=(which, pipe, file),
                                 name=f"hvdlite-output-{rank}-{which}", daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, which: str, pipe: BinaryIO, file: Optional[IO[bytes]]) -> None:
        prefix = f"[{self.label}]<{which}>:".encode()
        try:
            fd: Optional[int] = pipe.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        pending = b""
        after_cr = False      # the last terminator was a bare \r: we are inside a progress bar
        open_bar = False      # an update was flushed on idle and its line is still open

        def emit(segment: bytes) -> None:
            nonlocal open_bar
            if segment == b"\n" and open_bar:
                head = b""    # the bar's closing newline: no empty prefixed line
            else:
                head = (time.strftime(_TIMESTAMP).encode() + prefix) if self._timestamp \
                    else prefix
            open_bar = False
            self._console.write(which, head + segment)

        try:
            while True:
                if fd is not None:
                    if pending and (after_cr or pending.endswith(b"\r")) and \
                            not select.select([fd], [], [], _IDLE_S)[0]:
                        # A bar update with nothing after it yet: show it now, not one update late.
                        if pending != b"\r":
                            emit(pending if pending.endswith(b"\r") else pending + b"\r")
                            open_bar = True
                        pending, after_cr = b"", True
                        continue
                    chunk = os.read(fd, 65536)
                else:
                    chunk = pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536)
                if not chunk:
                    break
                if file is not None:
                    try:
                        file.write(chunk)
                        file.flush()
                    except (OSError, ValueError):
                        pass
                pending += chunk
                while pending:
                    cut = _split(pending)
                    if cut is None:
                        break
                    segment, pending = pending[:cut], pending[cut:]
                    after_cr = segment.endswith(b"\r")
                    if segment != b"\r":  # a bare \r (tqdm starts each update so) has no text
                        emit(segment)
            if pending:
                emit(pending.rstrip(b"\r") + b"\n")  # a partial last line still ends ours
        except (OSError, ValueError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def join(self, timeout: float) -> bool:
        """Wait until both streams reached EOF (all lines forwarded); False on timeout."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        done = not any(t.is_alive() for t in self._threads)
        if done:
            self.close_files()
        return done

    def close_files(self) -> None:
        for f in self._files:
            try:
                f.close()
            except OSError:
                pass
