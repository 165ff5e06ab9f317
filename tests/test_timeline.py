"""The timeline is a valid Chrome trace with Horovod's phases per tensor."""
import json

import pytest

from util import hvdlite_run


def _events(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.timeout(120)
def test_timeline_from_env_and_dynamic(tmp_path):
    static, dynamic = tmp_path / "tl.json", tmp_path / "dyn.json"
    hvdlite_run("timeline_worker.py", np=2, args=[str(dynamic)],
                env={"HOROVOD_TIMELINE": str(static)})
    events = _events(static)
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"grad.0", "grad.3", "bcast.w"} <= names
    assert "after.stop" not in names and "gather.dynamic" not in names  # start_timeline switched files
    labels = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "NEGOTIATE_BROADCAST", "BROADCAST"} <= labels
    # Fused steps copy through the fusion buffer.
    assert "MEMCPY_IN_FUSION_BUFFER" in labels or "ALLREDUCE" in labels
    # Each negotiation has one tick per rank.
    pid = next(e["pid"] for e in events if e.get("name") == "process_name"
               and e["args"]["name"] == "bcast.w")
    ticks = {e["name"] for e in events if e["pid"] == pid and e["ph"] == "X"}
    assert ticks == {"0", "1"}
    dyn = _events(dynamic)
    dyn_names = {e["args"]["name"] for e in dyn if e.get("name") == "process_name"}
    assert "gather.dynamic" in dyn_names and "after.stop" not in dyn_names
    assert any(e.get("name") == "CYCLE_START" for e in dyn)
