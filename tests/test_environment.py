"""The environment table (hvdlite/common/environment.py): every row, the precedence between
them, the conflicts it refuses, and SLURM's host-list syntax. Pure functions of a mapping: the
real launchers are exercised in test_slurm.py, test_kubernetes.py and test_env_start.py."""
import pytest

from hvdlite.common import environment as envtab
from hvdlite.common.environment import DetectionError, detect
from hvdlite.common.hostlist import HostlistError, expand_counts, expand_hostlist

# What `srun -N2 -n4` gives task 3 (copied from a real slurmd's task, trimmed).
SRUN_TASK3 = {
    "SLURM_JOB_ID": "17", "SLURM_JOBID": "17", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "hvd[1-2]", "SLURM_JOB_NODELIST": "hvd[1-2]", "SLURMD_NODENAME": "hvd2",
}
# The batch script of `sbatch -n4`: the allocation's variables, no step.
BATCH_SCRIPT = {"SLURM_JOB_ID": "18", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "hvd[1-2]"}
TORCHRUN_RANK1 = {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "WORLD_SIZE": "4",
                  "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                  "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
HVDLITE_RANK1 = {"HVDLITE_RANK": "1", "HVDLITE_SIZE": "2", "HVDLITE_LOCAL_RANK": "1",
                 "HVDLITE_LOCAL_SIZE": "2", "HVDLITE_HOSTNAME": "a",
                 "HVDLITE_STORE_ADDR": "127.0.0.1", "HVDLITE_STORE_PORT": "4000"}


def test_every_row_has_a_test():
    """The rows below are the table; a new row needs a case here."""
    assert [r.name for r in envtab.TABLE] == [
        "hvdlite-run (elastic)", "hvdlite-run", "Horovod's variables", "Open MPI",
        "MPICH/Hydra (PMI)", "MVAPICH", "PMIx", "torchrun", "SLURM (srun)",
        "RANK/WORLD_SIZE (torch env://)", "Kubeflow Trainer (PET_*)", "Ray worker"]


def test_nothing_set_is_one_rank():
    found = detect({"PATH": "/usr/bin"})
    assert (found.source, found.rank, found.size, found.store_host) == \
        ("single process", 0, 1, None)


def test_hvdlite_elastic_worker():
    found = detect({"HVDLITE_ELASTIC_WORKER": "a:0", "HVDLITE_DRIVER_ADDR": "x",
                    "HVDLITE_HOSTNAME": "a", **SRUN_TASK3})
    assert found.elastic and found.rank is None and found.node == "a"


def test_hvdlite_run_and_ray():
    found = detect(HVDLITE_RANK1)
    assert (found.source, found.rank, found.size, found.local_rank, found.local_size,
            found.node, found.store_host, found.store_port, found.store_is_master) == \
        ("hvdlite-run", 1, 2, 1, 2, "a", "127.0.0.1", 4000, False)
    assert detect({**HVDLITE_RANK1, "RAY_RAYLET_PID": "9"}).source == "hvdlite.ray"
    rank0 = detect({**HVDLITE_RANK1, "HVDLITE_RANK": "0", "HVDLITE_STORE_FD": "5"})
    assert rank0.store_is_master and rank0.store_fd == 5
    with pytest.raises(DetectionError, match="HVDLITE_STORE_PORT not"):
        detect({k: v for k, v in HVDLITE_RANK1.items() if k != "HVDLITE_STORE_PORT"})


def test_horovod_variables():
    env = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "3", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "h",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": "77"}
    found = detect(env)
    assert (found.rank, found.size, found.store_host, found.store_port, found.store_is_master,
            found.launcher) == (0, 3, "h", 77, True, False)
    with pytest.raises(DetectionError, match="HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        detect({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"})
    assert detect({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}).size == 1


