"""Units of the steady-state protocol (hvdlite/common/steady.py): the recursive-doubling round
gives every rank the same AND of bits and OR of flags, for any N and any delivery order, with
ceil(log2 N) (+1 off powers of two) messages per rank."""
from __future__ import annotations

import math
import random

import pytest

from hvdlite.common.steady import Round


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
