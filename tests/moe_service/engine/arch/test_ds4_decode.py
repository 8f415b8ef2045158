"""ds4_decode: a decode step's pooled forms give the bits of ds4_compiled's one-thread kernels
(which tests/moe_service/engine/arch/test_ds4_compiled.py compares with the numpy
references)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import ds4_compiled as dc
from moe_service.engine import ds4_decode as dd
from moe_service.engine import ds4_ops
from moe_service.engine.pool import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(n_threads=2, pin_caller=False)
    yield p
    p.close()


@pytest.mark.parametrize("C, H, shares", [(4, 4096, 2), (4, 256, 3), (2, 96, 2), (3, 40, 5)])
def test_hc_pre_one_is_hc_pre_bit_for_bit(C, H, shares, pool):
    """The split table's shares (12 columns a share at V4's 4 streams, 8 at 3 shares, and a
    share count that is not a register width) sum each mix as the one-thread kernel does."""
    rng = np.random.default_rng(C * H + shares)
    M = (2 + C) * C
    x = (rng.standard_normal((1, C, H)) * rng.choice([0.5, 3.0])).astype(np.float32)
    fn = (rng.standard_normal((M, C * H)) / np.sqrt(C * H) * 4).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = (rng.standard_normal(M) * 2.0).astype(np.float32)
    table = dc.mix_table(fn)
    want = dc.hc_pre(x, table, scale, base, 1e-6, 1e-6, 20)
    ref = ds4_ops.hc_pre(x, fn.astype(np.float64), scale, base, 1e-6, 1e-6, 20)
    assert np.allclose(want[0], ref[0], rtol=1e-5, atol=1e-6)  # the kernel is the formula
    one = dd.HcPreOne(table, shares, 1e-6)
    for _ in range(2):  # the job's scratch reused
        got = one(x, scale, base, 1e-6, 20, pool)
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))


def test_hc_pre_one_refuses_what_does_not_fit(pool):
    table = np.zeros((64, 24), np.float32)
    with pytest.raises(ValueError, match="float32 mixing table"):
        dd.HcPreOne(table.astype(np.float64), 2, 1e-6)
    with pytest.raises(ValueError, match="shares"):
        dd.HcPreOne(table, 5, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        dd.HcPreOne(table, 2, 1e-6)(
            np.zeros((2, 4, 16), np.float32), np.ones(3), np.zeros(24), 1e-6, 20, pool
        )


@pytest.mark.parametrize(
    "NH, D, W, n0, Nc, n_sel, R",
    [
        (64, 512, 128, 4000, 1000, 512, 64),
        (64, 512, 128, 300, 75, None, 64),
        (8, 48, 8, 5, 0, None, 8),
        (6, 40, 16, 40, 10, 4, 8),
    ],
)
def test_attend_one_is_heads_then_attention_then_inverse_rope(NH, D, W, n0, Nc, n_sel, R, pool):
    """One token from its raw query: the bits of ds4_compiled's heads_inplace (q), attend_one
    and heads_inplace (the output's inverse rope), pooled (rows gathered by ranges, heads by
    items) or on the calling thread; D not a multiple of 16 takes the plain value sums."""
    rng = np.random.default_rng(NH + D + n0)
    q = (rng.standard_normal((NH, D)) * 2).astype(np.float32)
    ring = rng.standard_normal((W, D)).astype(np.float16)
    new = rng.standard_normal(D).astype(np.float16)
    comp = rng.standard_normal((Nc, D)).astype(np.float16) if Nc else None
    sel = np.sort(rng.choice(Nc, n_sel, replace=False)) if n_sel else None
    ang = rng.random((n0 + 10, R // 2)).astype(np.float32) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    sinks = rng.standard_normal(NH).astype(np.float32)
    lo = max(0, n0 - W + 1)
    qq = dc.heads_inplace(q.copy()[None], np.array([n0]), cos, sin, 1e-6, True)
    o = dc.attend_one(qq, ring, lo, n0, new, comp, sel, sinks, 1 / np.sqrt(D))
    want = dc.heads_inplace(np.ascontiguousarray(o), np.array([n0]), cos, sin, 1e-6, False)
    for p in (None, pool):
        q_in = q.copy()
        got = dd.attend_one(q_in, n0, cos, sin, 1e-6, ring, lo, n0, new, comp, sel, sinks, 1 / np.sqrt(D), p)
        assert np.array_equal(got, want)
        assert np.array_equal(q_in, qq[0])  # q prepared in place, as heads_inplace leaves it


def test_attend_one_refuses_what_does_not_fit():
    q = np.zeros((4, 32), np.float32)
    ring = np.zeros((8, 32), np.float16)
    cs = np.ones((10, 4), np.float32)
    args = (cs, cs, 1e-6, ring, 3, 5, np.zeros(32, np.float16), None, None, np.zeros(4, np.float32), 0.1)
    with pytest.raises(ValueError, match="do not agree"):
        dd.attend_one(q[:, :16].copy(), 5, *args)
    with pytest.raises(IndexError, match="outside the tables"):
        dd.attend_one(q, 10, *args)
    with pytest.raises(ValueError, match="selected rows"):
        dd.attend_one(q, 5, *args[:7], np.zeros((3, 32), np.float16), np.array([3]), *args[9:])


def test_route_one_is_route_bit_for_bit():
    """Random gates with ties (repeated values, +-0), a NaN, bias or not, hash-layer ids,
    norm and scale on and off: ds4_ops.route's ids and weights exactly."""
    rng = np.random.default_rng(7)
    for case in range(400):
        E = int(rng.choice([8, 16, 64, 256]))
        K = int(rng.integers(1, min(E, 12) + 1))
        probs = ds4_ops.sqrt_softplus(rng.standard_normal((1, E)).astype(np.float32) * 3)
        if case % 3 == 0:  # ties
            probs[0, rng.integers(0, E, E // 2)] = probs[0, 0]
            probs[0, 1] = 0.0
            probs[0, 2] = -0.0
        if case % 17 == 0:
            probs[0, rng.integers(0, E)] = np.nan
        bias = (rng.standard_normal(E) * 0.1).astype(np.float32) if case % 2 else None
        fixed = rng.integers(0, E, (1, K)).astype(np.int32) if case % 5 == 0 else None
        norm = bool(case % 4)
        scale = float(rng.choice([0.0, 1.0, 1.5, 2.5]))
        with np.errstate(invalid="ignore"):
            want = ds4_ops.route(probs, K, bias, fixed, norm, scale)
            got = dd.route_one(probs, K, bias, fixed, norm, scale)
        assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
        assert np.array_equal(got[0], want[0]), case
        assert np.array_equal(got[1], want[1], equal_nan=True), case


def test_route_one_refuses_what_does_not_fit():
    probs = np.ones((1, 8), np.float32)
    with pytest.raises(ValueError, match="do not agree"):
        dd.route_one(np.ones((2, 8), np.float32), 2, None, None, True, 1.0)
    with pytest.raises(ValueError, match="do not agree"):
        dd.route_one(probs, 9, None, None, True, 1.0)
    with pytest.raises(ValueError, match="outside 8 experts"):
        dd.route_one(probs, 2, None, np.array([[1, 8]]), True, 1.0)
