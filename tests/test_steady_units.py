"""Units of the steady-state protocol (hvdlite/common/steady.py): the recursive-doubling round
gives every rank the same AND of bits and OR of flags, for any N and any delivery order, with
ceil(log2 N) (+1 off powers of two) messages per rank."""
from __future__ import annotations

import math
import random

import pytest

from hvdlite.common.steady import Round, payload_sum, value_from_wire, value_to_wire


def _run(n: int, values: list, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    wire = []                          # (dst, src, tag, value), delivered in random order
    sent = [0] * n
    rounds = []
    for me in range(n):
        def send(idx, tag, value, me=me):
            sent[me] += 1
            wire.append((idx, me, tag, value))
        rounds.append(Round(me, n, values[me], send))
    results = [r.advance() for r in rounds]
    while wire:
        dst, _, tag, value = wire.pop(rng.randrange(len(wire)))
        rounds[dst].offer(tag, value)
        got = rounds[dst].advance()
        if got is not None:
            results[dst] = got
    return results, sent


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 12, 16, 33])
def test_round_agrees_for_any_size_and_order(n):
    rng = random.Random(n)
    for trial in range(5):
        values = [(rng.getrandbits(40) | (1 << 3), rng.random() < 0.2) for _ in range(n)]
        want_bits = -1
        for bits, _ in values:
            want_bits &= bits
        want = (want_bits, any(f for _, f in values))
        results, sent = _run(n, values, seed=trial)
        assert results == [want] * n, (n, trial)
        p = 1 << (n.bit_length() - 1)
        assert max(sent) <= int(math.log2(p)) + (1 if p != n else 0)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 12])
def test_a_round_carries_one_payload_summed_alike_on_every_rank(n):
    """(bits, flag, tag, {rank: payload}) values: with one tag everywhere, every rank ends with
    every rank's payload, and payload_sum adds them in rank order, the same bits on every rank
    as the shared-memory path's ((p0 + p1) + p2 ...); a rank offering another tag, or none,
    leaves (bits, flag) on every rank, whatever the delivery order."""
    np = pytest.importorskip("numpy")
    rng = random.Random(n)
    gen = np.random.default_rng(n)
    for trial in range(4):
        arrays = [gen.standard_normal(37).astype(np.float32) for _ in range(n)]
        values = [(rng.getrandbits(20) | (1 << 7), False, 7, {me: arrays[me]})
                  for me in range(n)]
        results, _ = _run(n, values, seed=trial)
        want_bits = -1
        for v in values:
            want_bits &= v[0]
        assert all(r[:3] == (want_bits, False, 7) for r in results), (n, trial)
        want = arrays[0] + arrays[1]
        for a in arrays[2:]:
            want = want + a
        for r in results:
            assert sorted(r[3]) == list(range(n)), (n, trial)
            assert payload_sum(r[3]).tobytes() == want.tobytes(), (n, trial)
            back = value_from_wire(value_to_wire(r))     # what a "K" message carries
            assert back[:3] == r[:3] and payload_sum(back[3]).tobytes() == want.tobytes()
        odd = rng.randrange(n)
        for other in [(values[odd][0], False), values[odd][:2] + (9, arrays[odd])]:
            mixed = list(values)
            mixed[odd] = other if len(other) == 2 else other[:3] + ({odd: other[3]},)
            results, _ = _run(n, mixed, seed=trial)
            assert results == [(want_bits, False)] * n, (n, trial, other[2:3])


