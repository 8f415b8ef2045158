"""Attention kernels (moe_service.engine.attention) against a float64 evaluation.

The reference takes the same float16 inputs the kernel sees (Q rounded to float16, K and V
as stored in the cache: float16 or dequantized Q8_0) and computes softmax(QK^T * scale) V in
float64 with the causal mask, the sliding window and the sinks. What the kernel may differ
by is float32 arithmetic (dot products in vector lanes, exp in float32, accumulation over up
to 5000 keys): bounded here as |out - ref| <= 2e-5 + 2e-4 * max|V| (measured: below 3e-6
at depth 5000). Shapes cover depths 1..5000 (partial key tiles and query tiles), GQA group
sizes 1, 4 and 8, decode (split key ranges on the pool) and prefill, windows, sinks, the
latent ``vc is kc`` cache and the Q8_0 cache. On an AVX-512 host, the kernels' 16-lane form
(layout._SCORE_LANES) and their 8-lane form (a subprocess in AVX2 mode) must give the
same outputs bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_service.engine import attention
from moe_service.engine.attention import layout, planner, scores, values
from moe_service.engine.pool import WorkerPool
from moe_service.engine.quant import ir as qir


class _Ops:
    def __init__(self, pool):
        self.pool = pool


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(n_threads=None)
    yield p
    p.close()


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16)


def _cache(n_seq, n_ctx, nkv, d, fmt):
    if fmt == "f16":
        return np.zeros((n_seq, n_ctx, nkv, d), np.uint16)
    return np.zeros((n_seq, n_ctx, nkv, d // 32 * 34), np.uint8)


def _dequant(c, d):
    """float64 [S, C, NKV, d] of a cache in either format."""
    if c.dtype == np.uint16:
        return c.view(np.float16).astype(np.float64)[..., :d]
    S, C, H, rb = c.shape
    blocks = c.reshape(S, C, H, rb // 34, 34)
    scale = blocks[..., :2].copy().view(np.float16).astype(np.float64)  # [S, C, H, nb, 1]
    qs = blocks[..., 2:].view(np.int8).astype(np.float64)
    return (scale * qs).reshape(S, C, H, -1)[..., :d]


def reference(q, kc, vc, spans, scale, dv, window=0, sinks=None):
    """float64 attention over the cache contents (q rounded to float16)."""
    T, nh, d = q.shape
    nkv = kc.shape[2]
    group = nh // nkv
    K = _dequant(kc, d)
    V = _dequant(vc, dv)
    qf = _f16(q).astype(np.float64)
    out = np.zeros((T, nh, dv))
    for seq, a, e, n0 in spans:
        for t in range(a, e):
            p = n0 + t - a
            lo = max(0, p - window + 1) if window > 0 else 0
            for h in range(nh):
                g = h // group
                s = K[seq, lo:p + 1, g] @ qf[t, h] * scale
                mx = s.max()
                if sinks is not None:
                    mx = max(mx, float(sinks[h]))
                ex = np.exp(s - mx)
                den = ex.sum() + (np.exp(float(sinks[h]) - mx) if sinks is not None else 0.0)
                out[t, h] = ex @ V[seq, lo:p + 1, g] / den
    return out


def _run(pool, *, nh, nkv, d, dv, spans, n_ctx, fmt="f16", window=0, sinks=False, latent=False, seed=0,
         online=False):
    rng = np.random.default_rng(seed)
    n_seq = max(s for s, *_ in spans) + 1
    T = max(e for _, _, e, _ in spans)
    kc = _cache(n_seq, n_ctx, nkv, d, fmt)
    vc = kc if latent else _cache(n_seq, n_ctx, nkv, dv, fmt)
    # fill every sequence's history 0..n0-1 first (earlier steps), then this step's rows
    for seq, _a, _e, n0 in spans:
        if n0:
            k = rng.standard_normal((n0, nkv, d)).astype(np.float32)
            v = None if latent else rng.standard_normal((n0, nkv, dv)).astype(np.float32)
            attention.store(kc, vc, k, v, [(seq, 0, n0, 0)])
    k = rng.standard_normal((T, nkv, d)).astype(np.float32)
    v = None if latent else rng.standard_normal((T, nkv, dv)).astype(np.float32)
    attention.store(kc, vc, k, v, spans)
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    sk = (rng.standard_normal(nh) * 2).astype(np.float32) if sinks else None
    scale = 1.0 / np.sqrt(d)
    out = np.full((T, nh, dv), np.nan, np.float32)
    attention.attend(_Ops(pool), q, kc, vc, spans, scale, out, window=window, sinks=sk, online=online)
    ref = reference(q, kc, vc, spans, scale, dv, window, sk)
    rows = np.concatenate([np.arange(a, e) for _, a, e, _ in spans])
    err = np.abs(out[rows] - ref[rows]).max()
    vmax = np.abs(_dequant(vc, dv)).max()
    assert np.isfinite(out[rows]).all()
    # online: float32 arithmetic only; exact: plus the contract's float16 rounding of each
    # probability (unit roundoff 2^-11 of sum_j p_j |v_j| <= max|V|)
    bound = 2e-5 + (2e-4 if online else 2e-4 + 2.0**-11) * vmax
    assert err <= bound, f"max error {err} > {bound}"
    return out[rows]


MODES = [pytest.param(False, id="exact"), pytest.param(True, id="online")]


@pytest.mark.parametrize("online", MODES)
@pytest.mark.parametrize("depth", [1, 2, 31, 33, 127, 129, 1000, 5000])
def test_decode_depths(pool, depth, online):
    """One query row per sequence at cache depth ``depth`` (keys 0..depth-1), group 4."""
    _run(pool, nh=8, nkv=2, d=64, dv=64, spans=[(0, 0, 1, depth - 1)], n_ctx=depth, online=online)


@pytest.mark.parametrize("online", MODES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_groups_batched_decode_and_prefill(pool, group, online):
    """A mixed step: two decoders at different depths and a prefill chunk with history."""
    nkv = 2
    spans = [(0, 0, 1, 700), (1, 1, 2, 65), (2, 2, 102, 150)]
    _run(pool, nh=group * nkv, nkv=nkv, d=128, dv=128, spans=spans, n_ctx=900, seed=group, online=online)


@pytest.mark.parametrize("online", MODES)
@pytest.mark.parametrize("n", [1, 17, 64, 300])
def test_prefill_partial_tiles(pool, n, online):
    """A prompt from position 0 (query tiles and key tiles both partial)."""
    _run(pool, nh=4, nkv=1, d=64, dv=64, spans=[(0, 0, n, 0)], n_ctx=n, online=online)


@pytest.mark.parametrize("online", MODES)
def test_window_and_sinks(pool, online):
    _run(pool, nh=8, nkv=2, d=64, dv=64, spans=[(0, 0, 1, 3000), (1, 1, 90, 40)], n_ctx=3100,
         window=128, sinks=True, online=online)
    _run(pool, nh=8, nkv=2, d=64, dv=64, spans=[(0, 0, 40, 0)], n_ctx=64, window=7, sinks=True, online=online)


@pytest.mark.parametrize("online", MODES)
def test_latent_cache(pool, online):
    """MLA: one latent KV head (576 = 512 + 64 rope dims), 16 query heads, V = first 512 dims."""
    _run(pool, nh=16, nkv=1, d=576, dv=512, spans=[(0, 0, 1, 2000), (1, 1, 40, 10)], n_ctx=2100, latent=True,
         online=online)


@pytest.mark.parametrize("online", MODES)
@pytest.mark.parametrize("latent", [False, True])
def test_q8_0_cache(pool, latent, online):
    dv = 64 if latent else 128
    _run(pool, nh=8, nkv=2 if not latent else 1, d=128, dv=dv, spans=[(0, 0, 1, 1500), (1, 1, 50, 20)],
         n_ctx=1600, fmt="q8_0", latent=latent, online=online)


def test_exact_mode_matches_the_scalar_contract(pool):
    """The default (two-pass) mode against the former single-threaded scalar kernel
    (cpu_layers.attention, the contract written out): the same float16 probabilities, so
    only float32 summation order in the dot products separates them."""
    from moe_service.engine import cpu_layers

    rng = np.random.default_rng(7)
    nh, nkv, d, n0, n = 8, 2, 64, 900, 70
    kc = np.zeros((1, n0 + n, nkv, d), np.uint16)
    vc = np.zeros_like(kc)
    attention.store(kc, vc, rng.standard_normal((n0 + n, nkv, d)), rng.standard_normal((n0 + n, nkv, d)),
                    [(0, 0, n0 + n, 0)])
    q = rng.standard_normal((n, nh, d)).astype(np.float32)
    out = np.empty((n, nh, d), np.float32)
    attention.attend(_Ops(pool), q, kc, vc, [(0, 0, n, n0)], 0.125, out)
    ref = np.empty_like(out)
    kf = np.empty((n0 + n, nkv, d), np.float32)
    cpu_layers.attention(q, kc, vc, 0, n0, np.float32(0.125), ref, kf, kf.copy(), np.empty(n0 + n, np.float32))
    # a last-bit difference in a score moves a probability across a float16 rounding
    # boundary now and then (one float16 ulp of one p_j times v_j); everything else is equal
    diff = np.abs(out - ref)
    assert diff.max() < 2.0**-11 * 4
    assert (diff == 0).mean() > 0.5  # measured 0.84


def _ggml_dot(q, k, lanes):
    """ggml's float16 dot product order on AVX-512, in numpy float32: element i into lane
    i % lanes over the first n - n % lanes dims, lanes folded in halves, the rest in float64
    (ggml_vec_dot_f16: lanes 64; llamafile's tinyBLAS: lanes 16, n a multiple of 16)."""
    n = len(q) - len(q) % lanes
    acc = np.zeros(lanes, np.float32)
    for b in range(0, n, lanes):
        acc = (acc + q[b:b + lanes] * k[b:b + lanes]).astype(np.float32)
    while acc.size > 1:
        acc = (acc[:acc.size // 2] + acc[acc.size // 2:]).astype(np.float32)
    total = np.float64(acc[0])
    for i in range(n, len(q)):
        total += np.float64(np.float32(q[i] * k[i]))
    return np.float32(total)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 576])
def test_score_dot_products_sum_in_ggml_order(d):
    """The scores' dot products round exactly as ggml's (bit for bit): 64 lanes for a
    one-token step (wide), 16 lanes otherwise, from the float16 cache and from a float32 tile."""
    rng = np.random.default_rng(d)
    n = 21
    k16 = (rng.standard_normal((n, d)) * 3).astype(np.float16)
    q = rng.standard_normal(d).astype(np.float16).astype(np.float32)
    for wide in (True, False):
        if not wide and d % 16:
            continue
        want = np.array([_ggml_dot(q, k16[j].astype(np.float32), 64 if wide else 16) for j in range(n)], np.float32)
        for kb in (k16.view(np.uint16).reshape(-1), k16.astype(np.float32).reshape(-1)):
            s = np.empty(n, np.float32)
            mx = scores._score_keys(q, 0, kb, 0, d, s, 0, 0, n, d, np.float32(1.0), wide)
            assert np.array_equal(s, want), (d, wide, kb.dtype, np.abs(s - want).max())
            assert mx == want.max()


@pytest.mark.parametrize("tile", [False, True])
@pytest.mark.parametrize(("d", "nr"), [(d, nr) for d in (64, 128, 576) for nr in range(2, 7 if d == 576 else 5)])
def test_multi_row_scores_equal_one_row_scores(d, nr, tile):
    """The prefill K pass's rows-per-key kernels (2 to 4 rows, 2 to 6 at D = 576; 16 keys per
    call at D = 64, 128 and 576, then key by key) give the 16-lane scores bit for bit, over the float16 cache read in
    place (two KV heads per position: a key every 2 x D) and over a widened float32 tile."""
    rng = np.random.default_rng(d + nr)
    n, L = 27, 31  # keys 2..26: one call of 16 keys, then 9 one by one
    k16 = (rng.standard_normal((n, 2, d)) * 3).astype(np.float16)
    q = rng.standard_normal((nr, d)).astype(np.float16).astype(np.float32).reshape(-1)
    s = np.full(nr * L, np.nan, np.float32)
    mrow = np.full(nr, -np.inf, np.float32)
    if tile:
        kb, kstride = k16[:, 1].astype(np.float32).reshape(-1), d
    else:
        kb, kstride = k16.view(np.uint16).reshape(-1)[d:], 2 * d
    mrow[1] = 1e30  # a row whose maximum is already larger keeps it
    scores._score_keys4(q, 0, d, kb, 0, kstride, s, 0, L, 2, n, np.float32(0.5), mrow, 0, nr)
    k16 = k16[:, 1]
    for r in range(nr):
        want = np.array([_ggml_dot(q[r * d:(r + 1) * d], k16[j].astype(np.float32), 16) * np.float32(0.5)
                         for j in range(2, n)], np.float32)
        assert np.array_equal(s[r * L + 2:r * L + n], want), (d, r)
        assert mrow[r] == (np.float32(1e30) if r == 1 else want.max())


@pytest.mark.parametrize("gh", [2, 3, 5, 8, 9])
@pytest.mark.parametrize("d", [64, 128])
def test_group_decode_kernels_equal_row_kernels(d, gh):
    """A decode's group kernels (each key and value row read once for several heads) give the
    one-row kernels' scores and P.V bit for bit, partial blocks of eight keys included."""
    rng = np.random.default_rng(10 * d + gh)
    n, L, kstride = 45, 50, 2 * d  # keys 3..44 of a cache with two KV heads per position
    k16 = (rng.standard_normal((n, 2, d)) * 3).astype(np.float16)
    v16 = rng.standard_normal((n, 2, d)).astype(np.float16)
    q = rng.standard_normal((gh, d)).astype(np.float16).astype(np.float32).reshape(-1)
    kb, vb = k16.view(np.uint16).reshape(-1), v16.view(np.uint16).reshape(-1)
    s = np.full(gh * L, np.nan, np.float32)
    mrow = np.full(gh, -np.inf, np.float32)
    scores._score_heads_wide16(q, 0, gh, kb, d, kstride, s, 0, L, 3, n, d, np.float32(0.5), mrow, 0)
    p = np.zeros(gh * L, np.float32)
    acc_rows = rng.standard_normal(gh * d).astype(np.float32)
    acc_group = acc_rows.copy()
    for r in range(gh):
        want = np.empty(L, np.float32)
        mx = scores._score_keys(q, r * d, kb, d, kstride, want, 0, 3, n, d, np.float32(0.5), True)
        assert np.array_equal(s[r * L + 3:r * L + n], want[3:n]), (d, gh, r)
        assert mrow[r] == mx
        p[r * L + 3:r * L + n] = rng.random(n - 3).astype(np.float16)
        values._pv_exact(acc_rows, r * d, p, r * L, vb, d, kstride, 3, n, d)
    acc_six = acc_group.copy()
    values._pv_heads_f16(acc_group, 0, gh, p, 0, L, vb, d, kstride, 3, n, d)
    assert np.array_equal(acc_group, acc_rows), (d, gh)
    # six rows per value read (a prefill's float32 tile of a latent cache): the same sums
    tile = v16[:, 1].astype(np.float32).reshape(-1)
    acc_tile = acc_six.copy()
    for r in range(gh):
        values._pv_exact(acc_tile, r * d, p, r * L, tile, 0, d, 3, n, d)
    values._pv_heads_f16(acc_six, 0, gh, p, 0, L, tile, 0, d, 3, n, d, True)
    assert np.array_equal(acc_six, acc_tile), (d, gh)


@pytest.mark.parametrize("n", [8, 13, 16])
def test_latent_scores_equal_row_scores(n):
    """A latent (MLA, D = 576) decode's scores, each key widened once for all the heads, are
    the one-row kernel's bit for bit (a partial block of eight keys included)."""
    d, gh, L, kstride = 576, 9, 20, 576
    rng = np.random.default_rng(n)
    k16 = (rng.standard_normal((n + 2, d)) * 3).astype(np.float16)
    q = rng.standard_normal((gh, d)).astype(np.float16).astype(np.float32).reshape(-1)
    kb = k16.view(np.uint16).reshape(-1)
    s = np.full(gh * L, np.nan, np.float32)
    mrow = np.full(gh, -np.inf, np.float32)
    scores._score_latent(q, 0, gh, kb, 0, kstride, s, 0, L, 2, n + 2, d, np.float32(0.5), mrow, 0,
                         np.empty(8 * d, np.float32))
    for r in range(gh):
        want = np.empty(L, np.float32)
        mx = scores._score_keys(q, r * d, kb, 0, kstride, want, 0, 2, n + 2, d, np.float32(0.5), True)
        assert np.array_equal(s[r * L + 2:r * L + n + 2], want[2:n + 2]), r
        assert mrow[r] == mx


def test_q8_0_matches_ggml_rounding():
    """Q8_0 rows as ggml's quantize_row_q8_0_ref: d = amax/127 (float16), q = roundf(x/d)."""
    x = np.array([0.5, -1.27, 2.54, -2.54] + [0.0] * 27 + [1.905], np.float32)
    dst = np.zeros(34, np.uint8)
    attention.quantize_row_q8_0(x, dst, 0)
    d = np.float32(2.54) / np.float32(127)
    assert dst[:2].view(np.float16)[0] == np.float16(d)
    qs = dst[2:].view(np.int8)
    inv = np.float32(1) / d
    expect = [int(np.sign(v) * np.floor(abs(np.float32(v * inv)) + 0.5)) for v in x]
    assert qs.tolist() == expect


def test_serial_without_pool():
    """No pool (ops None): the calling thread runs every task; same results."""
    rng = np.random.default_rng(3)
    kc = np.zeros((1, 300, 2, 64), np.uint16)
    vc = np.zeros_like(kc)
    attention.store(kc, vc, rng.standard_normal((300, 2, 64)), rng.standard_normal((300, 2, 64)), [(0, 0, 300, 0)])
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    out = np.empty((1, 4, 64), np.float32)
    attention.attend(None, q, kc, vc, [(0, 0, 1, 299)], 0.125, out)
    ref = reference(q, kc, vc, [(0, 0, 1, 299)], 0.125, 64)
    assert np.abs(out - ref).max() < 1e-4


def test_bad_shapes_are_refused():
    kc = np.zeros((1, 8, 2, 64), np.uint16)
    q = np.zeros((1, 4, 64), np.float32)
    out = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(ValueError, match="outside"):
        attention.attend(None, q, kc, kc.copy(), [(0, 0, 1, 8)], 1.0, out)
    with pytest.raises(ValueError, match="do not agree"):
        attention.attend(None, np.zeros((1, 3, 64), np.float32), kc, kc.copy(), [(0, 0, 1, 0)], 1.0,
                         np.zeros((1, 3, 64), np.float32))
    with pytest.raises(ValueError, match="v is None"):
        attention.store(kc, kc.copy(), np.zeros((1, 2, 64), np.float32), None, [(0, 0, 1, 0)])
    # every check holds on the second call with the same shapes too (attend keeps a checked
    # op template per shape: only the shapes it accepted are cached)
    for _ in range(2):
        with pytest.raises(ValueError, match="do not agree"):
            attention.attend(None, np.zeros((1, 3, 64), np.float32), kc, kc.copy(), [(0, 0, 1, 0)], 1.0,
                             np.zeros((1, 3, 64), np.float32))
        attention.attend(None, q, kc, kc.copy(), [(0, 0, 1, 0)], 1.0, out)  # accepted, then cached
        with pytest.raises(ValueError, match="do not agree"):  # out rows != q rows
            attention.attend(None, q, kc, kc.copy(), [(0, 0, 1, 0)], 1.0, np.zeros((2, 4, 64), np.float32))
        with pytest.raises(ValueError, match="3 sinks for 4 heads"):
            attention.attend(None, q, kc, kc.copy(), [(0, 0, 1, 0)], 1.0, out, sinks=np.zeros(3, np.float32))
        with pytest.raises(ValueError, match="outside"):
            attention.attend(None, q, kc, kc.copy(), [[0, 0, 1, 8]], 1.0, out)  # rows as lists: not cached
        with pytest.raises(ValueError, match="neither float16"):
            attention.attend(None, q, kc.astype(np.int32), kc.astype(np.int32), [(0, 0, 1, 0)], 1.0, out)
        wide = np.zeros((1, 8, 2, 128), np.uint16)
        with pytest.raises(ValueError, match="C-contiguous"):
            attention.attend(None, q, wide[:, :, :, :64], kc.copy(), [(0, 0, 1, 0)], 1.0, out)


@pytest.mark.parametrize("online", MODES)
def test_single_latent_decode_is_split_over_workers(pool, online):
    """One decoding sequence with one latent KV head: fewer tasks than workers, so the
    planner splits its key range (default mode: K parts, normalise, V parts, combine; online:
    parts and a merge)."""
    if online:
        assert attention.plan_tasks([(0, 0, 1, 2999)], 16, max(2, pool.n_workers), n_kv=1)[0][-1] > 1
    else:
        tasks, meta, n_direct, *_ = planner._plan_exact(np.array([[0, 0, 1, 2999]]), 16, 1, max(2, pool.n_workers),
                                                        0, attention.QUERY_ROWS, attention.SCORE_BUDGET,
                                                        attention.MIN_SPLIT_KEYS)
        assert n_direct == 0 and meta.shape[0] == 1 and tasks.shape[0] == meta[0, 6] > 1
    _run(pool, nh=16, nkv=1, d=576, dv=512, spans=[(0, 0, 1, 2999)], n_ctx=3000, latent=True, online=online)


# Shapes whose kernels depend on the vector width (layout._SCORE_LANES): prefill scores of
# 2-4 heads x 16 keys and P.V of up to 4 heads (D 64 and 128, GQA 3 and 8 with a partial
# group), group decode scores (D 64 and 128), the latent cache's tile (D 576), windows,
# sinks, a Q8_0 cache; depths off every tile grid.
_WIDTH_CASES = [
    dict(nh=8, nkv=1, d=128, dv=128, spans=[(0, 0, 1, 700), (1, 1, 70, 333)], n_ctx=800),
    dict(nh=9, nkv=3, d=64, dv=64, spans=[(0, 0, 1, 301), (1, 1, 45, 77)], n_ctx=400),
    dict(nh=10, nkv=2, d=128, dv=128, spans=[(0, 0, 37, 250)], n_ctx=300, window=100, sinks=True),
    dict(nh=16, nkv=1, d=576, dv=512, spans=[(0, 0, 1, 500), (1, 1, 20, 10)], n_ctx=600, latent=True),
    dict(nh=8, nkv=2, d=128, dv=128, spans=[(0, 0, 1, 400), (1, 1, 30, 20)], n_ctx=500, fmt="q8_0"),
]


def digest_outputs() -> str:
    """sha256 of the attend outputs of _WIDTH_CASES (one worker: the same plan in any
    process, whatever CPUs it may use), bit for bit."""
    from moe_service.engine.pool import WorkerPool

    p = WorkerPool(n_threads=1)
    try:
        outs = [_run(p, seed=40 + i, **case) for i, case in enumerate(_WIDTH_CASES)]
        return hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()
    finally:
        p.close()


@pytest.mark.skipif(not qir._AVX512, reason="this host runs the 8-lane code already")
def test_8_and_16_lane_kernels_give_the_same_outputs(tmp_path):
    """The 16-lane kernels (this AVX-512 host) and the 8-lane ones (a subprocess with
    MOE_SERVICE_KERNEL_ISA=avx2 and its own numba cache) give the same attention outputs bit
    for bit: the lane a product is summed into is fixed by the contract, not by the width."""
    env = dict(os.environ, MOE_SERVICE_KERNEL_ISA="avx2", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(attention.__file__).parents[3]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, __file__], env=env, timeout=600, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["lanes"] == 8
    assert layout._SCORE_LANES == 16
    assert got["digest"] == digest_outputs()


if __name__ == "__main__":
    print(json.dumps({"lanes": layout._SCORE_LANES, "digest": digest_outputs()}))
