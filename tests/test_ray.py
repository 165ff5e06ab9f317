"""hvdlite.ray on a real multi-node Ray cluster on this machine.

`ray.cluster_utils.Cluster` starts a head and worker nodes as separate raylets (real processes,
nothing mocked). Custom resources steer the workers: node A has `w: 2`, node B `w: 1`, so a job
asking for `w: 1` per worker lands 2 + 1 over the two nodes. Tests that remove nodes add their
own. One cluster serves the whole module: Ray's start-up is the slow part.

Without Ray these tests skip; HVDLITE_REQUIRE_RAY=1 (set by .ci/run) makes that a failure.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def _require_ray():
    try:
        import ray  # noqa: F401
        import ray.cluster_utils  # noqa: F401
        return ray
    except ImportError as exc:
        reason = f"Ray is not installed ({exc}); pip install 'hvdlite[ray]'"
        if os.environ.get("HVDLITE_REQUIRE_RAY") == "1":
            pytest.fail(f"{reason} (HVDLITE_REQUIRE_RAY=1)", pytrace=False)
        pytest.skip(f"{reason}, or set HVDLITE_REQUIRE_RAY=1 to make this a failure",
                    allow_module_level=True)


ray = _require_ray()
sys.path.insert(0, str(WORKERS))
import ray_jobs  # noqa: E402

import torch  # noqa: E402

MB = 1 << 20
NODE = dict(object_store_memory=80 * MB)
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # The raylets start the workers with this environment: they import this tree's hvdlite and
    # the test functions (tests/workers) by reference.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(WORKERS)] + ([saved] if saved
                                                                             else []))
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, **NODE,
        # notice a removed node within ~3 s rather than Ray's default ~15 s
        _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3}))
    try:
        a = c.add_node(num_cpus=2, resources={"w": 2, "lost": 1}, **NODE)
        b = c.add_node(num_cpus=2, resources={"w": 1}, **NODE)
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield SimpleNamespace(cluster=c, a=a, b=b)
    finally:
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def settings(**kw):
    from hvdlite.ray import RayExecutor

    kw.setdefault("timeout_s", 60)
    kw.setdefault("placement_group_timeout_s", 60)
    return RayExecutor.create_settings(**kw)


def check_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(torch.tensor(got[k]), torch.tensor(want[k]), rtol=1e-5,
                                   atol=1e-6, msg=k)


def check_collectives(res: list[dict], nodes: list[str]) -> None:
    n = len(res)
    assert [r["rank"] for r in res] == list(range(n)), "results are not in rank order"
    assert [r["env_rank"] for r in res] == list(range(n))
    assert [r["node"] for r in res] == nodes
    for r in res:
        assert r["size"] == n
        assert r["sum"] == [float(sum(range(1, n + 1))), float(2 * sum(range(n)))]
        assert r["avg"] == [sum(range(n)) / n]
        assert r["gathered"] == [[float(k)] * 2 for k in range(n) for _ in range(k + 1)]
        assert r["bcast"] == [float(n - 1 + 10)]
        assert r["objs"] == [{"rank": k, "node": nodes[k]} for k in range(n)]
    # coordinates from the nodes: ranks contiguous per node, as hvdlite-run assigns them
    by_node: dict[str, list[int]] = {}
    for r in res:
        by_node.setdefault(r["node"], []).append(r["rank"])
    order = list(by_node)
    for r in res:
        members = by_node[r["node"]]
        assert r["local_rank"] == members.index(r["rank"])
        assert r["local_size"] == len(members)
        peers = [h for h in order if len(by_node[h]) > r["local_rank"]]
        assert (r["cross_rank"], r["cross_size"]) == (peers.index(r["node"]), len(peers))
    assert len({r["pid"] for r in res}) == n


def test_two_workers_on_two_nodes(cluster):
    from hvdlite.ray import RayExecutor

    ex = RayExecutor(settings(), num_hosts=2, num_workers_per_host=1,
                     resources_per_worker={"w": 1})
    ex.start(executable_cls=dict, executable_kwargs={"tag": "x"})
    try:
        res = ex.run(ray_jobs.coordinates)
        nodes = [r["node"] for r in res]
        assert set(nodes) == {cluster.a.node_id, cluster.b.node_id}
        check_collectives(res, nodes)
        weights = ex.run(ray_jobs.train, args=[4])
        check_close(weights[0], ray_jobs.reference(4))
        assert weights[1] == weights[0]
        assert ex.execute(lambda e: e["tag"]) == ["x", "x"]
        assert ex.execute_single(lambda e: os.environ["HVDLITE_RANK"]) == "0"
        refs = ex.run_remote(lambda k: int(os.environ["HVDLITE_RANK"]) * k, args=[3])
        assert ray.get(refs) == [0, 3]
    finally:
        ex.shutdown()


def test_three_workers_on_two_nodes_and_a_failing_rank(cluster):
    from hvdlite.ray import RayExecutor

    ex = RayExecutor(settings(), num_workers=3, resources_per_worker={"w": 1})
    ex.start()
    actors = list(ex.workers)
    try:
        res = ex.run(ray_jobs.coordinates)
        check_collectives(res, [cluster.a.node_id, cluster.a.node_id, cluster.b.node_id])
        weights = ex.run(ray_jobs.train, kwargs={"steps": 4})
        for w in weights:
            check_close(w, ray_jobs.reference(4))
        # Bad input: fn raises on rank 2 while the others wait in a collective.
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="bad input on purpose at rank 2") as info:
            ex.run(ray_jobs.fail_on, args=[2])
        assert time.monotonic() - t0 < 30
        note = "\n".join(getattr(info.value, "__notes__", []))
        assert f"rank 2 on node {cluster.b.node_id}" in note, note
        assert "every worker of the job was stopped" in note
        assert ex.workers == []
        for actor in actors:  # every actor ended
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.node_info.remote(), timeout=30)
    finally:
        ex.shutdown()


def test_more_workers_than_the_cluster_can_place(cluster):
    from hvdlite.ray import RayExecutor

    ex = RayExecutor(settings(placement_group_timeout_s=3), num_workers=5,
                     resources_per_worker={"w": 1})
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        ex.start()
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert "5 workers" in text and "placement_group_timeout_s=3" in text, text
    assert "asked for 5 bundles of {CPU: 1, w: 1}" in text, text
    assert "free in all: {CPU: 5, lost: 1, w: 3}" in text, text
    assert "{CPU: 2, lost: 1, w: 2} free of" in text, text  # and per node
    assert ex.placement_group is None and ex.workers == []
    with pytest.raises(ValueError, match="num_workers"):
        RayExecutor(settings(), num_workers=2, num_hosts=2)


def test_node_lost_in_a_fixed_job(cluster, tmp_path):
    from hvdlite.common.exceptions import HorovodInternalError
    from hvdlite.ray import RayExecutor

    doomed = cluster.cluster.add_node(num_cpus=1, resources={"lost": 1}, **NODE)
    cluster.cluster.wait_for_nodes()
    ex = RayExecutor(settings(), num_hosts=2, num_workers_per_host=1,
                     resources_per_worker={"lost": 1})
    ex.start()
    marker = str(tmp_path / "ready")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            ex.run(ray_jobs.wait_in_collectives, args=[marker])
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 90
        while not all(os.path.exists(f"{marker}.{r}") for r in range(2)):
            assert time.monotonic() < deadline and t.is_alive(), failure
            time.sleep(0.1)
        t0 = time.monotonic()
        cluster.cluster.remove_node(doomed)
        t.join(90)
        assert not t.is_alive(), "the job hung after its node was lost"
        assert time.monotonic() - t0 < 60
        assert len(failure) == 1 and isinstance(failure[0], HorovodInternalError), failure
        assert f"node {doomed.node_id}" in str(failure[0]), failure[0]
        assert ex.workers == []
    finally:
        ex.shutdown()


def test_elastic_node_removed_then_added(cluster, tmp_path):
    from hvdlite.ray import RayExecutor

    import elastic_train

    c = cluster.cluster
    first = [c.add_node(num_cpus=1, resources={"e": 1}, **NODE) for _ in range(2)]
    c.wait_for_nodes()
    marks = tmp_path / "marks"
    marks.mkdir()
    hold = tmp_path / "release"
    total = 24
    env = {"ELASTIC_TOTAL_STEPS": str(total), "ELASTIC_COMMIT_EVERY": "2",
           "ELASTIC_STEP_DELAY": "0.1", "ELASTIC_HOLD_AT": "14", "ELASTIC_HOLD_SIZE": "2",
           "ELASTIC_HOLD_FILE": str(hold), "ELASTIC_MARK_DIR": str(marks)}
    ex = RayExecutor(settings(), min_workers=1, max_workers=2, resources_per_worker={"e": 1},
                     elastic_timeout=60)
    ex.start(extra_env_vars=env)
    out: list = []

    def run() -> None:
        try:
            out.append(ex.run(ray_jobs.elastic_job))
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)

    def progress(node) -> tuple[int, int]:
        try:
            step, size, _ = (marks / f"step.{node.node_id}_0").read_text().split()
            return int(step), int(size)
        except (OSError, ValueError):
            return -1, 0

    def wait_for(what, cond, timeout=90) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; {out}"
            assert t.is_alive(), out
            time.sleep(0.1)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    added = None
    try:
        survivor, doomed = first
        wait_for("two workers training", lambda: progress(survivor)[0] >= 4
                 and progress(survivor)[1] == 2)
        c.remove_node(doomed)
        wait_for("the job going on alone", lambda: progress(survivor)[1] == 1
                 and progress(survivor)[0] >= 6)
        added = c.add_node(num_cpus=1, resources={"e": 1}, **NODE)
        wait_for("the new node's worker", lambda: progress(added)[1] == 2, timeout=120)
        hold.touch()
        t.join(120)
        assert not t.is_alive(), "the elastic job did not finish"
        assert len(out) == 1 and isinstance(out[0], list), out
        results = out[0]
        assert len(results) == 2  # grew back to max_workers
        result = results[0]
        assert result["size"] == 2
        assert result["trace"] == list(range(total)), "a committed step was lost or repeated"
        assert result["params"] == elastic_train.reference(total)
        assert 1 in result["reset_sizes"] and result["reset_sizes"][-1] == 2, result
    finally:
        hold.touch()
        ex.shutdown()
        t.join(30)
        for node in [first[0]] + ([added] if added is not None else []):
            c.remove_node(node)


def test_ray_train_data_parallel_trainer(cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from hvdlite.ray import HvdliteConfig

    trainer = DataParallelTrainer(
        ray_jobs.train_loop, train_loop_config={"steps": 3},
        backend_config=HvdliteConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "w": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="hvdlite_train"))
    result = trainer.fit()
    assert result.error is None
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        weights = torch.load(os.path.join(d, "weights.pt"))
    check_close(weights, ray_jobs.reference(3))


def test_arguments_and_topology():
    """No cluster needed: Horovod's argument rules, and ranks from nodes."""
    from hvdlite.ray import ElasticRayExecutor, RayExecutor
    from hvdlite.ray.topology import assign_ranks, slots_in_order

    with pytest.raises(ValueError, match="either num_workers"):
        RayExecutor(settings())
    with pytest.raises(ValueError, match="leave num_workers and num_hosts unset"):
        RayExecutor(settings(), num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="max_workers"):
        RayExecutor(settings(), min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(settings(), num_workers=2, gpus_per_worker=1)
    s = ElasticRayExecutor.create_settings(min_np=2, max_np=4, elastic_timeout=30, nics="eth0")
    ex = ElasticRayExecutor(s, cpus_per_slot=2)._executor
    assert (ex.elastic, ex.min_workers, ex.max_workers, ex.cpus_per_worker) == (True, 2, 4, 2)
    assert s.nics == ["eth0"]
    # workers placed a, b, a, c, b: ranks grouped by node in order of first placement
    order = assign_ranks(["a", "b", "a", "c", "b"])
    assert [i for i, _ in order] == [0, 2, 1, 4, 3]
    coords = [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
              for _, s in order]
    assert coords == [("a", 0, 0, 2, 0, 3), ("a", 1, 1, 2, 0, 2), ("b", 2, 0, 2, 1, 3),
                      ("b", 3, 1, 2, 1, 2), ("c", 4, 0, 1, 2, 3)]
    # Ray Train's ranks are given: coordinates follow them as the coordinator computes them
    assert [(s.local_rank, s.cross_rank, s.cross_size) for s in slots_in_order(
        ["a", "b", "a"])] == [(0, 0, 2), (0, 1, 2), (1, 0, 1)]
