"""hvdlite-run and hvdlite.runner.run, exercised through the real console script and real ranks."""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from hvdlite.runner import run
from hvdlite.runner.config_file import ConfigError, load_config
from hvdlite.runner.hosts import (HostError, HostSpec, assign_slots, is_local_host,
                                  parse_hostfile, parse_hosts)
from hvdlite.runner.launch import parse_args
from util import clean_env, env_reports

HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
SCRIPTS = Path(__file__).parent / "launcher_scripts"
PY = sys.executable


def launch(*args: object, env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([HVDLITE_RUN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=clean_env(env))


def launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("hvdlite-run:")]


def gone(pid: int, wait: float = 3.0) -> bool:
    """True when `pid` no longer runs (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# --------------------------------------------------------------------------- parsing, no ranks

@pytest.mark.timeout(30)
def test_every_horovodrun_flag_parses(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=4\n")
    # (Interfaces are checked against this machine's where every host is this one.)
    import hvdlite.runner.launch as launch_mod
    monkeypatch.setattr(launch_mod.socket, "if_nameindex",
                        lambda: [(1, "lo"), (2, "eth0"), (3, "eth1"), (4, "eth2")])
    args = parse_args([
        "-np", "2", "-hostfile", str(hostfile), "-p", "2222", "-i", "/tmp/key", "--gloo",
        "--network-interfaces", "eth0,eth1", "--network-interface", "eth2",
        "--network-interface", "eth0", "--start-timeout", "40", "--disable-cache",
        "--output-filename", "/tmp/out", "--verbose", "--fusion-threshold-mb", "32",
        "--cycle-time-ms", "2", "--cache-capacity", "10", "--no-hierarchical-allreduce",
        "--no-hierarchical-allgather", "--no-torus-allreduce", "--autotune", "--autotune-log-file",
        "/tmp/a.csv", "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "2",
        "--autotune-bayes-opt-max-samples", "3", "--autotune-gaussian-process-noise", "0.1",
        "--slots-per-host", "2", "--elastic-timeout", "60", "--reset-limit", "3",
        "--blacklist-cooldown-range", "10", "100", "--timeline-filename", "/tmp/t.json",
        "--no-timeline-mark-cycles", "--no-stall-check", "--stall-check-warning-time-seconds", "5",
        "--stall-check-shutdown-time-seconds", "10", "--no-mpi-threads-disable", "--mpi-args=-x A",
        "--tcp", "--num-nccl-streams", "1", "--gloo-timeout-seconds", "20", "--log-level", "debug",
        "--log-without-timestamp", "-prefix-timestamp", "python", "train.py", "--lr", "0.1"])
    assert args.command == ["python", "train.py", "--lr", "0.1"]
    assert args.nics == ["eth0", "eth1", "eth2"]
    assert args.cooldown_range == [10, 100] and args.log_level == "DEBUG"
    assert args.hierarchical_allreduce is False and args.hierarchical_allgather is False
    assert args.host_list == [HostSpec("localhost", 4)] and not args.elastic
    elastic = parse_args(["--min-np", "1", "--max-np", "4", "--host-discovery-script", "d.sh",
                          "--jsrun", "python", "x.py"])
    assert elastic.elastic and elastic.num_proc is None and elastic.use_jsrun
    assert parse_args(["--mpi", "-np", "1", "true"]).use_mpi


@pytest.mark.timeout(30)
def test_hosts_parsing_and_placement(tmp_path):
    assert parse_hosts("a:2,b:4, c") == [HostSpec("a", 2), HostSpec("b", 4), HostSpec("c", 1)]
    for bad in ("a:0", "a:x", "a:2,a:1", ""):
        with pytest.raises(HostError):
            parse_hosts(bad)
    hf = tmp_path / "hostfile"
    hf.write_text("# cluster\nnode1 slots=2\n\nnode2:3  # comment\nnode3\n")
    assert parse_hostfile(str(hf)) == [HostSpec("node1", 2), HostSpec("node2", 3),
                                       HostSpec("node3", 1)]
    hf.write_text("node1 slots=2\nnode2 slots=two\n")
    with pytest.raises(HostError, match=f"hostfile {re.escape(str(hf))} line 2"):
        parse_hostfile(str(hf))

    slots = assign_slots([HostSpec("a", 2), HostSpec("b", 2), HostSpec("c", 2)], 5)
    got = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
           for s in slots]
    assert got == [("a", 0, 0, 2, 0, 3), ("a", 1, 1, 2, 0, 2), ("b", 2, 0, 2, 1, 3),
                   ("b", 3, 1, 2, 1, 2), ("c", 4, 0, 1, 2, 3)]

    for name in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        assert is_local_host(name), name
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: documentation-only, never ours
    # Other loopback addresses count as separate hosts (reached over ssh): tests and demos run
    # "remote" hosts on this machine through an sshd listening there.
    assert not is_local_host("127.0.0.2") and not is_local_host("127.0.0.3")


@pytest.mark.timeout(30)
def test_yaml_config_with_anchors_and_lists(tmp_path):
    """Full YAML through PyYAML: anchors, aliases, merge keys, flow style and lists."""
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text(
        "x-defaults: &tuning   # ignored section that holds anchors\n"
        "  fusion_threshold_mb: 32\n"
        "  cycle_time_ms: &cycle 2.5\n"
        "x-hosts: [node1, node2]\n"
        "controller: gloo\n"
        "params:\n"
        "  <<: *tuning\n"
        "  cache_capacity: 64\n"
        "autotune: {enabled: false, warmup_samples: 4}\n"
        "timeline:\n"
        "  filename: '/tmp/a #1.json'\n")
    data = load_config(str(cfg))
    assert data["x-hosts"] == ["node1", "node2"]
    assert data["params"] == {"fusion_threshold_mb": 32, "cycle_time_ms": 2.5,
                              "cache_capacity": 64}
    args = parse_args(["-np", "1", "--cache-capacity", "8", "--config-file", str(cfg), "true"])
    assert (args.fusion_threshold_mb, args.cycle_time_ms, args.cache_capacity) == (32, 2.5, 8)
    assert args.autotune is False and args.autotune_warmup_samples == 4
    assert args.timeline_filename == "/tmp/a #1.json" and args.use_gloo
    cfg.write_text("params:\n  fusion_threshold_mb:\n    - 1\n    - 2\n")
    out = launch("-np", "1", "--config-file", cfg, "true", timeout=20)
    assert out.returncode == 2
    assert (f"config file {cfg}: params.fusion_threshold_mb (--fusion-threshold-mb): "
            "expected an integer, got [1, 2]") in out.stderr, out.stderr
    for bad in ("a: [1, 2\n", "params: *missing\n"):
        cfg.write_text(bad)
        with pytest.raises(ConfigError, match=re.escape(str(cfg))):
            load_config(str(cfg))


# --------------------------------------------------------------------------- CLI, no ranks

@pytest.mark.timeout(30)
def test_version():
    out = launch("--version", timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "hvdlite-run 0.1.0"
    out = launch("-v", timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "hvdlite-run 0.1.0"


@pytest.mark.timeout(30)
def test_check_build():
    out = launch("--check-build", timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("hvdlite v0.1.0:")
    for section in ("Available Frameworks:", "Available Controllers:",
                    "Available Tensor Operations:"):
        assert section in out.stdout
    assert "[X] PyTorch" in out.stdout and "[X] Gloo" in out.stdout
    assert re.search(r"\[[ X]\] TensorFlow", out.stdout) and re.search(r"\[[ X]\] NCCL", out.stdout)
    import torch  # the test may import it; the launcher reads versions from package metadata
    assert re.search(rf"PyTorch: +torch {re.escape(torch.__version__)}\n", out.stdout), out.stdout
    for name in ("TensorFlow", "MPI", "NCCL"):
        assert re.search(rf"\n    {name}: +\S", out.stdout), out.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    ("", "argument -np/--num-proc is required"),
    ("-np 2", "no command given"),
    ("-np 8 -H localhost:4 true", "-np 8 but the hosts give only 4 slots: localhost:4"),
    ("-np 1 --bogus-flag true", "unrecognized arguments: --bogus-flag"),
    ("-np two true", "argument -np/--num-proc: invalid int value: 'two'"),
    ("-np 0 true", "argument -np/--num-proc: must be >= 1"),
    ("-np 1 --fusion-threshold-mb -1 true", "argument --fusion-threshold-mb: must be >= 0"),
    ("-np 1 --cycle-time-ms fast true", "argument --cycle-time-ms: invalid float value"),
    ("-np 1 --log-level LOUD true", "argument --log-level: invalid choice"),
    ("-np 1 --blacklist-cooldown-range 10",
     "argument --blacklist-cooldown-range: expected 2 arguments"),
    ("-np 1 --hierarchical-allreduce --no-hierarchical-allreduce true",
     "not allowed with argument --hierarchical-allreduce"),
    ("-np 1 -H localhost:1 -hostfile x true", "not allowed with argument -H/--hosts"),
    ("--min-np 4 --max-np 2 true",
     "argument --min-np/--min-num-proc: 4 is larger than --max-np 2"),
    ("-np 1 -H localhost:0 true", "slots must be a positive integer"),
    ("-np 1 --start-timeout 0 true", "argument --start-timeout: must be >= 1"),
    ("-np 1 --network-interface bogus0 true",
     "argument --network-interfaces: this machine has no interface bogus0; it has "),
])
def test_usage_errors(args, message):
    out = launch(*args.split(), timeout=20)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "hvdlite-run: error:" in out.stderr and message in out.stderr, out.stderr


@pytest.mark.timeout(30)
def test_max_np_alone_leaves_a_job_fixed_size():
    """As horovodrun decides (its _is_elastic): --min-np or a discovery script make a job
    elastic, --max-np alone does not (`-np 2 --max-np 4` started 4 ranks); and horovodrun's
    hidden --no-log-hide-timestamp alias is taken."""
    args = parse_args(["-np", "2", "--max-np", "4", "--no-log-hide-timestamp", "true"])
    assert not args.elastic and [(h.name, h.slots) for h in args.host_list] == \
        [("localhost", 2)]
    assert args.log_with_timestamp is True
    assert parse_args(["-np", "2", "--min-np", "1", "--max-np", "4", "true"]).elastic


@pytest.mark.timeout(30)
def test_elastic_timeout_comes_from_horovods_variable_too():
    from hvdlite.runner.env_flags import elastic_timeout_s
    assert elastic_timeout_s(None, {}) == 600
    assert elastic_timeout_s(None, {"HOROVOD_ELASTIC_TIMEOUT": "7"}) == 7
    assert elastic_timeout_s(None, {"HOROVOD_ELASTIC_TIMEOUT": "7",
                                    "HVDLITE_ELASTIC_TIMEOUT": "9"}) == 9
    assert elastic_timeout_s(3, {"HOROVOD_ELASTIC_TIMEOUT": "7"}) == 3     # the flag wins


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    ("-np 1 --jsrun true", "hvdlite-run: --jsrun is not available yet"),
    ("-np 2 --mpi --min-np 1 true", "hvdlite-run: --mpi cannot run elastic jobs"),
    ("-np 1 --mpi -p 2222 --output-filename out true",
     "hvdlite-run: -p/--ssh-port, --output-filename cannot be used with --mpi: mpiexec starts "
     "the ranks (pass its own options with --mpi-args), or drop --mpi"),
])
def test_not_available_yet(args, message):
    out = launch(*args.split(), timeout=20)
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    ("--hierarchical-allgather", "argument --hierarchical-allgather: not supported by hvdlite"),
    ("--torus-allreduce", "argument --torus-allreduce: not supported by hvdlite; use "
                          "--hierarchical-allreduce"),
    ("--num-nccl-streams 2", "argument --num-nccl-streams: not supported by hvdlite"),
    ("--thread-affinity 0,1", "argument --thread-affinity: not supported by hvdlite"),
    ("--binding-args=-bind-to=core", "argument --binding-args: only applies to --mpi"),
])
def test_refused_flags(args, message):
    """horovodrun flags for parts hvdlite lacks are refused with one line, never ignored."""
    out = launch("-np", "1", *args.split(), "true", timeout=20)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert errors == [f"hvdlite-run: error: {message}"] or \
        (len(errors) == 1 and message in errors[0]), out.stderr


@pytest.mark.timeout(30)
def test_refused_flag_from_config_file(tmp_path):
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("params:\n  torus_allreduce: true\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["-np", "1", "--config-file", str(cfg), "true"])
    assert exc.value.code == 2


@pytest.mark.timeout(30)
def test_missing_command():
    out = launch("-np", "2", "no-such-command-hvdlite", timeout=20)
    assert out.returncode == 127
    assert "hvdlite-run: command 'no-such-command-hvdlite' not found" in out.stderr


@pytest.mark.timeout(30)
def test_bad_hostfile_and_config(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\nbad line here\n")
    out = launch("-np", "1", "-hostfile", hf, "true", timeout=20)
    assert out.returncode == 2 and f"hostfile {hf} line 2" in out.stderr, out.stderr
    hf.write_text("localhost slots=2\n127.0.0.1:1\n")
    out = launch("-np", "4", "-hostfile", hf, "true", timeout=20)
    assert out.returncode == 2
    assert "-np 4 but the hosts give only 3 slots: localhost:2,127.0.0.1:1" in out.stderr
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("params:\n  fusion_threshold: 3\n")
    out = launch("-np", "1", "--config-file", cfg, "true", timeout=20)
    assert out.returncode == 2 and "unknown key params.fusion_threshold" in out.stderr
    # A bad value in the file names the file and its key, not only a flag nobody typed.
    cfg.write_text("params:\n  fusion_threshold_mb: -3\nlogging:\n  level: loud\n")
    out = launch("-np", "1", "--config-file", cfg, "true", timeout=20)
    assert out.returncode == 2 and (f"config file {cfg}: params.fusion_threshold_mb "
                                    f"(--fusion-threshold-mb): must be >= 0, got -3"
                                    ) in out.stderr, out.stderr
    cfg.write_text("logging:\n  level: loud\n")
    out = launch("-np", "1", "--config-file", cfg, "true", timeout=20)
    assert out.returncode == 2 and f"config file {cfg}: logging.level (--log-level): " \
        "invalid choice 'loud'" in out.stderr, out.stderr
    out = launch("-np", "1", "--fusion-threshold-mb", "-3", "true", timeout=20)
    assert "argument --fusion-threshold-mb: must be >= 0, got -3" in out.stderr, out.stderr


# --------------------------------------------------------------------------- real ranks

@pytest.mark.timeout(60)
@pytest.mark.parametrize("store_on_driver", [False, True], ids=["rank0_serves", "driver_serves"])
def test_env_np2_and_store_reachable(store_on_driver):
    extra = {"HVDLITE_STORE_ON_DRIVER": "1"} if store_on_driver else {}
    out = launch("-np", "2", PY, SCRIPTS / "env_dump.py", "store",
                 env={"LAUNCHER_TEST_CALLER_VAR": "from-caller", **extra})
    assert out.returncode == 0, out.stderr
    reports = env_reports(out.stdout)
    assert sorted(reports) == [0, 1]
    port = reports[0]["HVDLITE_STORE_PORT"]
    for rank, env in reports.items():
        for prefix in ("HVDLITE_", "HOROVOD_"):
            assert env[prefix + "RANK"] == str(rank)
            assert env[prefix + "SIZE"] == "2"
            assert env[prefix + "LOCAL_RANK"] == str(rank)
            assert env[prefix + "LOCAL_SIZE"] == "2"
            assert env[prefix + "CROSS_RANK"] == "0"
            assert env[prefix + "CROSS_SIZE"] == "1"
            assert env[prefix + "HOSTNAME"] == "localhost"
        assert env["HVDLITE_STORE_ADDR"] == env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert env["HVDLITE_STORE_PORT"] == env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == port
        assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        assert env["HVDLITE_START_TIMEOUT"] == "30"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["LAUNCHER_TEST_CALLER_VAR"] == "from-caller"
        assert re.fullmatch(r"[0-9a-f]{64}", env["HVDLITE_SECRET"])
        assert "HOROVOD_GLOO_IFACE" not in env and "HVDLITE_FUSION_THRESHOLD" not in env
        assert env["peer_value"] == f"hello from {(rank + 1) % 2}"
        # rank 0 is local: it serves the store on the launcher's socket, unless asked not to
        assert ("HVDLITE_STORE_FD" in env) == (rank == 0 and not store_on_driver)
    assert reports[0]["HVDLITE_SECRET"] == reports[1]["HVDLITE_SECRET"]


@pytest.mark.timeout(60)
def test_env_np4_two_hosts_cross_ranks():
    out = launch("-np", "4", "-H", "localhost:2,127.0.0.1:2", "--network-interfaces", "lo",
                 "--start-timeout", "12", PY, SCRIPTS / "env_dump.py",
                 env={"HOROVOD_START_TIMEOUT": "99"})
    assert out.returncode == 0, out.stderr
    reports = env_reports(out.stdout)
    expected = {0: ("localhost", 0, 0), 1: ("localhost", 1, 0),
                2: ("127.0.0.1", 0, 1), 3: ("127.0.0.1", 1, 1)}
    for rank, (host, local_rank, cross_rank) in expected.items():
        env = reports[rank]
        for prefix in ("HVDLITE_", "HOROVOD_"):
            assert env[prefix + "RANK"] == str(rank) and env[prefix + "SIZE"] == "4"
            assert env[prefix + "HOSTNAME"] == host
            assert env[prefix + "LOCAL_RANK"] == str(local_rank)
            assert env[prefix + "LOCAL_SIZE"] == "2"
            assert env[prefix + "CROSS_RANK"] == str(cross_rank)
            assert env[prefix + "CROSS_SIZE"] == "2"
        assert env["HOROVOD_GLOO_IFACE"] == env["HVDLITE_GLOO_IFACE"] == "lo"
        assert env["HVDLITE_START_TIMEOUT"] == env["HOROVOD_START_TIMEOUT"] == "12"


@pytest.mark.timeout(60)
def test_tuning_flags_become_env():
    out = launch(
        "-np", "1", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--cache-capacity", "512", "--hierarchical-allreduce", "--no-hierarchical-allgather",
        "--no-torus-allreduce", "--autotune", "--autotune-log-file", "/tmp/at.csv",
        "--autotune-warmup-samples", "4", "--autotune-steps-per-sample", "11",
        "--autotune-bayes-opt-max-samples", "21", "--autotune-gaussian-process-noise", "0.5",
        "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles", "--no-stall-check",
        "--stall-check-warning-time-seconds", "7", "--stall-check-shutdown-time-seconds", "9",
        "--mpi-threads-disable", "--num-nccl-streams", "1",
        "--gloo-timeout-seconds", "45", "--tcp", "--log-level", "debug", "--log-without-timestamp",
        PY, SCRIPTS / "env_dump.py")
    assert out.returncode == 0, out.stderr
    env = env_reports(out.stdout)[0]
    expected = {
        "FUSION_THRESHOLD": "33554432", "CYCLE_TIME": "2.5", "CACHE_CAPACITY": "512",
        "HIERARCHICAL_ALLREDUCE": "1", "HIERARCHICAL_ALLGATHER": "0", "TORUS_ALLREDUCE": "0",
        "AUTOTUNE": "1", "AUTOTUNE_LOG": "/tmp/at.csv", "AUTOTUNE_WARMUP_SAMPLES": "4",
        "AUTOTUNE_STEPS_PER_SAMPLE": "11", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "21",
        "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5", "TIMELINE": "/tmp/tl.json",
        "TIMELINE_MARK_CYCLES": "1", "STALL_CHECK_DISABLE": "1", "STALL_CHECK_TIME_SECONDS": "7",
        "STALL_SHUTDOWN_TIME_SECONDS": "9", "MPI_THREADS_DISABLE": "1", "NUM_NCCL_STREAMS": "1",
        "GLOO_TIMEOUT_SECONDS": "45", "LOG_LEVEL": "DEBUG",
        "LOG_HIDE_TIME": "1",
    }
    for name, value in expected.items():
        assert env["HOROVOD_" + name] == value, name
        assert env["HVDLITE_" + name] == value, name
    assert env["NCCL_IB_DISABLE"] == "1"


@pytest.mark.timeout(60)
def test_config_file_with_command_line_override(tmp_path):
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("controller: gloo\nparams:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 3\n"
                   "timeline:\n  filename: /tmp/x.json\nstall_check:\n  enabled: false\n"
                   "logging:\n  level: info\n")
    out = launch("-np", "1", "--cycle-time-ms", "7", "--config-file", cfg,
                 PY, SCRIPTS / "env_dump.py")
    assert out.returncode == 0, out.stderr
    env = env_reports(out.stdout)[0]
    assert env["HVDLITE_FUSION_THRESHOLD"] == str(16 * 1024 * 1024)
    assert env["HVDLITE_CYCLE_TIME"] == env["HOROVOD_CYCLE_TIME"] == "7.0"
    assert env["HVDLITE_TIMELINE"] == "/tmp/x.json"
    assert env["HVDLITE_STALL_CHECK_DISABLE"] == "1" and env["HVDLITE_LOG_LEVEL"] == "INFO"


@pytest.mark.timeout(60)
def test_output_prefix_and_output_files(tmp_path):
    outdir = tmp_path / "logs"
    out = launch("-np", "2", "--output-filename", outdir, PY, SCRIPTS / "output.py")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        ordered = [f"[{rank}]<stdout>:out one {rank}", f"[{rank}]<stdout>:out two {rank}",
                   f"[{rank}]<stdout>:partial {rank}"]
        assert [line for line in lines if line.startswith(f"[{rank}]")] == ordered
        assert f"[{rank}]<stderr>:err one {rank}" in out.stderr.splitlines()
        assert (outdir / f"rank.{rank}" / "stdout").read_text() == \
            f"out one {rank}\nout two {rank}\npartial {rank}"
        assert (outdir / f"rank.{rank}" / "stderr").read_text() == f"err one {rank}\n"


@pytest.mark.timeout(60)
def test_prefix_output_with_timestamp():
    out = launch("-np", "1", "--prefix-output-with-timestamp", PY, SCRIPTS / "output.py")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    stamp = r"\w{3} \w{3} \d\d \d\d:\d\d:\d\d \d{4}"
    assert re.fullmatch(stamp + r"\[0\]<stdout>:out one 0", first), first


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others():
    start = time.monotonic()
    out = launch("-np", "3", PY, SCRIPTS / "fail.py", "1", "3", timeout=40)
    elapsed = time.monotonic() - start
    assert out.returncode == 3, out.stderr
    messages = launcher_lines(out.stderr)
    assert len(messages) == 1, out.stderr
    assert re.fullmatch(r"hvdlite-run: rank 1 \(host localhost, pid \d+\) exited with code 3",
                        messages[0])
    err = out.stderr.splitlines()
    assert err.index("[1]<stderr>:rank 1 failing") < err.index(messages[0])
    sleepers = [int(p) for p in re.findall(r"<stdout>:sleeper pid=(\d+)", out.stdout)]
    assert len(sleepers) == 2 and all(gone(p) for p in sleepers)
    assert elapsed < 20  # the sleepers (60 s) were stopped, not waited for


@pytest.mark.timeout(60)
def test_rank_killed_by_signal():
    out = launch("-np", "2", PY, SCRIPTS / "fail.py", "1", "kill", timeout=40)
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    messages = launcher_lines(out.stderr)
    assert len(messages) == 1
    assert re.fullmatch(r"hvdlite-run: rank 1 \(host localhost, pid \d+\) was killed by signal "
                        r"SIGKILL", messages[0])


def _start_hanging_job(np: int, *script_args: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([HVDLITE_RUN, "-np", str(np), PY, str(SCRIPTS / "hang.py"),
                             *script_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_env(), start_new_session=True)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    pids: list[int] = []
    deadline = time.monotonic() + 30
    while len(pids) < 2 * np:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        m = re.search(r"ready pid=(\d+) child=(\d+)", line)
        if m:
            pids += [int(m.group(1)), int(m.group(2))]
    return proc, pids


@pytest.mark.timeout(60)
def test_sigint_stops_all_ranks_and_children():
    proc, pids = _start_hanging_job(2, "ignore-term")  # rank 1 needs the SIGKILL escalation
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert 4 < time.monotonic() - start < 15  # grace period, then SIGKILL
        stderr = proc.stderr.read()
        assert "hvdlite-run: interrupted, stopped 2 ranks" in launcher_lines(stderr), stderr
        assert all(gone(p) for p in pids), [p for p in pids if not gone(p, 0)]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(60)
def test_sigterm_to_launcher():
    proc, pids = _start_hanging_job(2)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert "hvdlite-run: interrupted, stopped 2 ranks" in proc.stderr.read()
        assert all(gone(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()


# --------------------------------------------------------------------------- Python API

@pytest.mark.timeout(60)
def test_run_returns_values_in_rank_order():
    def work(x, scale=1):
        import os
        return int(os.environ["HVDLITE_RANK"]), x * scale

    assert run(work, args=(5,), kwargs={"scale": 2}, num_proc=2) == [(0, 10), (1, 10)]


@pytest.mark.timeout(60)
def test_run_propagates_a_rank_exception():
    def boom():
        import os
        import time
        if os.environ["HVDLITE_RANK"] == "1":
            raise ValueError("boom from rank 1")
        time.sleep(30)  # stopped by the driver once rank 1 fails

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run(boom, np=2)
    text = str(info.value)
    assert text.startswith("rank 1 raised an exception")
    assert "Traceback" in text and "ValueError: boom from rank 1" in text
    assert time.monotonic() - start < 20


@pytest.mark.timeout(30)
def test_run_rejects_bad_arguments():
    # The messages name run()'s parameters, not hvdlite-run's flags.
    with pytest.raises(ValueError, match="^num_proc: must be >= 1, got 0$"):
        run(print, num_proc=0)
    with pytest.raises(ValueError, match="^num_proc=2 but the hosts give only 1 slots"):
        run(print, num_proc=2, hosts="localhost:1")
    with pytest.raises(ValueError, match="^min_num_proc: 4 is larger than max_num_proc=2$"):
        run(print, min_num_proc=4, max_num_proc=2)
    with pytest.raises(ValueError, match="^host_discovery_script: not allowed with hosts$"):
        run(print, min_num_proc=1, hosts="localhost:1", host_discovery_script="x")
    with pytest.raises(ValueError, match=r"^cooldown_range: expected 0 <= MIN <= MAX"):
        run(print, min_num_proc=1, cooldown_range=[5, 2])
    with pytest.raises(ValueError, match="ssh_port cannot be used with use_mpi=True"):
        run(print, num_proc=1, use_mpi=True, ssh_port=22)
    with pytest.raises(ValueError, match="use_mpi cannot run elastic jobs"):
        run(print, min_num_proc=1, use_mpi=True)


@pytest.mark.timeout(90)
def test_progress_bar_updates_are_forwarded_live(tmp_path):
    """tqdm-style `\\r` updates reach the launcher's stdout while the rank still runs, each with
    the rank prefix, instead of being held back until the bar's final newline."""
    proc = subprocess.Popen([HVDLITE_RUN, "-np", "1", PY, SCRIPTS / "progress_bar.py", tmp_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env())
    seen = b""
    try:
        for i in range(3):
            want = f"[0]<stdout>:progress {i}/3\r".encode()
            deadline = time.monotonic() + 30
            while want not in seen:
                assert time.monotonic() < deadline, f"update {i} not forwarded live: {seen!r}"
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"launcher closed stdout early: {seen!r}"
                seen += chunk
            assert proc.poll() is None  # the rank is still waiting for this acknowledgement
            (tmp_path / f"ack{i}").write_text("")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen += out
    assert proc.returncode == 0, err
    assert seen.endswith(b"[0]<stdout>:progress 3/3\n"), seen


@pytest.mark.timeout(90)
def test_rank0_whose_store_socket_was_closed_says_so_and_store_on_driver_runs_it():
    """A wrapper between the launcher and rank 0 that closes inherited descriptors takes the
    store's socket away from rank 0: rank 0's init() names the descriptor, the cause and both
    fixes, and the job fails at once. HVDLITE_STORE_ON_DRIVER=1 runs the same command."""
    worker = ("import hvdlite.torch as hvd; hvd.init(); "
              "print('JOINED', hvd.rank(), hvd.size(), flush=True); hvd.shutdown()")
    wrapper = ("import os, sys\n"
               "fd = os.environ.get('HVDLITE_STORE_FD')\n"
               "if fd is not None:\n"
               "    os.close(int(fd))\n"
               "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])\n")
    env = {"HVDLITE_START_TIMEOUT": "20",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = launch("-np", "2", PY, "-c", wrapper, worker, env=env, timeout=80)
    assert out.returncode != 0
    assert "HVDLITE_STORE_FD=" in out.stderr and "is not an open socket in this process" in \
        out.stderr, out.stderr[-3000:]
    assert "HVDLITE_STORE_ON_DRIVER=1" in out.stderr
    assert "could not serve the rendezvous store" not in out.stderr  # no timeout, no address
    assert "hvdlite-run: rank 0" in out.stderr, out.stderr[-3000:]
    out = launch("-np", "2", PY, "-c", wrapper, worker,
                 env={**env, "HVDLITE_STORE_ON_DRIVER": "1"}, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "JOINED 0 2" in out.stdout and "JOINED 1 2" in out.stdout


@pytest.mark.timeout(90)
def test_rank0_stuck_before_init_ends_in_a_clear_timeout_on_the_other_ranks():
    """Rank 0 serves the store from init(); stuck before it, the other ranks' connections sit in
    the socket's backlog, where torch's client waits with no timeout of its own. hvdlite bounds
    that wait: rank 1 fails after HVDLITE_START_TIMEOUT naming the store, rank 0 and the fix,
    and the launcher stops the job."""
    worker = ("import os, time\n"
              "if os.environ['HVDLITE_RANK'] == '0':\n"
              "    time.sleep(60)\n"
              "import hvdlite.torch as hvd\n"
              "hvd.init()\n")
    t0 = time.monotonic()
    out = launch("-np", "2", PY, "-c", worker,
                 env={"HVDLITE_START_TIMEOUT": "4",
                      "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}, timeout=80)
    took = time.monotonic() - t0
    assert out.returncode != 0
    assert "rank 1 could not reach the rendezvous store at 127.0.0.1:" in out.stderr, \
        out.stderr[-3000:]
    assert "no answer from the store at 127.0.0.1:" in out.stderr and "within 4 s" in out.stderr
    assert "rank 0 serves the store from its init()" in out.stderr
    assert "hvdlite-run: rank 1" in out.stderr
    assert took < 40, took  # not rank 0's 60 s sleep: the job ended on rank 1's timeout


# ------------------------------------------------------------------ the driver's own store
@pytest.mark.timeout(60)
def test_driver_store_starts_in_the_background_behind_an_open_socket():
    """Rendezvous(background=True) listens at once; serve() (called once the first ranks are
    started) imports torch and starts the store in a thread: a client that connects before
    the store runs waits in the socket's backlog, and the store then serves it, as the
    elastic driver's workers (and a remote rank 0) do."""
    import datetime

    from torch.distributed import TCPStore

    from hvdlite.common.rendezvous import reach_store
    from hvdlite.runner.driver import Rendezvous

    rdv = Rendezvous(["localhost"], 30, background=True)
    with socket.create_connection(("127.0.0.1", rdv.port), timeout=5):
        pass                                    # listening before the store's start
    rdv.serve()
    client = reach_store(TCPStore, "127.0.0.1", rdv.port, datetime.timedelta(seconds=30))
    client.set("from-a-worker", b"hello")
    assert rdv.store.get("from-a-worker") == b"hello"
    assert rdv.start_problem() is None
    rdv.put_signed("k", b"v")
    assert rdv.get_signed("k") == b"v"


def _failing_store_start(monkeypatch):
    from hvdlite.runner import driver

    def refuse(*args, **kwargs):
        raise RuntimeError("no store here")
    monkeypatch.setattr(driver, "serve_store_on", refuse)


@pytest.mark.timeout(60)
def test_a_store_that_cannot_start_stops_a_fixed_job_with_its_reason(monkeypatch, capfd):
    """Where the driver serves the store, a failed start stops the ranks and names the cause,
    instead of leaving them to wait for it until their start timeout."""
    from hvdlite.runner.driver import JobSpec, Rendezvous, run_job
    from hvdlite.runner.local import LaunchError

    _failing_store_start(monkeypatch)
    rdv = Rendezvous(["localhost"], 30, background=True)
    start = time.monotonic()
    spec = JobSpec(command=[PY, "-c", "import time; time.sleep(60)"],
                   slots=assign_slots([HostSpec("localhost", 2)], 2), env=clean_env())
    result = run_job(spec, rdv)
    assert result.exit_code == 1
    assert time.monotonic() - start < 20
    err = capfd.readouterr().err
    assert "hvdlite-run: the job's store could not start: RuntimeError('no store here')" in err
    with pytest.raises(LaunchError, match="the job's store could not start"):
        rdv.store


@pytest.mark.timeout(60)
def test_a_store_that_cannot_start_stops_an_elastic_job_with_its_reason(monkeypatch, capfd):
    from hvdlite.runner.discovery import FixedHosts
    from hvdlite.runner.elastic_driver import ElasticSpec, run_elastic

    _failing_store_start(monkeypatch)
    start = time.monotonic()
    spec = ElasticSpec(command=[PY, "-c", "import time; time.sleep(60)"], env=clean_env(),
                       discovery=FixedHosts([HostSpec("localhost", 2)]), num_proc=2, min_np=2,
                       max_np=2)
    result = run_elastic(spec)
    assert result.exit_code == 1
    assert result.message == "the job's store could not start: RuntimeError('no store here')"
    assert time.monotonic() - start < 20
    assert "hvdlite-run: the job's store could not start" in capfd.readouterr().err