# ------------------------------------------------------------ a member that shut down
def _engine_with_round(round_no: int):
    """An engine (only the state the steady-state departure path touches) whose set 0 is in
    round `round_no` of epoch 3, with one barrier pending on cache bit 5."""
    import threading

    from hvdlite.common.engine import Engine, Entry, Completion
    from hvdlite.common.messages import BARRIER, Request
    from hvdlite.common.steady import SteadySet

    eng = Engine.__new__(Engine)
    eng._lock = threading.Lock()
    eng.steady, eng._inflight, eng._rounds_left, eng._gone_reasons = {}, {}, {}, {}
    eng._releasing, eng._closed = False, None
    eng.counters = {"steady_released": 0, "steady_rounds": 0}
    st = SteadySet(0, 3, [0, 1, 2, 3], 0)
    e = Entry(Request(rank=0, name="barrier", type=BARRIER))
    e.handle = Completion([e])
    st.pending[5] = e
    st.round_no = round_no
    st.round = object()                  # a round in flight
    st.round_bits = 1 << 5
    eng.steady[0] = st
    eng._inflight[(0, "barrier")] = e
    return eng, st, e.handle


def test_a_round_the_departed_rank_finished_ends_before_anything_fails():
    """Rank 1 finished round 1 of epoch 3 and shut down ("S" said 2 rounds done). This rank
    is still in round 1: the round ends here too, so the barrier it carries must not fail.
    Only what the round leaves fails, with the usual message."""
    eng, st, h = _engine_with_round(1)
    eng._steady_gone(0, [1], 3, 2)
    assert not h.done() and eng.steady.get(0) is st and st.gone == [1]
    assert 0 not in eng._rounds_left


def test_a_round_the_departed_rank_did_not_finish_fails_at_once():
    eng, st, h = _engine_with_round(2)
    eng._steady_gone(0, [1], 3, 2)               # rank 1 finished rounds 0 and 1 only
    assert h.done() and "rank(s) [1] already called hvd.shutdown()" in h.error
    assert 0 not in eng.steady and eng._rounds_left[0] == (3, 2)


def test_what_the_finished_round_leaves_fails_when_it_ends():
    eng, st, h = _engine_with_round(1)
    eng._steady_gone(0, [1], 3, 2)
    assert not h.done()
    eng._round_done(st, (0, False))               # the round ended without the barrier's bit
    assert h.done() and "rank(s) [1] already called hvd.shutdown()" in h.error
    assert 0 not in eng.steady and (0, "barrier") not in eng._inflight


def test_another_epoch_or_no_count_fails_at_once():
    for epoch, rounds in ((2, 5), (None, None)):
        eng, st, h = _engine_with_round(1)
        eng._steady_gone(0, [1], epoch, rounds)
        assert h.done() and "already called hvd.shutdown()" in h.error


def test_coordinator_passes_the_departed_ranks_round_count_on():
    """"S" with {set: (epoch, rounds)} becomes "G" items carrying them to every other member."""
    from hvdlite.common.config import Settings
    from hvdlite.common.controller import Coordinator, SetState
    from hvdlite.common.protocol import Item, Msg
    from hvdlite.common.response_cache import CoordinatorCache

    settings = Settings()
    coord = Coordinator(3, b"k" * 32, settings)
    s = SetState(0, [0, 1, 2], CoordinatorCache(settings.cache_capacity))
    s.steady, s.epoch = True, 3
    coord.sets[0] = s
    out: dict = {}
    coord._handle(1, (Msg.SHUTDOWN, {0: (3, 7)}), out)
    assert out == {0: [(Item.GONE, 0, [1], 3, 7)], 2: [(Item.GONE, 0, [1], 3, 7)]}
    out.clear()
    coord._handle(2, (Msg.SHUTDOWN,), out)          # an older rank's "S": no count
    assert out[0] == [(Item.GONE, 0, [2], None, None)]


def _group_request(rank, name, group, size, **kw):
    from hvdlite.common.messages import ALLREDUCE, SUM, Request
    return Request(rank=rank, name=name, type=ALLREDUCE, dtype="float32", shape=(2,),
                   reduce_op=SUM, group=group, group_size=size, **kw)


def _responses(out, rank):
    from hvdlite.common.protocol import Item
    return [item[1] for item in out.get(rank, []) if item[0] == Item.RESPONSE]


