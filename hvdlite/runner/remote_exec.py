"""What runs on a remote host for each rank that hvdlite-run starts over ssh (stdlib only).

The ssh command line carries nothing but `python -u -c "import sys;exec(sys.stdin.readline())"`:
this file's source arrives as the first line on stdin, then one JSON line with the rank's
command, working directory and environment (which holds the job secret, so it travels inside the
encrypted ssh channel and never appears in `ps` on either machine).

It then starts the command in its own session with stdout/stderr going straight back through ssh,
and watches stdin: when stdin closes (the driver asked the rank to stop, or the driver or the ssh
connection died) it stops the command's whole process group, SIGTERM first and SIGKILL after the
grace period, so nothing is left running on the remote host. Its exit status is the command's, or
128+N when the command died from signal N.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time


def _log(host, text):
    sys.stderr.write(f"hvdlite-run: host {host}: {text}\n")
    sys.stderr.flush()


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_group(pgid, grace, done):
    """SIGTERM the group, SIGKILL what is left after `grace` seconds (or when `done` is set and
    the group is empty)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main():
    config = json.loads(sys.stdin.readline())
    host = config.get("host", "?")
    grace = float(config.get("grace", 5))
    env = dict(os.environ)
    env.update(config["env"])
    cwd = config.get("cwd")
    if cwd:
        try:
            os.chdir(cwd)
        except OSError:
            pass  # like horovodrun: run from the home directory when the path does not exist
    command = config["command"]
    program = command[0]
    if os.sep in program:
        found = program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        _log(host, f"command {program!r} not found")
        sys.exit(127)
    try:
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    except OSError as exc:
        _log(host, f"cannot start {program!r}: {exc.strerror}")
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
    done = threading.Event()
    stopping = threading.Lock()

    def stop():
        if stopping.acquire(blocking=False):
            _stop_group(child.pid, grace, done)

    def watch_stdin():
        try:
            while sys.stdin.read(4096):
                pass
        except (OSError, ValueError):
            pass
        if not done.is_set():
            stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=stop, daemon=True).start())
    code = child.wait()
    done.set()
    # Whatever the command left behind in its group (data loaders, shells) goes with it.
    if _group_alive(child.pid):
        _stop_group(child.pid, min(grace, 2.0), done)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
