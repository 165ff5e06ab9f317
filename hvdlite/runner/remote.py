"""Starting ranks on other hosts over OpenSSH.

The ssh command line holds only the ssh options, the host and a one-line Python bootstrap; the
rank's command, working directory and environment (with the job secret) go through ssh's stdin,
inside the encrypted channel (see remote_exec.py). Remote hosts need the same Python at the same
path as the launching machine (set HVDLITE_REMOTE_PYTHON otherwise; `python3` on the remote PATH
is the fallback) with hvdlite installed, as horovodrun needs the same environment everywhere.

Options: `-p/--ssh-port` and `-i/--ssh-identity-file` as in horovodrun; HVDLITE_SSH_ARGS adds
ssh options placed before hvdlite's own (ssh keeps the first value it reads, so they win), e.g.
`HVDLITE_SSH_ARGS="-o StrictHostKeyChecking=no"`.
"""
from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Mapping, Optional, Sequence

from hvdlite.common.config import raw as env_raw
from hvdlite.runner.ssh_settings import SSHSettings

SSH_ARGS_ENV = "HVDLITE_SSH_ARGS"
REMOTE_PYTHON_ENV = "HVDLITE_REMOTE_PYTHON"
REMOTE_GRACE_S = 5.0

# Variables that describe this machine or this login session, not the job: a remote rank gets
# its own host's values for these.
_LOCAL_ONLY = re.compile(
    r"^(HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|HOME|USER|LOGNAME|MAIL|SHELL|TERM|TERMCAP|COLUMNS|LINES|"
    r"DISPLAY|XAUTHORITY|LS_COLORS|TMUX|TMUX_PANE|STY|WINDOW|PS1|PS2|PROMPT_COMMAND|"
    r"SSH_.*|XDG_.*|DBUS_.*|BASH_FUNC_.*|KRB5CCNAME)$")

_BOOTSTRAP_CMD = "import sys;exec(sys.stdin.readline())"


def _bootstrap_line() -> str:
    source = Path(__file__).with_name("remote_exec.py").read_bytes()
    packed = base64.b64encode(zlib.compress(source, 9)).decode()
    return f"import base64,zlib;exec(zlib.decompress(base64.b64decode('{packed}')))\n"


def ssh_command(host: str, settings: SSHSettings) -> list[str]:
    """`ssh <options> host`, ready for a remote command."""
    cmd = ["ssh", *shlex.split(env_raw(SSH_ARGS_ENV, "")),
           "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
           "-o", f"ConnectTimeout={max(1, int(settings.connect_timeout))}",
           "-o", "LogLevel=ERROR", "-o", "ServerAliveInterval=10", "-T", "-x"]
    if settings.port:
        cmd += ["-p", str(settings.port)]
    if settings.identity_file:
        cmd += ["-i", settings.identity_file]
    return cmd + [host]


def remote_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a rank's environment that travels to its remote host."""
    return {k: v for k, v in env.items() if not _LOCAL_ONLY.match(k)}


def remote_python() -> str:
    return env_raw(REMOTE_PYTHON_ENV) or sys.executable


class SSHSpawner:
    """Starts a rank on `host` through ssh; the returned Popen is the local ssh client."""

    def __init__(self, host: str, settings: SSHSettings) -> None:
        self.host = host
        self.settings = settings

    def __call__(self, command: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        python = shlex.quote(remote_python())
        remote = (f"P={python}; [ -x \"$P\" ] || P=python3; "
                  f"exec \"$P\" -u -c {shlex.quote(_BOOTSTRAP_CMD)}")
        proc = subprocess.Popen(ssh_command(self.host, self.settings) + [remote],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        config = {"host": self.host, "command": list(command), "cwd": os.getcwd(),
                  "env": remote_env(env), "grace": REMOTE_GRACE_S}
        try:
            proc.stdin.write(_bootstrap_line().encode())
            proc.stdin.write((json.dumps(config) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            pass  # ssh already failed; its exit status and stderr tell why
        proc.hvdlite_remote_host = self.host  # type: ignore[attr-defined]
        return proc


def describe_ssh_failure(host: str, settings: SSHSettings, code: Optional[int],
                         stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    port = f" port {settings.port}" if settings.port else ""
    if code is None:
        why = f"no answer within {settings.connect_timeout} s"
    else:
        why = lines[-1] if lines else f"ssh exited with code {code}"
    return f"cannot reach host {host} over ssh{port}: {why}"


def check_reachable(hosts: Sequence[str], settings: SSHSettings) -> list[str]:
    """Run `ssh host true` on every host in parallel; the error messages of those that fail."""
    timeout = settings.connect_timeout + 10

    def probe(host: str) -> Optional[str]:
        try:
            out = subprocess.run(ssh_command(host, settings) + ["true"], capture_output=True,
                                 text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return describe_ssh_failure(host, settings, None, "")
        except OSError as exc:
            return f"cannot run ssh to reach host {host}: {exc.strerror}"
        if out.returncode != 0:
            return describe_ssh_failure(host, settings, out.returncode, out.stderr)
        return None

    if not hosts:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return [msg for msg in pool.map(probe, hosts) if msg]