def test_a_group_whose_ranks_pass_different_counts_fails_once_every_rank_is_here():
    """No name common to all ranks (an empty call's stand-in on one, members on the others):
    the call fails on every rank, with both counts, when the last rank's part arrives, not
    before; its members' requests are all failed, and the group is free again."""
    from hvdlite.common.config import Settings
    from hvdlite.common.controller import Coordinator, SetState
    from hvdlite.common.messages import ERROR
    from hvdlite.common.protocol import Msg
    from hvdlite.common.response_cache import CoordinatorCache

    settings = Settings()
    coord = Coordinator(3, b"k" * 32, settings)
    s = coord.sets[0] = SetState(0, [0, 1, 2], CoordinatorCache(settings.cache_capacity))
    out: dict = {}
    for r in (0, 1):
        coord._handle(r, (Msg.QUERY, [_group_request(r, f"g.{i}", "g", 2) for i in range(2)],
                          []), out)
    assert not out, "failed before the last rank's part arrived"
    coord._handle(2, (Msg.QUERY, [_group_request(2, "g.empty", "g", 0)], []), out)
    for r in range(3):
        errors = _responses(out, r)
        assert sorted(n for e in errors for n in e.names) == ["g.0", "g.1", "g.empty"]
        assert all(e.type == ERROR for e in errors)
        assert "rank 0 submitted it with 2 tensors (one of them: 'g.0') but rank 2 with no " \
               "tensors (an empty list)" in errors[0].error
    assert not s.table and not s.failed_groups and not s.open_groups
    out.clear()
    for r in range(3):                                  # the group, used alike afterwards
        coord._handle(r, (Msg.QUERY, [_group_request(r, f"g.{i}", "g", 2) for i in range(2)],
                          []), out)
    released = [n for resp in _responses(out, 0) for n in resp.names]
    assert sorted(released) == ["g.0", "g.1"] and all(
        resp.type != ERROR for resp in _responses(out, 0))


def test_cache_hits_of_a_group_fail_against_another_ranks_count():
    """Members that come back as cache hits are counted too: a rank's hits on a cached
    group of 2 against another rank's empty call fail on both, whichever arrives first."""
    from hvdlite.common.config import Settings
    from hvdlite.common.controller import Coordinator, SetState
    from hvdlite.common.messages import ERROR
    from hvdlite.common.protocol import Msg
    from hvdlite.common.response_cache import CoordinatorCache

    for hits_first in (True, False):
        settings = Settings()
        coord = Coordinator(2, b"k" * 32, settings)
        s = coord.sets[0] = SetState(0, [0, 1], CoordinatorCache(settings.cache_capacity))
        out: dict = {}
        for r in (0, 1):
            coord._handle(r, (Msg.QUERY, [_group_request(r, f"g.{i}", "g", 2, cacheable=True)
                                          for i in range(2)], []), out)
        mask = sum(1 << b for b in s.cache.by_bit)      # (the cache holds g.0 and g.1)
        assert len(s.cache.by_bit) == 2
        out.clear()
        hits = (Msg.QUERY, [], [(0, mask)])
        empty = (Msg.QUERY, [_group_request(1, "g.empty", "g", 0)], [])
        for r, msg in ([(0, hits), (1, empty)] if hits_first else [(1, empty), (0, hits)]):
            coord._handle(r, msg, out)
        for r in (0, 1):
            errors = _responses(out, r)
            assert sorted(n for e in errors for n in e.names) == ["g.0", "g.1", "g.empty"], \
                (hits_first, errors)
            assert all(e.type == ERROR and "with no tensors (an empty list)" in e.error
                       for e in errors)
        assert not s.pending_bits[0] and not s.table and not s.failed_groups


