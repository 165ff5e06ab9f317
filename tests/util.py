"""Run a worker script under the real `hvdlite-run`, the way users start jobs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without inherited HVDLITE_*/HOROVOD_* settings (a job a test
    starts sees only what the test sets), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env.update(extra or {})
    return env


def env_reports(stdout: str) -> dict[int, dict[str, str]]:
    """Each rank's `ENV {...}` line (launcher_scripts/env_dump.py), by rank."""
    reports = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[(\d+)\]<stdout>:ENV (.*)", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    return reports


def hvdlite_run(script: str | os.PathLike, np: int = 2, args: list[str] | None = None,
                env: dict | None = None, timeout: float = 120, launcher_args: list[str] | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """Run `python script args...` on `np` ranks; return the completed launcher process.

    With check=True a non-zero exit fails the test and shows the whole output.
    """
    path = Path(script)
    if not path.is_absolute():
        path = WORKERS / path
    # Without the console script (hvdlite on PYTHONPATH, not installed: a GPU box's own Python),
    # `python -m hvdlite.runner` is the same command.
    launcher = [HVDLITE_RUN] if os.path.exists(HVDLITE_RUN) else \
        [sys.executable, "-m", "hvdlite.runner"]
    cmd = [*launcher, "-np", str(np), *(launcher_args or []), sys.executable, str(path),
           *(args or [])]
    full_env = dict(os.environ)
    full_env.setdefault("HVDLITE_START_TIMEOUT", "60")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        err = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else (exc.stderr or "")
        raise AssertionError(f"hvdlite-run timed out after {timeout} s: {' '.join(cmd)}\n"
                             f"--- stdout\n{out}\n--- stderr\n{err}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"hvdlite-run exited {proc.returncode}: {' '.join(cmd)}\n"
                             f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def rank_lines(output: str, rank: int) -> list[str]:
    """The lines rank `rank` printed, without the launcher's prefix."""
    prefix = f"[{rank}]<stdout>:"
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(script: str | os.PathLike, np: int = 2, args: list[str] | None = None,
                env: dict | None = None, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Start ranks without the launcher, through Horovod's environment variables, so a test can
    watch every rank's own exit (the launcher would stop the others when one fails)."""
    path = Path(script)
    if not path.is_absolute():
        path = WORKERS / path
    port = free_port()
    procs = []
    for r in range(np):
        e = clean_env()
        e.update({"HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(np),
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                  "HVDLITE_START_TIMEOUT": "60",
                  "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(path), *(args or [])], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"rank {r} of {path.name} did not finish within {timeout} s")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


class Run:
    """One worker launch, split by rank, judged by the harness's result protocol
    (tests/workers/harness.py: `CHECK <name> OK|FAIL` lines, then `FINISHED`).

    `check_exit=True` fails at once when the launcher exits non-zero (the whole output shown);
    False keeps the output so each check can be judged on its own."""

    def __init__(self, script: str, np: int = 2, args=None, env=None, timeout: float = 150,
                 check_exit: bool = True, detail_lines: int = 30, launcher_args=None):
        import pytest  # noqa: F401  (fail early if run outside pytest)
        self.script, self.np = script, np
        proc = hvdlite_run(script, np=np, args=args, env=env, timeout=timeout, check=check_exit,
                           launcher_args=launcher_args)
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.output = proc.stdout + "\n--- stderr\n" + proc.stderr
        self.lines = {r: rank_lines(proc.stdout, r) for r in range(np)}
        self.detail_lines = detail_lines

    def check(self, name: str) -> None:
        """Every rank ran check `name` and reported OK."""
        import pytest
        problems = []
        for r, lines in self.lines.items():
            mine = [i for i, line in enumerate(lines) if line.startswith(f"CHECK {name} ")]
            if not mine:
                problems.append(f"rank {r}: no result for check {name!r}")
                continue
            i = mine[-1]
            if not lines[i].startswith(f"CHECK {name} OK"):
                detail = [lines[i]] + [line for line in lines[i + 1:i + self.detail_lines]
                                       if line.startswith("  |")]
                problems.append(f"rank {r}:\n" + "\n".join(detail))
        if problems:
            tail = "" if all("no result" not in p for p in problems) else \
                "\n--- end of the output\n" + self.output[-5000:]
            pytest.fail(f"{self.script} -np {self.np}: check {name!r} failed\n"
                        + "\n".join(problems) + tail, pytrace=False)

    def finished(self) -> None:
        """Every rank got to the end of the script, and the launcher exited cleanly."""
        import pytest
        missing = [r for r, lines in self.lines.items()
                   if not any(line.startswith("FINISHED ") for line in lines)]
        if missing or self.returncode != 0:
            pytest.fail(f"{self.script} -np {self.np}: exit code {self.returncode}, ranks "
                        f"{missing} did not finish\n{self.output[-8000:]}", pytrace=False)

    def tagged(self, rank: int, tag: str) -> list[str]:
        """What rank `rank` printed after `tag ` (extra results a worker reports)."""
        return [x[len(tag) + 1:] for x in self.lines[rank] if x.startswith(tag + " ")]
