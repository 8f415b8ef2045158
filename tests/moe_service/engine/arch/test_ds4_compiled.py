"""ds4_compiled: each compiled deepseek4 op against the numpy reference it replaces
(moe_service.engine.ds4_ops / arch.deepseek4), on random inputs of the real and toy shapes;
a row's result does not depend on the rows beside it nor on the worker pool."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import ds4_compiled as dc
from moe_service.engine import ds4_indexer as di
from moe_service.engine import ds4_ops
from moe_service.engine.pool import WorkerPool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(n_threads=2, pin_caller=False)
    yield p
    p.close()


def _attn_case(rng, T, NH, D, Nw, Nc, window_frac=0.7, comp_frac=0.4):
    q = (rng.standard_normal((T, NH, D)) * 0.3).astype(np.float16).astype(np.float32)
    win = (rng.standard_normal((Nw, D)) * 2.0).astype(np.float16)
    comp = (rng.standard_normal((Nc, D)) * 2.0).astype(np.float16)
    mw = rng.random((T, Nw)) < window_frac
    mw[:, -1] = True  # every query sees itself
    mc = rng.random((T, Nc)) < comp_frac
    sinks = rng.standard_normal(NH).astype(np.float32)
    return q, win, comp, mw, mc, sinks


@pytest.mark.parametrize(
    "T, NH, D, Nw, Nc",
    [
        (1, 64, 512, 128, 512),
        (1, 8, 128, 20, 0),
        (5, 8, 128, 40, 37),
        (3, 64, 512, 130, 300),
        (1, 4, 64, 1, 1),
    ],
)
def test_attend_rows_is_attend_sinks_on_the_concatenated_keys(T, NH, D, Nw, Nc, pool):
    rng = np.random.default_rng(T * 1000 + Nw + Nc)
    q, win, comp, mw, mc, sinks = _attn_case(rng, T, NH, D, Nw, Nc)
    scale = 1.0 / np.sqrt(D)
    want = ds4_ops.attend_sinks(
        q, np.concatenate([win, comp]).astype(np.float32), np.concatenate([mw, mc], axis=1), sinks, scale
    )
    got = dc.attend_rows(q, win, comp if Nc else None, mw, mc if Nc else None, sinks, scale)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    # the pool's split gives the same bits, and a row alone gives the same bits as in the batch
    assert np.array_equal(
        dc.attend_rows(q, win, comp if Nc else None, mw, mc if Nc else None, sinks, scale, pool), got
    )
    for t in range(T):
        alone = dc.attend_rows(
            q[t : t + 1],
            win,
            comp if Nc else None,
            mw[t : t + 1],
            mc[t : t + 1] if Nc else None,
            sinks,
            scale,
        )
        assert np.array_equal(alone[0], got[t])


def test_attend_rows_refuses_shapes_that_do_not_agree():
    rng = np.random.default_rng(0)
    q, win, comp, mw, mc, sinks = _attn_case(rng, 2, 4, 64, 10, 5)
    with pytest.raises(ValueError, match="do not agree"):
        dc.attend_rows(q, win, comp, mw[:, :5], mc, sinks, 0.125)


@pytest.mark.parametrize(
    "NH, D, W, n0, Nc, n_sel",
    [
        (64, 512, 128, 600, 150, 100),  # V4-Flash shapes: a full ring that has wrapped, some rows chosen
        (64, 512, 128, 40, 10, None),  # the ring not yet full, every compressed row
        (8, 128, 8, 3, 0, None),  # no compressed rows
        (6, 40, 4, 9, 3, 2),  # heads not a multiple of 4, dims not of 16 (the plain loops)
        (4, 64, 1, 5, 2, 1),  # a window of the token alone
    ],
)
def test_attend_one_is_attend_rows_on_the_window_in_position_order(NH, D, W, n0, Nc, n_sel, pool):
    """The decode step's attention (the window read from the ring in place) gives the bits
    of attend_rows on the concatenated window rows and a mask of the chosen compressed rows."""
    rng = np.random.default_rng(NH + D + W + n0)
    q = (rng.standard_normal((1, NH, D)) * 0.3).astype(np.float16).astype(np.float32)
    ring = (rng.standard_normal((W, D)) * 2.0).astype(np.float16)
    new = (rng.standard_normal(D) * 2.0).astype(np.float16)
    comp = (rng.standard_normal((Nc, D)) * 2.0).astype(np.float16)
    sinks = rng.standard_normal(NH).astype(np.float32)
    sel = None if n_sel is None else np.sort(rng.choice(Nc, n_sel, replace=False))
    lo = max(0, n0 - W + 1)
    win = np.concatenate([ring[np.arange(lo, n0) % W], new[None]])
    mc = np.zeros((1, Nc), np.bool_)
    mc[0, slice(None) if sel is None else sel] = True
    scale = 1.0 / np.sqrt(D)
    want = dc.attend_rows(
        q, win, comp if Nc else None, np.ones((1, len(win)), np.bool_), mc if Nc else None, sinks, scale
    )
    for p in (None, pool):
        got = dc.attend_one(q, ring, lo, n0, new, comp if Nc else None, sel, sinks, scale, p)
        assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="do not agree"):
        dc.attend_one(q, ring, max(0, lo - 1) if lo else n0 + 1, n0, new, None, None, sinks, scale)


def test_dot4_and_wsum4x16_are_the_one_at_a_time_sums():
    """quant.ir.dot4_f32_ggml equals four dot_f32_ggml calls and wsum4x16_f32 the float32
    running sums acc += p * v, bit for bit (lengths with and without a tail)."""
    from numba import njit

    from moe_service.engine.quant.ir import dot4_f32_ggml, dot_f32_ggml, wsum4x16_f32

    @njit
    def dots(w8, wo, ws, x, xo, xs, n):
        a = np.empty(4, np.float32)
        b = np.empty(4, np.float32)
        a[0], a[1], a[2], a[3] = dot4_f32_ggml(w8, wo, ws, x, xo, xs, n)
        for k in range(4):
            b[k] = dot_f32_ggml(w8, wo + k * ws, x, xo + k * xs, n)
        return a, b

    @njit
    def sums(keys, cols, n, p, out):
        wsum4x16_f32(keys, cols, 0, n, 48, 16, p, 0, n, out, 0, 16)

    rng = np.random.default_rng(7)
    for n in (512, 37, 16, 5):
        w = rng.standard_normal(4 * n + 8).astype(np.float32)
        x = rng.standard_normal(4 * n + 8).astype(np.float32)
        for ws, xs in ((0, n), (n * 4, 0), (n * 4 + 4, n + 1)):
            a, b = dots(w.view(np.uint8), 4, ws, x, 1, xs, n)
            assert np.array_equal(a, b)
    keys = rng.standard_normal((10, 48)).astype(np.float32)
    cols = rng.permutation(10).astype(np.int64)
    p = rng.random(4 * 10).astype(np.float32)
    out = np.zeros(64, np.float32)
    sums(keys.reshape(-1), cols, 10, p, out)
    want = np.zeros((4, 16), np.float32)
    for i in range(10):
        for k in range(4):
            want[k] = want[k] + p[k * 10 + i] * keys[cols[i], 16:32]
    assert np.array_equal(out.reshape(4, 16), want)


def _hc_case(rng, T, C=4, H=4096):
    M = (2 + C) * C
    x = (rng.standard_normal((T, C, H)) * rng.choice([0.5, 3.0])).astype(np.float32)
    fn = (rng.standard_normal((M, C * H)) / np.sqrt(C * H) * 4).astype(np.float32).astype(np.float64)
    scale = rng.uniform(0.5, 2.0, 3).astype(np.float32)
    base = (rng.standard_normal(M) * 2.0).astype(np.float32)
    return x, fn, scale, base


@pytest.mark.parametrize("T, H", [(1, 4096), (3, 256), (7, 64)])
def test_hc_pre_is_the_numpy_formula(T, H):
    rng = np.random.default_rng(T + H)
    x, fn, scale, base = _hc_case(rng, T, H=H)
    want = ds4_ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    got = dc.hc_pre(x, dc.mix_table(fn), scale, base, 1e-6, 1e-6, 20)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        # the mixes sum in another order than BLAS's (float64, rounded to float32): equal but for the last bit
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    alone = dc.hc_pre(x[-1:], dc.mix_table(fn), scale, base, 1e-6, 1e-6, 20)
    assert all(np.array_equal(a[0], g[-1]) for a, g in zip(alone, got, strict=True))


@pytest.mark.parametrize("T, H", [(1, 4096), (5, 256)])
def test_hc_post_is_numpy_bit_for_bit(T, H):
    rng = np.random.default_rng(T * 7 + H)
    x = rng.standard_normal((T, 4, H)).astype(np.float32)
    y = rng.standard_normal((T, H)).astype(np.float32)
    post = rng.uniform(0, 2, (T, 4)).astype(np.float32)
    comb = rng.uniform(0, 1, (T, 4, 4)).astype(np.float32)
    assert np.array_equal(dc.hc_post(y, x, post, comb), ds4_ops.hc_post(y, x, post, comb))


@pytest.mark.parametrize("T, H", [(8, 256), (21, 4096)])
def test_hc_pre_post_pooled_are_the_same_bits(T, H, pool):
    """A prefill step's tokens spread over the pool, 8 mixes per pass over the table: each
    token's bits as computed alone (the prefix cache's chunking does not move them)."""
    rng = np.random.default_rng(T * 3 + H)
    x, fn, scale, base = _hc_case(rng, T, H=H)
    for table in (dc.mix_table(fn), dc.mix_table(fn + 1e-9)):  # float32 and float64 tables
        one = dc.hc_pre(x, table, scale, base, 1e-6, 1e-6, 20)
        pooled = dc.hc_pre(x, table, scale, base, 1e-6, 1e-6, 20, pool)
        assert all(np.array_equal(a, b) for a, b in zip(one, pooled, strict=True))
        for t in (0, 7, T - 1):
            alone = dc.hc_pre(x[t : t + 1], table, scale, base, 1e-6, 1e-6, 20)
            assert all(np.array_equal(a[0], b[t]) for a, b in zip(alone, one, strict=True))
    y = rng.standard_normal((T, H)).astype(np.float32)
    _, post, comb = one
    want = ds4_ops.hc_post(y, x, post, comb)
    assert np.array_equal(dc.hc_post(y, x, post, comb, pool), want)


@pytest.mark.parametrize("T, NH, D, R", [(9, 64, 512, 64), (3, 4, 64, 16), (16, 5, 48, 8)])
def test_heads_inplace_is_rms_rope_and_float16_rounding(T, NH, D, R, pool):
    rng = np.random.default_rng(T + NH + D)
    x = (rng.standard_normal((T, NH, D)) * 3).astype(np.float32)
    x[0, 0, :3] = [0.0, 7e4, -1e-30]  # float16 overflow and underflow round as numpy's cast
    pos = rng.integers(0, 300, T)
    ang = rng.random((300, R // 2)).astype(np.float32) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    with np.errstate(over="ignore"):
        want_q = ds4_ops.rope_last(ds4_ops.rms(x, 1e-6), pos, cos, sin).astype(np.float16).astype(np.float32)
    want_o = ds4_ops.rope_last(x, pos, cos, sin, inverse=True)
    for p in (None, pool):
        assert np.array_equal(dc.heads_inplace(x.copy(), pos, cos, sin, 1e-6, True, p), want_q)
        assert np.array_equal(dc.heads_inplace(x.copy(), pos, cos, sin, 1e-6, False, p), want_o)
    with pytest.raises(ValueError, match="C-contiguous"):
        dc.heads_inplace(x[:, :, ::2], pos, cos, sin, 1e-6, True)
    with pytest.raises(IndexError, match="outside"):
        dc.heads_inplace(x.copy(), pos + 300, cos, sin, 1e-6, True)


@pytest.mark.parametrize("T, NH, D, R, G", [(9, 64, 512, 64, 8), (16, 6, 48, 8, 3), (3, 4, 64, 16, 1)])
def test_inverse_rope_groups_is_heads_inplace_group_major(T, NH, D, R, G, pool):
    """The output's inverse rope with the rows also written group-major (deepseek4's
    attn_output_a input): x as heads_inplace leaves it, and out[g, t] the heads of group g."""
    rng = np.random.default_rng(T + NH + D + G)
    x = rng.standard_normal((T, NH, D)).astype(np.float32)
    pos = rng.integers(0, 300, T)
    ang = rng.random((300, R // 2)).astype(np.float32) * 6
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    want = ds4_ops.rope_last(x, pos, cos, sin, inverse=True)
    for p in (None, pool):
        xx = x.copy()
        out = dc.inverse_rope_groups(xx, pos, cos, sin, G, p)
        assert np.array_equal(xx, want)
        assert out.shape == (G, T, NH // G * D)
        assert np.array_equal(out, want.reshape(T, G, NH // G * D).transpose(1, 0, 2))
        buf = np.full(x.size + 5, np.nan, np.float32)  # a scratch larger than needed: a view of it
        assert np.array_equal(dc.inverse_rope_groups(x.copy(), pos, cos, sin, G, p, buf), out)
        assert np.array_equal(buf[: x.size], out.reshape(-1))
    with pytest.raises(ValueError, match="divide"):
        dc.inverse_rope_groups(x.copy(), pos, cos, sin, 5, pool)


def test_attend_rows_multi_token_step_rows_as_alone(pool):
    """A prefill-sized step (odd key counts, an odd head count at the pool's split): every
    (token, head) row the same bits as that token alone, pooled or not."""
    rng = np.random.default_rng(5)
    T, NH, D, Nw, Nc = 12, 7, 64, 37, 23
    q, win, comp, mw, mc, sinks = _attn_case(rng, T, NH, D, Nw, Nc)
    got = dc.attend_rows(q, win, comp, mw, mc, sinks, 0.125)
    assert np.array_equal(dc.attend_rows(q, win, comp, mw, mc, sinks, 0.125, pool), got)
    want = ds4_ops.attend_sinks(
        q, np.concatenate([win, comp]).astype(np.float32), np.concatenate([mw, mc], axis=1), sinks, 0.125
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for t in range(T):
        alone = dc.attend_rows(q[t : t + 1], win, comp, mw[t : t + 1], mc[t : t + 1], sinks, 0.125)
        assert np.array_equal(alone[0], got[t])


def test_hc_pre_refuses_a_table_of_another_shape():
    rng = np.random.default_rng(1)
    x, fn, scale, base = _hc_case(rng, 1, H=64)
    with pytest.raises(ValueError, match="do not agree"):
        dc.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)


@pytest.mark.parametrize(
    "Ni, Di, nb, n_valid, top_k", [(64, 128, 1100, 1100, 512), (3, 16, 40, 37, 5), (8, 24, 9, 9, 2)]
)
def test_index_one_is_the_reference_choice(Ni, Di, nb, n_valid, top_k, pool):
    """The decode step's indexer (compiled float64 scores, keys by 16, on the pool or not)
    chooses the rows deepseek4._top_k (numpy dgemm) chooses, ties at zero included."""
    from moe_service.engine.arch.deepseek4 import _top_k

    rng = np.random.default_rng(Ni + nb)
    q = rng.standard_normal((1, Ni, Di)).astype(np.float32)
    w = rng.standard_normal((1, Ni)).astype(np.float32)
    k = rng.standard_normal((nb, Di)).astype(np.float16)
    k[: nb // 4] = -np.abs(k[: nb // 4]) * np.sign(q[0].sum(axis=0))[None, :]  # some rows score exactly 0 ...
    q[0, :, :] = np.abs(q[0]) * np.sign(q[0].sum(axis=0))[None, :]  # ... every head's dot <= 0 there
    visible = np.zeros((1, nb), np.bool_)
    visible[0, :n_valid] = True
    want = np.flatnonzero(_top_k(q, w, k.astype(np.float32), visible, top_k)[0])
    for p in (None, pool):
        assert np.array_equal(di.index_one(q[0], w[0], k, n_valid, top_k, p), want)
    with pytest.raises(ValueError, match="do not agree"):
        di.index_one(q[0], w[0, :-1], k, n_valid, top_k)



@pytest.mark.parametrize(
    "n, Ni, Di, nb, top_k",
    [(6, 64, 128, 700, 512), (9, 5, 30, 23, 4), (4, 3, 16, 9, 2), (3, 4, 64, 40, 64)],
)
def test_lid_top_k_is_the_reference_choice(n, Ni, Di, nb, top_k, pool):
    """The layer's indexer (blocked float64 dots, pooled over the queries) chooses as
    deepseek4._top_k on prefix-visible rows; a query alone chooses as in its step."""
    from moe_service.engine.arch.deepseek4 import _top_k

    rng = np.random.default_rng(n * 100 + nb)
    q = rng.standard_normal((n, Ni, Di)).astype(np.float32)
    w = rng.standard_normal((n, Ni)).astype(np.float32)
    k = rng.standard_normal((nb, Di)).astype(np.float16)
    k[3] = 0  # exact zero scores: ties broken in ggml's order
    n_vis = rng.integers(1, nb + 1, n)
    n_vis[0] = nb
    visible = np.arange(nb)[None, :] < n_vis[:, None]
    want = _top_k(q, w, k.astype(np.float32), visible, top_k) & visible
    got = di.lid_top_k(q, w, k, n_vis, top_k)
    assert got.dtype == np.bool_ and np.array_equal(got, want)
    assert np.array_equal(di.lid_top_k(q, w, k, n_vis, top_k, pool), got)
    for t in (0, n - 1):
        assert np.array_equal(di.lid_top_k(q[t : t + 1], w[t : t + 1], k, n_vis[t : t + 1], top_k)[0], got[t])
    with pytest.raises(ValueError, match="do not agree"):
        di.lid_top_k(q, w[:, :1], k, n_vis, top_k)


def test_round_f16_is_numpy_float16_round_trip():
    """round_f16 gives numpy's astype(float16).astype(float32) bit for bit: ties to even,
    subnormals, overflow to inf, signed zeros, NaN stays NaN."""
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [rng.standard_normal(20000).astype(np.float32) * s for s in (1e-8, 1e-5, 1.0, 100.0, 7e4)]
        + [
            np.array(
                [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504, 65520, 65519.99, 2.98e-8, 5.96e-8], np.float32
            )
        ]
        + [rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    ).reshape(2, -1)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    got = dc.round_f16(x)
    assert got.shape == x.shape and got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
