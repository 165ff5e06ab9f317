"""Kubernetes' two ways of running a job, reproduced on this machine (no cluster here).

- Kubeflow Trainer's torch runtime gives every node's pod PET_NNODES, PET_NPROC_PER_NODE,
  PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT (and its command is usually torchrun,
  which reads them). Each "pod" here is a process in its own UTS namespace, with its own host
  name as a pod has, started with exactly those variables.
- The MPI runtime (MPIJob) mounts `/etc/mpi/hostfile` (`<pod> slots=N` lines) and sets
  OMPI_MCA_orte_default_hostfile in the launcher pod, which reaches the workers over ssh: here
  the workers are 127.0.0.2/127.0.0.3 behind the private sshd of test_multihost.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from test_multihost import REMOTE_A, REMOTE_B, sshd  # noqa: F401  (the fixture)
from util import HVDLITE_RUN, ROOT, WORKERS, clean_env, free_port

pytestmark = pytest.mark.timeout(240)


def _pod_env(extra: dict) -> dict:
    env = clean_env({"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                     "HVDLITE_START_TIMEOUT": "90", **extra})
    for name in list(env):   # the test's own launcher, if any, is not the pod's
        inherited = name.startswith(("SLURM_", "PET_", "OMPI_", "PMI_", "PMIX_",
                                     "TORCHELASTIC_")) or \
            name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        if inherited and name not in extra:
            env.pop(name)
    return env


def _pods(command: list, nnodes: int, nproc: str, timeout: float = 200) -> list:
    """Start `nnodes` pods of a Trainer torch runtime job; each runs `command` under its own host
    name (job-node-0-<i>), with the runtime's PET_* variables. Returns each pod's result."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to give each pod its own host name")
    port = free_port()
    procs = []
    for i in range(nnodes):
        env = _pod_env({"PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": nproc,
                        "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": "127.0.0.1",
                        "PET_MASTER_PORT": str(port)})
        argv = ["unshare", "--uts", "sh", "-c", f'hostname "job-node-0-{i}" && exec "$@"', "sh",
                *command]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=str(ROOT)))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a pod did not finish within {timeout} s") from None
        results.append((p.returncode, out, err))
    return results


def test_trainer_torch_runtime_with_torchrun():
    """The runtime's usual command, `torchrun train.py`: torchrun takes PET_* as its own
    flags, and hvdlite takes its ranks from torchrun; two pods of one rank each."""
    results = _pods([sys.executable, "-m", "torch.distributed.run", str(WORKERS / "env_start.py")],
                    nnodes=2, nproc="1")
    for i, (code, out, err) in enumerate(results):
        assert code == 0, out + err
        assert f"OK rank={i} size=2 local=0/1" in out, out + err


def test_trainer_torch_runtime_without_torchrun():
    """A TrainJob whose command is `python train.py` (numProcPerNode 1): the PET_* row."""
    results = _pods([sys.executable, str(WORKERS / "env_start.py")], nnodes=2, nproc="1")
    for i, (code, out, err) in enumerate(results):
        assert code == 0, out + err
        assert f"OK rank={i} size=2 local=0/1" in out, out + err


def test_trainer_several_processes_per_pod_need_torchrun():
    """numProcPerNode 2 but the command is python itself: one clear error, not a job of one."""
    results = _pods([sys.executable, str(WORKERS / "env_start.py")], nnodes=1, nproc="2",
                    timeout=120)
    code, out, err = results[0]
    assert code != 0 and "OK rank" not in out, out + err
    assert "PET_NPROC_PER_NODE=2" in err and "torchrun" in err, err


def _mpijob_hostfile(tmp_path, slots: int = 1):
    # What the MPI runtime writes: one `<pod> slots=N` line per worker.
    path = tmp_path / "hostfile"
    path.write_text(f"{REMOTE_A} slots={slots}\n{REMOTE_B} slots={slots}\n")
    return path


