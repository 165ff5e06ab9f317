"""Forwarding of each rank's stdout/stderr to the launcher's, one whole line at a time.

Lines are prefixed the way `horovodrun --gloo` does (`[3]<stdout>:`), so log scrapers written for
Horovod keep working, and a line from one rank is never interleaved with another's.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, BinaryIO, Optional, TextIO

_TIMESTAMP = "%a %b %d %H:%M:%S %Y"


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
            for line in iter(pipe.readline, b""):
                if file is not None:
                    try:
                        file.write(line)
                        file.flush()
                    except (OSError, ValueError):
                        pass
                if not line.endswith(b"\n"):
                    line += b"\n"  # a partial last line still ends the launcher's line
                head = (time.strftime(_TIMESTAMP).encode() + prefix) if self._timestamp else prefix
                self._console.write(which, head + line)
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
