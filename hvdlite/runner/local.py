"""Starting a rank on this machine.

Each rank gets its own session (and so its own process group), which lets the driver stop the
rank together with anything it started (data-loader workers, shells) with one `killpg`, and keeps
a terminal's Ctrl-C away from the ranks so that the driver decides how they stop.

A remote spawner (ssh) will sit beside `spawn_local` with the same signature; `spawner_for` is the
one place that picks between them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Callable, Mapping, Optional, Sequence

from hvdlite.runner.hosts import SlotInfo, is_local_host

Spawner = Callable[[SlotInfo, Sequence[str], Mapping[str, str]], subprocess.Popen]


class LaunchError(RuntimeError):
    """A job that cannot be started as asked; the message is meant for the user."""


def spawn_local(slot: SlotInfo, command: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
    """Start `command` for `slot` in a new session, with piped stdout/stderr and no stdin."""
    return subprocess.Popen(list(command), env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True)


def spawner_for(hostname: str) -> Spawner:
    """How to start a rank on `hostname`."""
    if is_local_host(hostname):
        return spawn_local
    raise LaunchError(f"remote hosts are not supported yet: {hostname}")


def find_command(program: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Path of `program` as the ranks' exec would find it (PATH of `env`), or None."""
    if os.sep in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    return shutil.which(program, path=path)
