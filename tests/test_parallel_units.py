"""Single-process parts of hvdlite.torch.parallel: schedules (built-in ones, custom ones, the
deadlock checker and the bubble simulation), stage balancing, the p2p message format, the mesh
rank layout and skip-connection validation. No launcher needed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hvdlite.torch.parallel import balance, p2p
from hvdlite.torch.parallel import schedule as S
from hvdlite.torch.parallel.groups import mesh_groups
from hvdlite.torch.parallel.pipeline import Pop, SkipSequential, Stash

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------- schedules
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (2, 2), (2, 3), (2, 4), (4, 4), (4, 5), (4, 8),
                                 (3, 7), (8, 32)])
def test_simulated_bubble_equals_formula(name, p, m):
    """With equal stage times and free communication both schedules idle (p-1)/(m+p-1)."""
    for tb in (1.0, 2.0, 3.0):
        rep = S.check(name, p, m, t_f=1.0, t_b=tb)
        assert rep.bubble == pytest.approx(S.bubble_formula(p, m), abs=1e-12)
        assert rep.makespan == pytest.approx((m + p - 1) * (1.0 + tb))


def test_worked_numbers_from_the_reference_table():
    # parallel_addons.md §1.1: p=4, m=4 -> 42.9 %; p=4, m=8 -> 27.3 %; p=8, m=32 -> 17.9 %
    assert round(S.bubble_formula(4, 4) * 100, 1) == 42.9
    assert round(S.bubble_formula(4, 8) * 100, 1) == 27.3
    assert round(S.bubble_formula(8, 32) * 100, 1) == 17.9


def test_1f1b_holds_at_most_p_minus_s_micro_batches():
    rep = S.check("1f1b", 4, 8)
    assert rep.peak_in_flight == [4, 3, 2, 1]
    assert S.check("gpipe", 4, 8).peak_in_flight == [8, 8, 8, 8]
    assert S.check("1f1b", 4, 2).peak_in_flight == [2, 2, 2, 1]


def test_one_f_one_b_order():
    acts = S.one_f_one_b(3, 4)
    assert [str(a) for a in acts[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert [str(a) for a in acts[2]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [str(a) for a in S.gpipe(2, 3)[1]] == ["F0", "F1", "F2", "B2", "B1", "B0"]


def test_skip_edges_are_simulated():
    # a skip from stage 0 to stage 3 adds a direct message, the schedule still completes
    rep = S.check("1f1b", 4, 4, edges=[(0, 3)])
    assert rep.bubble > 0
    ops = S.lower(S.one_f_one_b(4, 4)[3], 3, [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert ("recv", S.Msg("F", 0, 3, 0)) in ops and ("send", S.Msg("B", 3, 0, 0)) in ops


def test_custom_schedule_checked():
    ok = [["F0", "F1", "B0", "B1"], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    assert S.check(ok, 2, 2).makespan > 0
    with pytest.raises(S.ScheduleError, match="would deadlock") as exc:
        S.check([["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]], 2, 2)
    text = str(exc.value)
    assert "stage 0 (after 1 of 4 actions) waits for gradients of micro-batch 0 from stage 1" \
        in text
    assert "stage 1 (after 0 of 4 actions) waits for activations of micro-batch 1" in text
    with pytest.raises(S.ScheduleError, match="never runs B1"):
        S.check([["F0", "F1", "B0"]] * 2, 2, 2)
    with pytest.raises(S.ScheduleError, match="B0 .* before F0"):
        S.check([["B0", "F0"]] * 2, 2, 1)
    with pytest.raises(S.ScheduleError, match="runs F0 twice"):
        S.check([["F0", "F0", "B0"]] * 2, 2, 1)
    with pytest.raises(S.ScheduleError, match="outside 0..1"):
        S.check([["F0", "F1", "F2", "B0", "B1", "B2"]] * 2, 2, 2)
    with pytest.raises(S.ScheduleError, match="not an action"):
        S.check([["X0"]] * 2, 2, 1)
    with pytest.raises(S.ScheduleError, match="3 stage lists"):
        S.check([["F0", "B0"]] * 3, 2, 1)
    with pytest.raises(S.ScheduleError, match="'gpipe', '1f1b'"):
        S.check("interleaved", 2, 2)


def test_render():
    text = S.check("gpipe", 2, 2).render()
    assert text.splitlines()[0].startswith("stage 0: 01") and "ba" in text
    assert str(S.check("1f1b", 2, 2)).startswith("2 stages x 2 micro-batches")


# ---------------------------------------------------------------------- balance
def test_balance_by_cost():
    assert balance.uniform(10, 4) == [3, 3, 2, 2]
    assert balance.by_cost([1, 1, 1, 1, 1, 1, 1, 1], 4) == [2, 2, 2, 2]
    assert balance.by_cost([10, 1, 1, 1, 1, 10], 2) == [3, 3]
    assert balance.by_cost([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1, 8]
    assert balance.by_cost([0, 0, 0, 0], 2) == [2, 2]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balance.by_cost([1, 1], 3)
    costs = balance.param_costs([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)])
    assert costs == [20.0, 0.0, 10.0]


# ---------------------------------------------------------------------- p2p format
def _roundtrip(obj, name="m"):
    words, tensors, payload = p2p.encode(obj, name)
    hdr = len(words) * 8
    buf = torch.empty(hdr + payload, dtype=torch.uint8)
    buf[:hdr].view(torch.int64).copy_(torch.tensor(words, dtype=torch.int64))
    p2p._write_payload(buf[hdr:], tensors)
    words2, hdr2 = p2p._parse_header(buf, name, 0)
    assert hdr2 == hdr and hdr % 16 == 0
    return p2p.decode(words2, buf[hdr:])


def test_message_roundtrip():
    g = torch.Generator().manual_seed(0)
    obj = (torch.randn(2, 3, generator=g), None, torch.tensor(7, dtype=torch.int64),
           (torch.ones(0, 5), torch.tensor([True, False, True]), None),
           torch.randn(3, generator=g, dtype=torch.float64)[::2],      # non-contiguous
           torch.randn(4, generator=g).to(torch.bfloat16),
           torch.randn(2, generator=g, dtype=torch.complex128))
    back = _roundtrip(obj)
    assert isinstance(back, tuple) and len(back) == len(obj)
    assert torch.equal(back[0], obj[0]) and back[1] is None
    assert back[2].shape == () and back[2].item() == 7
    assert back[3][0].shape == (0, 5) and torch.equal(back[3][1], obj[3][1]) and back[3][2] is None
    assert torch.equal(back[4], obj[4]) and torch.equal(back[5], obj[5])
    assert torch.equal(back[6], obj[6])
    assert _roundtrip(None) is None
    t = torch.randn(3, 3, generator=g)
    assert torch.equal(_roundtrip(t), t)
    lst = _roundtrip([t, t])
    assert isinstance(lst, list) and len(lst) == 2


def test_message_requires_grad_and_name_check():
    x = torch.randn(2, 2, requires_grad=True) * 2
    back = _roundtrip((x, torch.ones(2)))
    assert back[0].requires_grad and back[0].is_leaf and not back[1].requires_grad
    words, tensors, payload = p2p.encode(torch.ones(2), "a")
    buf = torch.zeros(len(words) * 8 + payload, dtype=torch.uint8)
    buf[:len(words) * 8].view(torch.int64).copy_(torch.tensor(words))
    with pytest.raises(p2p.P2PError, match="header of another message"):
        p2p._parse_header(buf, "b", 3)
    with pytest.raises(p2p.P2PError, match="not start with a hvdlite p2p header"):
        p2p._parse_header(torch.zeros(64, dtype=torch.uint8), "a", 3)
    with pytest.raises(TypeError, match="a message is a tensor, None, or a tuple/list"):
        p2p.encode({"x": 1}, "a")
    with pytest.raises(TypeError, match="message item 0"):
        p2p.encode(["text"], "a")


# ---------------------------------------------------------------------- mesh layout
def test_megatron_rank_layout():
    # Megatron's parallel_state docstring: 16 ranks, t=2, p=4 -> d=2
    g = mesh_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert sorted(g["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                               [13, 15]]
    assert sorted(g["pp"]) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert len(g["all"]) == 8 + 8 + 4


def test_mesh_size_errors():
    with pytest.raises(ValueError, match="does not match the world size 4"):
        mesh_groups(4, tp=3)
    with pytest.raises(ValueError, match=r"needs tp \* pp \* dp = 8 ranks but the job has 4"):
        mesh_groups(4, tp=2, pp=2, dp=2)
    with pytest.raises(ValueError, match="positive integer"):
        mesh_groups(4, tp=0)


# ---------------------------------------------------------------------- skip connections
def test_skip_sequential():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    model = SkipSequential([Stash("a"), lin, Pop("a"), Stash("b"), nn.Tanh(),
                            Pop("b", lambda x, s: x * s)])
    x = torch.randn(2, 3)
    h = lin(x) + x
    assert torch.allclose(model(x), torch.tanh(h) * h)
    with pytest.raises(ValueError, match="comes before any Stash"):
        SkipSequential([Pop("a"), Stash("a")])
    with pytest.raises(ValueError, match="never popped"):
        SkipSequential([Stash("a"), nn.Tanh()])
    with pytest.raises(ValueError, match="appears twice"):
        SkipSequential([Stash("a"), Stash("a"), Pop("a")])