@pytest.mark.parametrize("env,source,want", [
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "Open MPI",
     (2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     "MPICH/Hydra (PMI)", (1, 2, 1, 2)),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"}, "MVAPICH", (1, 2, None, None)),
    ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-x"}, "PMIx", (3, None, None, None)),
])
def test_mpi_launchers(env, source, want):
    found = detect(env)
    assert found.source == source and found.over_mpi and found.launcher
    assert (found.rank, found.size, found.local_rank, found.local_size) == want


def test_mpi_launcher_rank_before_mpi_init():
    assert envtab.mpi_launcher_rank({"PMI_RANK": "1", "PMI_SIZE": "2"}) == 1
    assert envtab.mpi_launcher_rank({"OMPI_COMM_WORLD_RANK": "3"}) == 3
    assert envtab.mpi_launcher_rank({**HVDLITE_RANK1}) is None


def test_mpirun_inside_a_slurm_allocation_is_mpirun():
    """mpirun starts its daemons with srun: its ranks inherit the daemons' step (one task per
    node). Those are not the rank's coordinates."""
    env = {**SRUN_TASK3, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
           "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    found = detect(env)
    assert (found.source, found.rank, found.size) == ("Open MPI", 3, 4)


def test_srun_pmi_variables_are_slurms_task():
    """srun --mpi=pmi2/pmix sets PMI_RANK/PMIX_RANK in each task: the SLURM row describes it."""
    found = detect({**SRUN_TASK3, "PMIX_RANK": "3", "PMI_RANK": "3", "PMI_SIZE": "4",
                    "SLURM_MPI_TYPE": "pmix"})
    assert (found.source, found.rank, found.size) == ("SLURM (srun)", 3, 4)
    # mpiexec inside a one-task step: its rank 0 has the step's PROCID, not its size.
    task = {**SRUN_TASK3, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    found = detect({**task, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert (found.source, found.rank, found.size) == ("MPICH/Hydra (PMI)", 0, 2)


def test_torchrun():
    found = detect(TORCHRUN_RANK1)
    assert (found.source, found.rank, found.size, found.local_rank, found.local_size,
            found.store_host, found.store_port, found.store_is_master) == \
        ("torchrun", 1, 4, 1, 2, "10.0.0.1", 29500, False)
    rank0 = detect({**TORCHRUN_RANK1, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not rank0.store_is_master      # torchrun's agent serves the store


def test_torchrun_started_by_srun_is_torchrun():
    """`srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node=2`: SLURM's variables describe
    the torchrun process (rank = node), torchrun's describe this one."""
    env = {**SRUN_TASK3, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", **TORCHRUN_RANK1}
    assert detect(env).source == "torchrun"


def test_slurm_task():
    found = detect(SRUN_TASK3)
    assert (found.source, found.rank, found.size, found.local_rank, found.local_size,
            found.node, found.store_host, found.store_is_master) == \
        ("SLURM (srun)", 3, 4, 1, 2, "hvd2", "hvd1", False)
    assert found.store_port == envtab.slurm_port("17", "0")
    assert envtab.SLURM_PORT_BASE <= found.store_port < \
        envtab.SLURM_PORT_BASE + envtab.SLURM_PORT_SPAN
    assert envtab.slurm_port("17", "1") != found.store_port   # two steps of one job at once
    given = detect({**SRUN_TASK3, "HVDLITE_STORE_PORT": "31000", "HVDLITE_STORE_ADDR": "h"})
    assert (given.store_host, given.store_port) == ("h", 31000)
    rank0 = detect({**SRUN_TASK3, "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                    "SLURM_NODEID": "0", "SLURMD_NODENAME": "hvd1"})
    assert rank0.store_is_master and rank0.local_size == 2
    # Task 0 placed on another node than the step's first (--distribution=arbitrary).
    with pytest.raises(DetectionError, match="task 0 runs on hvd2, not on the step's first"):
        detect({**SRUN_TASK3, "SLURM_PROCID": "0"})


def test_slurm_batch_script_of_many_tasks_refuses_to_run_alone():
    """`sbatch -n4` running `python train.py` without srun: nobody else will join."""
    with pytest.raises(DetectionError, match=r"not started by srun.*srun python"):
        detect(BATCH_SCRIPT)
    assert detect({**BATCH_SCRIPT, "SLURM_NTASKS": "1"}).size == 1


def test_hand_set_torch_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "5"}
    found = detect(env)
    assert (found.source, found.rank, found.size, found.store_host, found.launcher) == \
        ("RANK/WORLD_SIZE (torch env://)", 1, 2, "m", False)
    with pytest.raises(DetectionError, match="MASTER_ADDR/MASTER_PORT"):
        detect({"RANK": "1", "WORLD_SIZE": "2"})


def test_world_size_that_counts_nodes_is_refused():
    """Kubeflow's PyTorchJob: RANK = pod, WORLD_SIZE = pods; with several processes per pod
    and no torchrun, that WORLD_SIZE counts nodes, not ranks."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "5",
           "PET_NPROC_PER_NODE": "4"}
    with pytest.raises(DetectionError, match="describe nodes, not processes"):
        detect(env)


def test_kubeflow_trainer_without_torchrun():
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}
    found = detect(env)
    assert (found.source, found.rank, found.size, found.store_host, found.store_port) == \
        ("Kubeflow Trainer (PET_*)", 1, 2, "job-node-0-0.job", 29400)
    with pytest.raises(DetectionError, match="not started by torchrun"):
        detect({**env, "PET_NPROC_PER_NODE": "2"})
    # Under torchrun (what the torch runtime runs) the PET_* are torchrun's input, not ours.
    assert detect({**env, "PET_NPROC_PER_NODE": "2", **TORCHRUN_RANK1}).source == "torchrun"


def test_ray_worker_without_hvdlite_ray_is_one_rank():
    found = detect({"RAY_RAYLET_PID": "12"})
    assert (found.source, found.size) == ("Ray worker (not started by hvdlite.ray)", 1)


def test_conflicting_pair_names_both():
    """srun -n 4 with WORLD_SIZE=2 exported by the batch script (the node count): one line
    naming both environments and their variables."""
    env = {**SRUN_TASK3, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "5"}
    with pytest.raises(DetectionError) as info:
        detect(env)
    text = str(info.value)
    assert "\n" not in text
    assert "SLURM (srun) says rank 3 of 4" in text and "SLURM_PROCID=3" in text
    assert "RANK/WORLD_SIZE (torch env://) says rank 1 of 2" in text and "WORLD_SIZE=2" in text
    # Agreeing variables are fine.
    agree = {**SRUN_TASK3, "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "m",
             "MASTER_PORT": "5"}
    assert detect(agree).source == "SLURM (srun)"


def test_launcher_wins_over_what_it_inherited():
    """hvdlite-run inside a Kubeflow pod (RANK/WORLD_SIZE of the pod) or an srun task."""
    env = {**HVDLITE_RANK1, "RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "m",
           "MASTER_PORT": "5", **SRUN_TASK3}
    assert detect(env).source == "hvdlite-run"


@pytest.mark.parametrize("text,want", [
    ("hvd[1-2]", ["hvd1", "hvd2"]),
    ("node07", ["node07"]),
    ("a,b,c", ["a", "b", "c"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("n[1,3-4],login", ["n1", "n3", "n4", "login"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[9-10]-ib", ["x9-ib", "x10-ib"]),
    ("a[1-2],b[1-2]", ["a1", "a2", "b1", "b2"]),
])
def test_hostlist_expansion(text, want):
    assert expand_hostlist(text) == want


@pytest.mark.parametrize("bad", ["n[1-2", "n]1", "n[a-b]", "n[3-1]", ""])
def test_hostlist_errors(bad):
    with pytest.raises(HostlistError):
        expand_hostlist(bad)


def test_counts():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(HostlistError):
        expand_counts("2(3)")
