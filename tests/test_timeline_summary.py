"""`hvdlite-timeline` (python -m hvdlite.tools.timeline_summary) on a timeline written by a real
2-rank run, complete and cut short as a crashed job leaves it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hvdlite.tools.timeline_summary import PHASES, read_events
from util import ROOT, hvdlite_run


def summary(path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "hvdlite.tools.timeline_summary", str(path),
                           *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    path = tmp_path_factory.mktemp("tl") / "timeline.json"
    hvdlite_run("tl_summary_worker.py", np=2, env={"HOROVOD_TIMELINE": str(path)}, timeout=150)
    return path


@pytest.mark.timeout(200)
def test_summary_explains_where_the_time_went(timeline):
    proc = summary(timeline)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "file complete" in out
    for phase in PHASES:
        assert f"\n  {phase} " in out, out
    top = out.split("Top ")[1].splitlines()
    assert top[2].split()[0] == "late.grad", out          # the straggler's tensor comes first
    assert "rank 1: last in" in out
    assert "Most time is negotiation" in out
    for name in ("grad.0", "grad.2", "ada.grad", "bcast.w"):
        assert name in out

    data = json.loads(summary(timeline, "--json").stdout)
    assert data["complete"] is True
    late = data["tensors"]["late.grad"]
    assert late["phases_ms"]["negotiation"] > 250 and late["ops"] == 1
    assert data["last_rank"]["1"]["count"] >= 1
    assert data["tensors"]["grad.1"]["ops"] == 4 and data["tensors"]["grad.1"]["bytes"] == 16000
    assert data["tensors"]["ada.grad"]["phases_ms"]["transport"] > 0
    for t in data["tensors"].values():
        assert all(v >= 0 for v in t["phases_ms"].values())
        assert abs(sum(t["phases_ms"].values()) - t["total_ms"]) < 1e-6
    total = sum(data["phases_ms"].values())
    assert abs(total - sum(t["total_ms"] for t in data["tensors"].values())) < 1e-6
    for phase in PHASES:       # wall time never exceeds the summed tensor time, nor the span
        assert data["wall_ms"][phase] <= data["phases_ms"][phase] + 1e-6
        assert data["wall_ms"][phase] <= data["span_ms"] + 1e-6
    assert data["still_open"] == []


@pytest.mark.timeout(200)
def test_summary_reads_a_timeline_cut_short_by_a_crash(timeline, tmp_path):
    text = timeline.read_text()
    cut = tmp_path / "crashed.json"
    cut.write_text(text[:int(len(text) * 0.6)])          # no closing ']', half a line at the end
    events, complete = read_events(str(cut))
    assert not complete and 0 < len(events) < len(json.loads(text))
    proc = summary(cut, "--top", "3")
    assert proc.returncode == 0, proc.stderr
    assert "TRUNCATED" in proc.stdout and "Top 3 tensors" in proc.stdout
    data = json.loads(summary(cut, "--json").stdout)
    assert data["complete"] is False and data["tensors"]
    # A missing ']' alone (the writer died after a complete event) is read in full.
    whole = tmp_path / "no_bracket.json"
    whole.write_text(text.rstrip().rstrip("]"))
    events, complete = read_events(str(whole))
    assert not complete and len(events) == len(json.loads(text))


@pytest.mark.timeout(60)
def test_summary_reports_unreadable_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not a trace")
    proc = summary(bad)
    assert proc.returncode == 2 and "not a Chrome trace" in proc.stderr
