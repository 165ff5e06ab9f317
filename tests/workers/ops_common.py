"""Shared helpers for the collective worker scripts (ops_*.py, ps_*.py).

Every rank builds every rank's input from a per-rank seeded generator, so each rank can compute
the full single-process reference locally and compare its own result exactly. Inputs are small
integers (exactly representable in every dtype, including float16/bfloat16), so sums, products,
averages and the power-of-two/small-integer scale factors used here are exact and results can be
compared with torch.equal.
"""
from __future__ import annotations

import zlib

import torch

import hvdlite.torch as hvd
from harness import (FAILURES, check, expect_raises, fail, finish, log,  # noqa: F401  (one harness)
                     no_threads_left, wait_until)

ALL_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
REDUCE_OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
              "Product": hvd.Product}
SHAPES = [(), (7,), (3, 4, 5)]

_salt_ids: dict = {}


def salt_id(salt) -> int:
    """A stable integer for a salt (str hash() is randomised per process)."""
    if isinstance(salt, int):
        return salt
    if salt not in _salt_ids:
        _salt_ids[salt] = zlib.crc32(repr(salt).encode()) % 1000003
    return _salt_ids[salt]


def gen(rank: int, shape, dtype: torch.dtype, salt=0, lo: int = -4, hi: int = 4) -> torch.Tensor:
    """Rank `rank`'s deterministic input: integers in [lo, hi] (uint8: [0, hi]) cast to dtype."""
    g = torch.Generator().manual_seed(1000 + rank + 7919 * salt_id(salt))
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if dtype == torch.uint8:
        lo = max(lo, 0)
    return torch.randint(lo, hi + 1, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def all_inputs(size: int, shape, dtype, salt=0, lo=-4, hi=4) -> list[torch.Tensor]:
    """Every rank's input, for local references."""
    return [gen(r, shape, dtype, salt, lo, hi) for r in range(size)]


def reduce_ref(inputs: list[torch.Tensor], op, pre: float = 1.0, post: float = 1.0,
               divisor: int | None = None) -> torch.Tensor:
    """Horovod's result: op over (pre * x_r), then * post (and / set size for Average; integer
    Average truncates toward zero). Computed in float64 (inputs are small integers: exact)."""
    dtype = inputs[0].dtype
    size = divisor if divisor is not None else len(inputs)
    xs = torch.stack([x.to(torch.float64) for x in inputs])
    if dtype.is_floating_point:
        xs = xs * pre
    else:
        xs = torch.trunc(xs * pre)
    if op in (hvd.Average, hvd.Sum):
        red = xs.sum(0)
    elif op == hvd.Min:
        red = xs.min(0).values
    elif op == hvd.Max:
        red = xs.max(0).values
    elif op == hvd.Product:
        red = xs.prod(0)
    else:
        raise ValueError(op)
    factor = post / size if op == hvd.Average else post
    red = red * factor
    if not dtype.is_floating_point:
        red = torch.trunc(red)
    return red.to(dtype)


def split_rows(dim0: int, size: int) -> list[int]:
    return [dim0 // size + (1 if i < dim0 % size else 0) for i in range(size)]


def my_rows(full: torch.Tensor, size: int, index: int) -> torch.Tensor:
    rows = split_rows(full.shape[0], size)
    start = sum(rows[:index])
    return full[start:start + rows[index]]


def same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not isinstance(actual, torch.Tensor):
        return fail(f"{what}: expected a tensor, got {type(actual).__name__}")
    if actual.dtype != expected.dtype:
        return fail(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        return fail(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if not torch.equal(actual, expected):
        diff = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
        fail(f"{what}: values differ (max abs diff {diff.max().item()}) "
             f"actual={actual.flatten()[:8].tolist()} expected={expected.flatten()[:8].tolist()}")


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol=1e-6, atol=1e-6) -> None:
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        fail(f"{what}: {exc}")


def shape_mismatch(name: str, submit=None) -> None:
    """Allreduce `name` with shape [4] on rank 1 and [3] elsewhere: every rank must raise the
    coordinator's mismatch error, naming the tensor and both shapes. `submit(tensor, name)`
    makes the call another way than the blocking `hvd.allreduce` (sum)."""
    shape = (4,) if hvd.rank() == 1 else (3,)
    try:
        if submit is None:
            hvd.allreduce(torch.ones(shape), name=name, op=hvd.Sum)
        else:
            submit(torch.ones(shape), name)
    except hvd.HorovodInternalError as exc:
        expected = (f"Mismatched ALLREDUCE tensor shapes on tensor '{name}': rank 0 sent shape "
                    f"[3] but rank 1 sent shape [4]. ALLREDUCE needs the same shape on every rank.")
        if expected not in str(exc):
            fail(f"unexpected error: {exc}")
    else:
        fail("a shape mismatch after the steady state did not raise")


def steady_delta(step, warm: range, timed: range) -> dict:
    """Run `step(k)` for the warm-up steps, then for the timed ones; the engine counters' change
    over the timed steps (fails the check if the job never entered the steady state)."""
    from hvdlite.common import basics
    for k in warm:
        step(k)
    before = basics.engine_counters()
    for k in timed:
        step(k)
    after = basics.engine_counters()
    if after["steady_entered"] < 1:
        fail(f"never entered the steady state: {after}")
    return {key: after[key] - before.get(key, 0) for key in after}

