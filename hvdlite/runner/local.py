"""Starting a rank, on this machine or (through remote.py) over ssh.

Each rank gets its own session (and so its own process group), which lets the driver stop the
rank together with anything it started (data-loader workers, shells) with one `killpg`, and keeps
a terminal's Ctrl-C away from the ranks so that the driver decides how they stop. For a remote
rank the local process is the ssh client; the remote side stops the rank's group when the
client's stdin closes (see remote_exec.py), so `terminate` closes stdin instead of signalling.

`spawner_for` is the one place that picks between local and remote.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from typing import Callable, Mapping, Optional, Sequence

from hvdlite.runner.hosts import is_local_host
from hvdlite.runner.remote import SSHSpawner
from hvdlite.runner.ssh_settings import SSHSettings

# spawn(command, env) -> the started process (stdout/stderr piped)
Spawner = Callable[[Sequence[str], Mapping[str, str]], subprocess.Popen]


class LaunchError(RuntimeError):
    """A job that cannot be started as asked; the message is meant for the user."""



def spawn_local(command: Sequence[str], env: Mapping[str, str],
                pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start `command` in a new session, with piped stdout/stderr and no stdin; `pass_fds`
    stay open in it (rank 0's store socket)."""
    return subprocess.Popen(list(command), env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, close_fds=True, pass_fds=tuple(pass_fds))


def spawner_for(hostname: str, ssh: Optional[SSHSettings] = None) -> Spawner:
    """How to start a rank on `hostname`: directly when it is this machine, else over ssh."""
    if is_local_host(hostname):
        return spawn_local
    return SSHSpawner(hostname, ssh or SSHSettings())


def remote_host(proc: subprocess.Popen) -> Optional[str]:
    """The host a process started by an ssh spawner runs on (None for local ranks)."""
    return getattr(proc, "hvdlite_remote_host", None)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(proc: subprocess.Popen) -> None:
    """Ask a rank to stop: SIGTERM to its process group, or for a remote rank, close the ssh
    client's stdin (the remote side then SIGTERMs, and SIGKILLs after its grace period).
    A worker that is not a process of ours (hvdlite.ray's actors) stops itself: `hvdlite_stop`."""
    if hasattr(proc, "hvdlite_stop"):
        proc.hvdlite_stop(False)
        return
    if remote_host(proc) is not None and proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
        return
    _killpg(proc.pid, signal.SIGTERM)


def kill(proc: subprocess.Popen) -> None:
    """Stop a rank now. For a remote rank this kills the ssh client; the remote side sees the
    connection close and stops the rank itself."""
    if hasattr(proc, "hvdlite_stop"):
        proc.hvdlite_stop(True)
        return
    if remote_host(proc) is not None and proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    _killpg(proc.pid, signal.SIGKILL)


def find_command(program: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Path of `program` as the ranks' exec would find it (PATH of `env`), or None."""
    if os.sep in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    return shutil.which(program, path=path)