@pytest.mark.parametrize("split", [False, True], ids=["one-message", "two-messages"])
def test_a_group_whose_ranks_name_its_members_differently_fails_once_all_are_here(split):
    """As many members on each rank, one of them named differently (a prefix on one rank):
    every rank's call fails once all members are here, with both names; the common member
    is released as it is (`split`: it was ready, and held for its group, before the other
    member came); nothing of the call is left, and the group works afterwards."""
    from hvdlite.common.config import Settings
    from hvdlite.common.controller import Coordinator, SetState
    from hvdlite.common.messages import ERROR
    from hvdlite.common.protocol import Msg
    from hvdlite.common.response_cache import CoordinatorCache

    settings = Settings()
    coord = Coordinator(2, b"k" * 32, settings)
    s = coord.sets[0] = SetState(0, [0, 1], CoordinatorCache(settings.cache_capacity))
    out: dict = {}
    coord._handle(0, (Msg.QUERY, [_group_request(0, n, "p", 2) for n in ("bias", "weight")],
                      []), out)
    assert not out
    members = [_group_request(1, n, "p", 2) for n in ("bias", "module.weight")]
    for part in ([members[:1], members[1:]] if split else [members]):
        coord._handle(1, (Msg.QUERY, part, []), out)
    for r in (0, 1):
        got = {n: resp for resp in _responses(out, r) for n in resp.names}
        assert sorted(got) == ["bias", "module.weight", "weight"], got
        assert got["bias"].type != ERROR
        assert got["weight"].type == ERROR and got["module.weight"].type == ERROR
        assert "rank 0 submitted 'weight', which rank 1 did not, and rank 1 submitted " \
               "'module.weight', which rank 0 did not" in got["weight"].error
    assert not s.table and not s.failed_groups and not s.open_groups and not s.groups
    out.clear()
    for r in (0, 1):
        coord._handle(r, (Msg.QUERY, [_group_request(r, n, "p", 2)
                                      for n in ("bias", "weight")], []), out)
    assert sorted(n for resp in _responses(out, 0) for n in resp.names) == ["bias", "weight"]
    assert all(resp.type != ERROR for resp in _responses(out, 0))


@pytest.mark.parametrize("hits_first", [True, False], ids=["hits-first", "hits-last"])
def test_cache_hits_of_a_group_fail_against_another_ranks_names(hits_first):
    """A rank's call as cache hits (a model broadcast before) against another rank's as many
    members under other names (its model wrapped: 'module.'): every member fails on both
    ranks, whichever arrives first. (With the hits last, in one message, the verdict came on
    the last hit, and only that one failed: the others stayed pending, and rank 0 waited for
    the stall shutdown while rank 1 had its error.)"""
    from hvdlite.common.config import Settings
    from hvdlite.common.controller import Coordinator, SetState
    from hvdlite.common.messages import ERROR
    from hvdlite.common.protocol import Msg
    from hvdlite.common.response_cache import CoordinatorCache

    names = ["0.bias", "0.weight", "1.bias", "1.weight"]
    settings = Settings()
    coord = Coordinator(2, b"k" * 32, settings)
    s = coord.sets[0] = SetState(0, [0, 1], CoordinatorCache(settings.cache_capacity))
    out: dict = {}
    for r in (0, 1):
        coord._handle(r, (Msg.QUERY, [_group_request(r, n, "bp", 4, cacheable=True)
                                      for n in names], []), out)
    assert len(s.cache.by_bit) == 4
    mask = sum(1 << b for b in s.cache.by_bit)
    out.clear()
    hits = (Msg.QUERY, [], [(0, mask)])
    wrapped = (Msg.QUERY, [_group_request(1, "module." + n, "bp", 4) for n in names], [])
    for r, msg in ([(0, hits), (1, wrapped)] if hits_first else [(1, wrapped), (0, hits)]):
        coord._handle(r, msg, out)
    for r in (0, 1):
        got = {n: resp for resp in _responses(out, r) for n in resp.names}
        assert sorted(got) == sorted(names + ["module." + n for n in names]), (r, got)
        assert all(resp.type == ERROR for resp in got.values())
        assert "rank 0 submitted '0.bias', which rank 1 did not, and rank 1 submitted " \
               "'module.0.bias', which rank 0 did not" in got["1.weight"].error
    assert not any(s.pending_bits) and not s.table and not s.failed_groups \
        and not s.open_groups