def _launcher_env(sshd, extra: dict) -> dict:  # noqa: F811
    return _pod_env({**sshd.env(), **extra})


def test_mpijob_hostfile_from_the_runtimes_variable(sshd, tmp_path):  # noqa: F811
    """In the launcher pod, `hvdlite-run -np 2 python train.py` with no host flag: the hosts come
    from OMPI_MCA_orte_default_hostfile, the ranks start over ssh on the two workers."""
    hostfile = _mpijob_hostfile(tmp_path)
    env = _launcher_env(sshd, {"OMPI_MCA_orte_default_hostfile": str(hostfile),
                               "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                               "OMPI_MCA_orte_keep_fqdn_hostnames": "true"})
    base = [HVDLITE_RUN, "-np", "2", *sshd.flags()]
    plan = subprocess.run([*base, "--dry-run", sys.executable, "train.py"], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert plan.returncode == 0, plan.stderr
    assert f"environment: hostfile {hostfile} (OMPI_MCA_orte_default_hostfile)" in plan.stdout
    assert f"ranks per host: {REMOTE_A}: 1 (rank 0), {REMOTE_B}: 1 (rank 1)" in plan.stdout
    proc = subprocess.run([*base, sys.executable, str(WORKERS / "env_start.py")],
                          capture_output=True, text=True, env=env, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[0]<stdout>:OK rank=0 size=2 local=0/1" in proc.stdout, proc.stdout
    assert "[1]<stdout>:OK rank=1 size=2 local=0/1" in proc.stdout, proc.stdout


def test_mpijob_hostfile_flag(tmp_path):
    """`--hostfile /etc/mpi/hostfile` reads the runtime's `host slots=N`, and horovodrun's
    `host:N` still works: the plan shows the same placement for both."""
    runtime = tmp_path / "mpi-hostfile"
    runtime.write_text("job-node-0-0.job.default.svc slots=2\njob-node-0-1.job.default.svc "
                       "slots=2\n")
    openmpi = tmp_path / "openmpi-hostfile"   # Open MPI's own form, max_slots included
    openmpi.write_text("# workers\njob-node-0-0.job.default.svc slots=2 max_slots=4\n"
                       "job-node-0-1.job.default.svc slots=2\n")
    horovod = tmp_path / "horovod-hostfile"
    horovod.write_text("job-node-0-0.job.default.svc:2\njob-node-0-1.job.default.svc:2\n")
    for path in (runtime, openmpi, horovod):
        proc = subprocess.run([HVDLITE_RUN, "-np", "3", "--hostfile", str(path), "--dry-run",
                               "python", "train.py"], capture_output=True, text=True,
                              env=_pod_env({}), timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "hosts: job-node-0-0.job.default.svc:2, job-node-0-1.job.default.svc:2" in \
            proc.stdout
        assert "ranks per host: job-node-0-0.job.default.svc: 2 (rank 0-1), " \
               "job-node-0-1.job.default.svc: 1 (rank 2)" in proc.stdout


def test_example_manifests_start_what_these_tests_start():
    """examples/kubernetes: the TrainJob's command is torchrun (the first test's path), the
    MPIJob's launcher runs hvdlite-run on the runtime's hostfile (the MPIJob tests' path)."""
    yaml = pytest.importorskip("yaml")
    here = ROOT / "examples" / "kubernetes"
    trainjob = yaml.safe_load((here / "trainjob-torch.yaml").read_text())
    assert trainjob["kind"] == "TrainJob"
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert trainjob["spec"]["trainer"]["command"][0] == "torchrun"
    mpijob = yaml.safe_load((here / "mpijob.yaml").read_text())
    launcher = mpijob["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    command = launcher["command"]
    assert command[0] == "hvdlite-run"
    assert command[command.index("--hostfile") + 1] == "/etc/mpi/hostfile"
    np = int(command[command.index("-np") + 1])
    assert np == mpijob["spec"]["slotsPerWorker"] * \
        mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
