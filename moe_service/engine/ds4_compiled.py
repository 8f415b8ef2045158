"""Compiled (numba) forms of DeepSeek V4's per-layer work outside the matmuls, each the
formula of its numpy reference in :mod:`moe_service.engine.ds4_ops` /
:mod:`moe_service.engine.arch.deepseek4` (tests/moe_service/engine/arch/test_ds4_compiled.py
compares them): the attention over the raw window plus the selected compressed rows
(:func:`attend_rows`, reference ``ds4_ops.attend_sinks`` on the concatenated keys), the
hyper-connection pre / post mixes (:func:`hc_pre`, :func:`hc_post`; references
``ds4_ops.hc_pre`` / ``ds4_ops.hc_post``) and q's per-head rms, rope and float16 rounding
(:func:`heads_inplace`). The lightning indexer is in :mod:`moe_service.engine.ds4_indexer`.

Every kernel computes a row (a token, a (token, head) pair) by the same code and in the same
order whatever the number of rows in the step and whichever worker runs it, so a prompt's
logits do not depend on how it was chunked (prefill, decode, and the prefix cache's restored
state agree). Where the reference sums in float64 through BLAS (its order is BLAS's), the
kernels sum in float64 in a fixed order (hc mixes, indexer scores: equal after rounding to
float32 but for rare last-bit differences), except the attention, which works as llama.cpp's
CPU flash path does (float16 keys, float32 dot products of 16 fixed lanes,
quant.ir.dot_f32_ggml) with a float64 softmax: within ~1e-6 relative of the float64
reference.

Shapes: T tokens, NH heads, D head dim, C streams, H hidden, M = (2 + C) C mixes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit

from moe_service.engine import pool as _pool
from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits
from moe_service.engine.ds4_ops import _rms_rows, _rope_last_rows, _sinkhorn_iters
from moe_service.engine.quant.ir import (
    dot4_f32_ggml,
    dot_f32_ggml,
    mix_rows_f64,
    view_f32,
    view_i64,
    view_u8,
    wsum4x16_f32,
)

_F64 = ir.DoubleType()
_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}
_POOL_MIN_MACS = 1 << 21  # below this an attention step runs on the calling thread


# ---------------------------------------------------------------------------------------
# attention over the window + the selected compressed rows


@njit(**_JIT)
def _gather_keys(win16, comp16, mask_w, mask_c, keys, cols, ncols):
    """Keys used by any query, as float32 rows (window rows first, then compressed rows, each
    in index order); per query t its key rows ``cols[t, :ncols[t]]`` in the reference's column
    order (window then compressed). Returns the number of key rows written to ``keys``."""
    T, Nw = mask_w.shape
    Nc = mask_c.shape[1]
    D = win16.shape[1]
    where = np.full(Nw + Nc, -1, np.int64)
    n = 0
    for j in range(Nw + Nc):
        used = False
        for t in range(T):
            if mask_w[t, j] if j < Nw else mask_c[t, j - Nw]:
                used = True
                break
        if used:
            where[j] = n
            for d in range(D):
                keys[n, d] = _f16_bits_to_f32(win16[j, d] if j < Nw else comp16[j - Nw, d])
            n += 1
    for t in range(T):
        c = 0
        for j in range(Nw + Nc):
            if mask_w[t, j] if j < Nw else mask_c[t, j - Nw]:
                cols[t, c] = where[j]
                c += 1
        ncols[t] = c
    return n


@njit(**_JIT)
def _attend_range(q, keys8, keys, cols, ncols, sinks, scale, out, r0, r1):
    """Rows r0..r1 of (token t, head h) = (r // NH, r % NH): softmax with a sink logit over
    the query's key rows, the same rows as values. q, out float32 [T * NH * D]; keys float32
    [N, D] (keys8: its bytes). Per token the heads of the range go in blocks of _HEAD_BLOCK,
    key by key (a key row is read once per block and pass, not once per head, and the block's
    q rows and value sums stay in L1); each (t, h) row is computed in the
    same order whatever the range: score of key i = float32 dot of 16 fixed lanes
    (dot_f32_ggml) x scale in float64, float64 softmax with the sink, value sum in float32
    over the keys in order."""
    NH = sinks.shape[0]
    D = keys.shape[1]
    r = r0
    while r < r1:
        t, h0 = r // NH, r % NH
        nh = min(NH - h0, r1 - r)
        n = ncols[t]
        s = np.empty((nh, max(1, n)), np.float64)
        m = np.empty(nh, np.float64)
        den = np.empty(nh, np.float64)
        acc = np.zeros((nh, D), np.float32)
        n1 = max(1, n)
        pw = np.empty((nh, n1), np.float32)  # the softmax weights as float32, as each value sum uses them
        pw_flat = pw.reshape(-1)
        if (
            D % 16 == 0 and nh >= 4
        ):  # the token's keys by 16 dims (chunk-major): a chunk's keys are contiguous
            kc = np.empty(D * n1, np.float32)
            iota = np.arange(n1)
            for c in range(D // 16):
                for i in range(n):
                    ro = cols[t, i]
                    for e in range(16):
                        kc[(c * n1 + i) * 16 + e] = keys[ro, c * 16 + e]
        else:
            kc = np.empty(1, np.float32)
            iota = np.arange(1)
        for k0 in range(0, nh, _HEAD_BLOCK):  # a block's q rows and value sums stay in L1
            k1 = min(nh, k0 + _HEAD_BLOCK)
            for k in range(k0, k1):
                m[k] = np.float64(sinks[h0 + k])
            for i in range(n):
                off = cols[t, i] * D * 4
                k = k0
                while k + 4 <= k1:  # four heads against the key at once: the same dots, interleaved
                    d0, d1, d2, d3 = dot4_f32_ggml(keys8, off, 0, q, (r + k) * D, D, D)
                    for u, dv in enumerate((d0, d1, d2, d3)):
                        v = np.float64(dv) * scale
                        s[k + u, i] = v
                        if v > m[k + u]:
                            m[k + u] = v
                    k += 4
                while k < k1:
                    v = np.float64(dot_f32_ggml(keys8, off, q, (r + k) * D, D)) * scale
                    s[k, i] = v
                    if v > m[k]:
                        m[k] = v
                    k += 1
            for k in range(k0, k1):
                tot = 0.0
                for i in range(n):
                    e = np.exp(s[k, i] - m[k])
                    s[k, i] = e
                    tot += e
                den[k] = tot + np.exp(np.float64(sinks[h0 + k]) - m[k])
            for k in range(k0, k1):
                for i in range(n):
                    pw[k, i] = np.float32(s[k, i] / den[k])
            k = k0
            if D % 16 == 0:  # four heads x 16 dims of value sums in registers over the keys
                while k + 4 <= k1:
                    for c in range(D // 16):
                        wsum4x16_f32(
                            kc, iota, 0, n, 16, c * n1 * 16, pw_flat, k * n1, n1, out, (r + k) * D + c * 16, D
                        )
                    k += 4
            for i in range(n):
                row = cols[t, i]
                for kk in range(k, k1):
                    p = pw[kk, i]
                    for d in range(D):
                        acc[kk, d] += p * keys[row, d]
            for kk in range(k, k1):
                for d in range(D):
                    out[(r + kk) * D + d] = acc[kk, d]
        r += nh


_HEAD_BLOCK = 8  # heads of a token computed together: their q rows and value sums (8 x 2 KB) stay in L1
_KEY_BLOCK = 64  # one token's scores: keys of a block (64 x 2 KB) stay in L2 while every head dots them
_ONE_HEADS = 16  # one token on the pool: heads per item (2 items per worker at 64 heads, 2 workers)


@njit(**_JIT)
def _attend_one_range(q, keys8, keys, kc, sinks, scale, out, h0, h1):
    """Heads h0..h1 of one token against every key row of ``keys`` float32 [n, D] in order
    (a decode step: rows 0..n-1 are the token's keys), the same arithmetic as
    :func:`_attend_range` for T = 1 and cols = 0..n-1, bit for bit: a score is the same
    float32 dot (dot4_f32_ggml equals dot_f32_ggml) x scale in float64, the max over the
    keys in order, the same float64 softmax, the float32 value sums over the keys in order
    (wsum4x16_f32, or the plain loop for the heads past a multiple of 4 and dims not a
    multiple of 16). Only the loop order differs: scores by blocks of _KEY_BLOCK keys (a
    block read from memory once for every head of the range, not once per 8 heads), value
    sums by 16 dims for every head (the keys' 16-dim column, contiguous in kc, read from L2
    for each 4 heads). q, out float32 [NH * D]; keys8: keys' bytes; kc float32 [D * n]: the
    keys chunk-major (kc[(c * n + i) * 16 + l] = keys[i, c * 16 + l]; read when D % 16 == 0),
    made once by the caller (:func:`_gather_rows`) for every range."""
    n, D = keys.shape
    nh = h1 - h0
    n1 = max(1, n)
    s = np.empty((nh, n1), np.float64)
    m = np.empty(nh, np.float64)
    pw = np.empty((nh, n1), np.float32)  # the softmax weights as float32, as each value sum uses them
    pw_flat = pw.reshape(-1)
    iota = np.arange(n1)
    for k in range(nh):
        m[k] = np.float64(sinks[h0 + k])
    nh4 = nh // 4 * 4
    for b0 in range(0, n, _KEY_BLOCK):
        b1 = min(n, b0 + _KEY_BLOCK)
        for k in range(0, nh4, 4):  # four heads against each key of the block: the same dots
            for i in range(b0, b1):
                d0, d1, d2, d3 = dot4_f32_ggml(keys8, i * D * 4, 0, q, (h0 + k) * D, D, D)
                for u, dv in enumerate((d0, d1, d2, d3)):
                    v = np.float64(dv) * scale
                    s[k + u, i] = v
                    if v > m[k + u]:
                        m[k + u] = v
        for k in range(nh4, nh):
            for i in range(b0, b1):
                v = np.float64(dot_f32_ggml(keys8, i * D * 4, q, (h0 + k) * D, D)) * scale
                s[k, i] = v
                if v > m[k]:
                    m[k] = v
    for k in range(nh):
        tot = 0.0
        for i in range(n):
            e = np.exp(s[k, i] - m[k])
            s[k, i] = e
            tot += e
        den = tot + np.exp(np.float64(sinks[h0 + k]) - m[k])
        for i in range(n):
            pw[k, i] = np.float32(s[k, i] / den)
    k_plain = 0
    if D % 16 == 0:  # four heads x 16 dims of value sums in registers over the keys
        k_plain = nh4
        for c in range(D // 16):
            for k in range(0, nh4, 4):
                wsum4x16_f32(
                    kc, iota, 0, n, 16, c * n * 16, pw_flat, k * n1, n1, out, (h0 + k) * D + c * 16, D
                )
    if k_plain < nh:
        acc = np.zeros((nh - k_plain, D), np.float32)
        for i in range(n):
            for kk in range(k_plain, nh):
                p = pw[kk, i]
                for d in range(D):
                    acc[kk - k_plain, d] += p * keys[i, d]
        for kk in range(k_plain, nh):
            for d in range(D):
                out[(h0 + kk) * D + d] = acc[kk - k_plain, d]


(A_Q, A_KEYS, A_NKEYS, A_D, A_COLS, A_NCOL_W, A_NCOLS, A_SINKS, A_NH, A_SCALE, A_OUT, A_T, A_LEN) = range(13)


def _attend_item(items_ptr, i, op_ptr):
    """Rows [it[2], it[3]) of a pooled attend_rows (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, A_LEN)
    b = i * _pool.ITEM_W
    T, NH, D, N, W = op[A_T], op[A_NH], op[A_D], op[A_NKEYS], op[A_NCOL_W]
    q = view_f32(op[A_Q], T * NH * D)
    keys_flat = view_f32(op[A_KEYS], N * D)
    keys8 = view_u8(op[A_KEYS], N * D * 4)
    cols = view_i64(op[A_COLS], T * W).reshape((T, W))
    ncols = view_i64(op[A_NCOLS], T)
    sinks = view_f32(op[A_SINKS], NH)
    out = view_f32(op[A_OUT], T * NH * D)
    sc = np.float64(view_f32(op[A_SCALE], 1)[0])
    _attend_range(q, keys8, keys_flat.reshape((N, D)), cols, ncols, sinks, sc, out, it[b + 2], it[b + 3])


def _attend_address() -> int:
    return _pool.call_item_address(_attend_item)


def _attend_one_item(items_ptr, i, op_ptr):
    """Heads [it[2], it[3]) of a pooled one-token attention (a K_CALL item, pool.CALL_ITEM_SIG;
    the op array of _attend_keys, T = 1, the keys rows 0..n-1 in order)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, A_LEN)
    b = i * _pool.ITEM_W
    NH, D, N = op[A_NH], op[A_D], op[A_NKEYS]
    q = view_f32(op[A_Q], NH * D)
    keys_flat = view_f32(op[A_KEYS], N * D)
    keys8 = view_u8(op[A_KEYS], N * D * 4)
    kc = view_f32(op[A_COLS], N * D)  # (A_COLS: the chunk-major keys; a one-token step has no cols)
    sinks = view_f32(op[A_SINKS], NH)
    out = view_f32(op[A_OUT], NH * D)
    sc = np.float64(view_f32(op[A_SCALE], 1)[0])
    _attend_one_range(q, keys8, keys_flat.reshape((N, D)), kc, sinks, sc, out, it[b + 2], it[b + 3])


def _attend_one_keys(
    q: np.ndarray, keys: np.ndarray, kc: np.ndarray, sinks: np.ndarray, scale: float, pool: Any
) -> np.ndarray:
    """One token's attention over every row of keys float32 [n, D] (C-contiguous), in order:
    :func:`_attend_keys` with T = 1 and cols = 0..n-1, bit for bit (:func:`_attend_one_range`;
    kc float32 [D * n] the same keys chunk-major). q float32 [1, NH, D]. On the pool, in items
    of _ONE_HEADS heads, when big enough."""
    _, NH, D = q.shape
    n = keys.shape[0]
    qf = np.ascontiguousarray(q, dtype=np.float32).reshape(-1)
    out = np.empty(NH * D, np.float32)
    s32 = np.ascontiguousarray(sinks, dtype=np.float32)
    n_workers = pool.n_workers if pool is not None else 1
    if n_workers > 1 and NH > 1 and n * NH * D >= _POOL_MIN_MACS:
        scale_words = np.array([scale], np.float32)
        op = np.zeros(A_LEN, np.int64)
        op[A_Q], op[A_KEYS], op[A_NKEYS], op[A_D], op[A_NH] = qf.ctypes.data, keys.ctypes.data, n, D, NH
        op[A_COLS] = kc.ctypes.data
        op[A_SINKS], op[A_SCALE], op[A_OUT], op[A_T] = (
            s32.ctypes.data,
            scale_words.ctypes.data,
            out.ctypes.data,
            1,
        )
        # items of whole 4-head groups, at least one per worker
        step = max(4, min(_ONE_HEADS, -(-NH // n_workers) // 4 * 4))
        fn = _pool.call_item_address(_attend_one_item)
        items = [(_pool.K_CALL, fn, h, min(NH, h + step)) for h in range(0, NH, step)]
        job = _pool.Job.build([_pool._spread(items, pool.n_nodes)], op)
        pool.run_arrays(job.items, job.bounds, job.op)
    else:
        _attend_one_range(
            qf, keys.reshape(-1).view(np.uint8), keys, kc, s32, np.float64(np.float32(scale)), out, 0, NH
        )
    return out.reshape(1, NH, D)


def attend_rows(
    q: np.ndarray,
    win: np.ndarray,
    comp: np.ndarray | None,
    mask_w: np.ndarray,
    mask_c: np.ndarray | None,
    sinks: np.ndarray,
    scale: float,
    pool: Any = None,
) -> np.ndarray:
    """Softmax attention with one shared K = V head and a sink logit per head over the raw
    window rows and the compressed rows (deepseek4's attention; llama.cpp
    src/models/deepseek4.cpp, the KV of llama-kv-cache-dsv4.cpp).

    q float32 [T, NH, D] (already rounded to float16 by the caller, as the reference's
    caller does); win float16 [Nw, D] (the window's rows: ring then the step's new rows);
    comp float16 [Nc, D] or None (the slot's compressed rows); mask_w bool [T, Nw], mask_c
    bool [T, Nc] (True = attend); sinks float32 [NH]; scale: the softmax scale (1/sqrt(D)).
    Returns float32 [T, NH, D], the reference ``ds4_ops.attend_sinks(q,
    concat(win, comp), concat(mask_w, mask_c), sinks, scale)`` within ~1e-6 relative (float32
    dots of 16 fixed lanes and float32 value sums where it uses float64). ``pool``: a
    WorkerPool to spread the (token, head) rows over when the step is big enough (the same
    result bit for bit). ``scale`` is used as float32 (1/sqrt(512) rounded: 3e-8 relative).
    ValueError for shapes that do not agree."""
    T, NH, D = q.shape
    if comp is None:
        comp = np.zeros((0, D), np.float16)
        mask_c = np.zeros((T, 0), np.bool_)
    assert mask_c is not None
    if (
        win.ndim != 2
        or win.shape[1] != D
        or comp.shape[1:] != (D,)
        or mask_w.shape != (T, win.shape[0])
        or mask_c.shape != (T, comp.shape[0])
        or sinks.shape != (NH,)
    ):
        raise ValueError(
            f"attend_rows: q {q.shape}, window {win.shape}, compressed {comp.shape}, masks "
            f"{mask_w.shape} / {mask_c.shape}, sinks {sinks.shape} do not agree"
        )
    win16 = np.ascontiguousarray(win, dtype=np.float16).view(np.uint16)
    comp16 = np.ascontiguousarray(comp, dtype=np.float16).view(np.uint16)
    mw, mc = np.ascontiguousarray(mask_w, dtype=np.bool_), np.ascontiguousarray(mask_c, dtype=np.bool_)
    width = max(1, win.shape[0] + comp.shape[0])
    keys = np.empty((width, D), np.float32)
    cols = np.zeros((T, width), np.int64)
    ncols = np.zeros(T, np.int64)
    n_keys = _gather_keys(win16, comp16, mw, mc, keys, cols, ncols)
    del n_keys
    return _attend_keys(q, keys, cols, ncols, sinks, scale, pool)


def _attend_keys(q, keys, cols, ncols, sinks, scale, pool):
    """attend_rows' kernel over gathered keys: q [T, NH, D], keys float32 [N, D], per token t
    its key rows cols[t, :ncols[t]] (int64 [T, W], [T]). On the pool when big enough."""
    T, NH, D = q.shape
    width = cols.shape[1]
    qf = np.ascontiguousarray(q, dtype=np.float32).reshape(-1)
    out = np.empty(T * NH * D, np.float32)
    s32 = np.ascontiguousarray(sinks, dtype=np.float32)
    n_workers = pool.n_workers if pool is not None else 1
    if n_workers > 1 and T * NH > 1 and int(ncols.sum()) * NH * D >= _POOL_MIN_MACS:
        scale_words = np.array([scale], np.float32)
        op = np.zeros(A_LEN, np.int64)
        op[A_Q], op[A_KEYS], op[A_NKEYS], op[A_D] = qf.ctypes.data, keys.ctypes.data, keys.shape[0], D
        op[A_COLS], op[A_NCOL_W], op[A_NCOLS] = cols.ctypes.data, width, ncols.ctypes.data
        op[A_SINKS], op[A_NH], op[A_SCALE], op[A_OUT], op[A_T] = (
            s32.ctypes.data,
            NH,
            scale_words.ctypes.data,
            out.ctypes.data,
            T,
        )
        rows = T * NH
        step = max(1, -(-rows // n_workers))  # one range of heads per worker: each reads the keys once
        if T > 1:  # whole tokens, ~4 items per worker: the pool balances a worker that is held up
            step = NH * max(1, -(-T // (4 * n_workers)))
        fn = _attend_address()
        items = [(_pool.K_CALL, fn, r, min(rows, r + step)) for r in range(0, rows, step)]
        job = _pool.Job.build([_pool._spread(items, pool.n_nodes)], op)
        pool.run_arrays(job.items, job.bounds, job.op)
    else:
        _attend_range(
            qf,
            keys.reshape(-1).view(np.uint8),
            keys,
            cols,
            ncols,
            s32,
            np.float64(np.float32(scale)),
            out,
            0,
            T * NH,
        )
    return out.reshape(T, NH, D)


@njit(**_JIT)
def _round_f16_rows(x, out):
    """out = float32(float16(x)) elementwise (IEEE nearest even, as numpy's astype), flat."""
    for i in range(x.shape[0]):
        out[i] = _f16_bits_to_f32(_f32_to_f16_bits(x[i]))


def round_f16(x: np.ndarray) -> np.ndarray:
    """``x.astype(float16).astype(float32)`` compiled (numpy's float16 casts are scalar: 0.16
    ms for a decode step's 64 x 512 query values). x float32 (any shape) -> float32, same shape."""
    xc = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(xc)
    _round_f16_rows(xc.reshape(-1), out.reshape(-1))
    return out


@njit(**_JIT)
def _gather_rows(ring16, lo, n0, new16, comp16, sel, keys, kc, r0, r1):
    """Rows r0..r1 of one token's keys as float32 rows in attend_rows' column order: row
    i < n0 - lo is the window's ring row of position lo + i (position p at ring row p % W),
    row n0 - lo the token's own row, then the compressed rows sel[i - (n0 - lo + 1)]
    (ascending); keys float32 [n, D], and when D % 16 == 0 also chunk-major into kc float32
    [D * n] (kc[(c * n + i) * 16 + l] = keys[i, c * 16 + l], the value sums' layout). Row
    ranges are independent: ds4_decode.attend_one gathers them on several workers."""
    W, D = ring16.shape
    n = keys.shape[0]
    nw = n0 - lo
    for i in range(r0, r1):
        if i < nw:
            src = ring16[(lo + i) % W]
        elif i == nw:
            src = new16
        else:
            src = comp16[sel[i - nw - 1]]
        for d in range(D):
            keys[i, d] = _f16_bits_to_f32(src[d])
        if D % 16 == 0:
            for c in range(D // 16):
                for e in range(16):
                    kc[(c * n + i) * 16 + e] = keys[i, c * 16 + e]


def attend_one(
    q: np.ndarray,
    ring: np.ndarray,
    lo: int,
    n0: int,
    new: np.ndarray,
    comp: np.ndarray | None,
    sel: np.ndarray | None,
    sinks: np.ndarray,
    scale: float,
    pool: Any = None,
) -> np.ndarray:
    """:func:`attend_rows` for one token at position n0 (a decode step), reading the window
    in place: the same keys in the same order, so the same result bit for bit as
    ``attend_rows(q, concat(ring rows of positions lo .. n0 - 1, new), comp, all-True mask,
    mask of sel, ...)``. q float32 [1, NH, D] (rounded to float16 values); ring float16
    [W, D], the slot's ring (position p at row p % W; lo >= n0 - W + 1); new float16 [D],
    the token's own row; comp float16 [Nc, D] or None; sel int64 ascending indices into
    comp (None: every row). Returns float32 [1, NH, D]. ValueError for shapes that do not
    agree."""
    T, NH, D = q.shape
    if comp is None:
        comp = np.zeros((0, D), np.float16)
    idx = (
        np.arange(comp.shape[0], dtype=np.int64) if sel is None else np.ascontiguousarray(sel, dtype=np.int64)
    )
    W = ring.shape[0]
    if (
        T != 1
        or ring.ndim != 2
        or ring.shape[1] != D
        or new.shape != (D,)
        or comp.shape[1:] != (D,)
        or sinks.shape != (NH,)
        or not (max(0, n0 - W + 1) <= lo <= n0)
    ):
        raise ValueError(
            f"attend_one: q {q.shape}, ring {ring.shape}, new {new.shape}, compressed {comp.shape}, "
            f"window {lo}..{n0}, sinks {sinks.shape} do not agree"
        )
    if idx.size and (idx.min() < 0 or idx.max() >= comp.shape[0]):
        raise ValueError(f"attend_one: selected rows {idx.min()}..{idx.max()} outside {comp.shape[0]}")
    n = n0 - lo + 1 + idx.shape[0]
    keys = np.empty((n, D), np.float32)
    kc = np.empty(n * D if D % 16 == 0 else 1, np.float32)
    _gather_rows(
        ring.view(np.uint16),
        lo,
        n0,
        np.ascontiguousarray(new, dtype=np.float16).view(np.uint16),
        np.ascontiguousarray(comp, dtype=np.float16).view(np.uint16),
        idx,
        keys,
        kc,
        0,
        n,
    )
    return _attend_one_keys(q, keys, kc, sinks, scale, pool)


# ---------------------------------------------------------------------------------------
# the query heads and the output's inverse rope, multi-token steps


@njit(**_JIT)
def _heads_rows(x, pos, cos, sin, eps, mode, t0, t1):
    """Tokens t0..t1 of x float32 [T, NH, D] in place. mode 0 (the queries): per head
    ds4_ops.rms (no weight), then ds4_ops.rope_last on the last dims, then rounded to float16
    and back (as attention's caller rounds q); mode 1 (the output): the inverse rope only.
    The same functions as the references (_rms_rows, _rope_last_rows), row by row."""
    T, NH, D = x.shape
    xs = x[t0:t1]
    if mode == 0:
        flat = xs.reshape(((t1 - t0) * NH, D))
        _rms_rows(flat, eps, flat)  # a row's sum of squares is taken before it is written
        _rope_last_rows(xs, pos[t0:t1], cos, sin, False)
        for r in range(flat.shape[0]):
            for d in range(D):
                flat[r, d] = _f16_bits_to_f32(_f32_to_f16_bits(flat[r, d]))
    else:
        _rope_last_rows(xs, pos[t0:t1], cos, sin, True)


@njit(**_JIT)
def _group_rows(x, out, t0, t1):
    """Tokens t0..t1 of x float32 [T, NH, D] copied group-major into out float32
    [G, T, NH // G * D]: out[g, t] = the heads g * NH // G .. of token t, back to back."""
    T, NH, D = x.shape
    G = out.shape[0]
    hg = NH // G
    for t in range(t0, t1):
        for g in range(G):
            for h in range(hg):
                for d in range(D):
                    out[g, t, h * D + d] = x[t, g * hg + h, d]


(E_X, E_POS, E_COS, E_SIN, E_EPS, E_MODE, E_T, E_NH, E_D, E_NCTX, E_HALF, E_GOUT, E_G, E_LEN) = range(14)


def _heads_item(items_ptr, i, op_ptr):
    """Tokens [it[2], it[3]) of a pooled :func:`heads_inplace` (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, E_LEN)
    b = i * _pool.ITEM_W
    T, NH, D, n_ctx, half = op[E_T], op[E_NH], op[E_D], op[E_NCTX], op[E_HALF]
    x = view_f32(op[E_X], T * NH * D).reshape((T, NH, D))
    pos = view_i64(op[E_POS], T)
    cos = view_f32(op[E_COS], n_ctx * half).reshape((n_ctx, half))
    sin = view_f32(op[E_SIN], n_ctx * half).reshape((n_ctx, half))
    eps = view_f32(op[E_EPS], 2).view(np.float64)[0]
    _heads_rows(x, pos, cos, sin, eps, op[E_MODE], it[b + 2], it[b + 3])
    if op[E_GOUT]:  # the rows also copied group-major (inverse_rope_groups)
        G = op[E_G]
        gout = view_f32(op[E_GOUT], T * NH * D).reshape((G, T, NH // G * D))
        _group_rows(x, gout, it[b + 2], it[b + 3])


def heads_inplace(
    x: np.ndarray,
    pos: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    eps: float,
    queries: bool,
    pool: Any = None,
    _gout: np.ndarray | None = None,
) -> np.ndarray:
    """In place on x float32 [T, NH, D] (C-contiguous): ``queries``: ds4_ops.rms per head,
    ds4_ops.rope_last, then rounded to float16 and back (deepseek4's q as attend_rows takes
    it); else ds4_ops.rope_last(..., inverse=True) (the output). pos int64 [T]; cos / sin
    float32 [n_ctx, R/2]. Bit for bit those references; ``pool``: a WorkerPool to spread the
    tokens over when there are at least _POOL_MIN_TOKENS. Returns x. ValueError for arrays
    this does not take, IndexError for a position outside the tables."""
    if x.dtype != np.float32 or x.ndim != 3 or not x.flags.c_contiguous:
        raise ValueError(f"heads_inplace: x must be C-contiguous float32 [T, NH, D], got {x.dtype} {x.shape}")
    T, NH, D = x.shape
    c32 = np.ascontiguousarray(cos, dtype=np.float32)
    s32 = np.ascontiguousarray(sin, dtype=np.float32)
    half = c32.shape[1]
    if s32.shape != c32.shape or not 0 < 2 * half <= D or cos.dtype != np.float32 or sin.dtype != np.float32:
        raise ValueError(f"heads_inplace: x {x.shape} and tables {cos.shape} {cos.dtype} do not agree")
    p = np.ascontiguousarray(pos, dtype=np.int64).reshape(-1)
    if p.shape[0] != T:
        raise ValueError(f"heads_inplace: {p.shape[0]} positions for {T} rows")
    if p.size and (p.min() < 0 or p.max() >= c32.shape[0]):
        raise IndexError(
            f"heads_inplace: positions {p.min()}..{p.max()} outside the tables' {c32.shape[0]} rows"
        )
    return _heads(x, p, c32, s32, eps, 0 if queries else 1, pool, _gout)


def _heads(x, p, c32, s32, eps, mode, pool, gout):
    """heads_inplace's work on checked arrays; gout float32 [G, T, NH // G * D] or None: also
    the rows group-major (_group_rows), in the same pass over the tokens."""
    T, NH, D = x.shape
    half = c32.shape[1]
    if pool is not None and pool.n_workers > 1 and T >= _POOL_MIN_TOKENS:
        eps_w = np.array([eps], np.float64)
        op = np.zeros(E_LEN, np.int64)
        op[E_X], op[E_POS], op[E_COS], op[E_SIN] = (
            x.ctypes.data,
            p.ctypes.data,
            c32.ctypes.data,
            s32.ctypes.data,
        )
        op[E_EPS], op[E_MODE], op[E_T], op[E_NH], op[E_D] = eps_w.ctypes.data, mode, T, NH, D
        op[E_NCTX], op[E_HALF] = c32.shape[0], half
        if gout is not None:
            op[E_GOUT], op[E_G] = gout.ctypes.data, gout.shape[0]
        _run_token_ranges(pool, _heads_item, op, T)
    else:
        _heads_rows(x, p, c32, s32, np.float64(eps), mode, 0, T)
        if gout is not None:
            _group_rows(x, gout, 0, T)
    return x


def inverse_rope_groups(
    x: np.ndarray,
    pos: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    groups: int,
    pool: Any = None,
    buf: np.ndarray | None = None,
) -> np.ndarray:
    """``heads_inplace(x, pos, cos, sin, eps, False, pool)`` (the output's inverse rope, in
    place on x float32 [T, NH, D]) that also returns the result group-major, float32
    [groups, T, NH // groups * D] (group g: heads g * NH // groups ..; deepseek4's
    attn_output_a input, one contiguous matrix per group), copied in the same pooled pass.
    ``buf``: float32 scratch of at least x.size values to write the result into (a view of
    it is returned; a fresh array otherwise). ValueError as heads_inplace, and when groups
    does not divide NH."""
    if x.dtype != np.float32 or x.ndim != 3 or not x.flags.c_contiguous:
        raise ValueError(
            f"inverse_rope_groups: x must be C-contiguous float32 [T, NH, D], got {x.dtype} {x.shape}"
        )
    T, NH, D = x.shape
    if groups < 1 or NH % groups:
        raise ValueError(f"inverse_rope_groups: {groups} groups do not divide {NH} heads")
    if buf is not None and buf.dtype == np.float32 and buf.ndim == 1 and buf.size >= x.size:
        gout = buf[: x.size].reshape(groups, T, NH // groups * D)
    else:
        gout = np.empty((groups, T, NH // groups * D), np.float32)
    heads_inplace(x, pos, cos, sin, 0.0, False, pool, _gout=gout)
    return gout


# ---------------------------------------------------------------------------------------
# hyper-connections


def mix_table(fn: np.ndarray) -> np.ndarray:
    """A hyper-connection mixing matrix fn [M, C*H] as the [C*H, M] table :func:`hc_pre` reads
    (one pass over it, M sums side by side): float32 when every value is a float32 (the GGUF
    tensor is F32: half the bytes a step reads, widened to float64 exactly in the kernel),
    else float64."""
    fn = np.asarray(fn)
    f32 = fn.astype(np.float32)
    exact = fn.dtype == np.float32 or bool(np.array_equal(f32.astype(fn.dtype), fn))
    return np.ascontiguousarray((f32 if exact else fn.astype(np.float64)).T)


@njit(**_JIT)
def _sigmoid32(v):
    """ds4_ops.sigmoid of one float32: float32(1 / (1 + exp(-float64(v))))."""
    return np.float32(1.0 / (1.0 + np.exp(-np.float64(v))))


_MIX_TOKENS = 8  # tokens whose mixes share one pass over the mixing table (1.5 MB for V4-Flash)


@njit(**_JIT)
def _hc_pre_rows(x, fnT, scale, base, eps_rms, eps_hc, iters, xn, h, post, comb, f32_table):
    """:func:`hc_pre` on x float32 [T, C, H] into h [T, H], post [T, C], comb [T, C, C]; xn
    float32 [T, C*H] scratch; f32_table: fnT is float32."""
    T, C, H = x.shape
    K, M = fnT.shape
    _rms_rows(x.reshape((T, C * H)), eps_rms, xn)
    acc = np.empty((_MIX_TOKENS, M), np.float64)
    mixes = np.empty(M, np.float32)
    xn_flat = xn.reshape(-1)
    fnT_flat = fnT.reshape(-1)
    c = np.empty((1, C, C), np.float64)
    pre = np.empty(C, np.float32)
    for t in range(T):
        tb = t % _MIX_TOKENS
        if M == 24 and f32_table:  # V4's 4 streams: a token's 24 sums in registers, one pass over fnT
            tb = 0
            mix_rows_f64(xn_flat, t * K, fnT_flat, K, 24, acc)
        elif tb == 0:  # the mixes of the next _MIX_TOKENS tokens in one pass over fnT
            nt = min(_MIX_TOKENS, T - t)
            for u in range(nt):
                for m in range(M):
                    acc[u, m] = 0.0
            for k in range(K):
                for u in range(nt):  # each token's sums in k order: the same bits as one at a time
                    v = np.float64(xn[t + u, k])
                    for m in range(M):
                        acc[u, m] += v * np.float64(fnT[k, m])
        _hc_pre_tail(acc[tb], x[t], scale, base, eps_hc, iters, mixes, c, pre, h[t], post[t], comb[t])


@njit(**_JIT)
def _hc_pre_tail(acc, x, scale, base, eps_hc, iters, mixes, c, pre, h, post, comb):
    """One token's hc_pre after its mixes: acc float64 [M] (the mixes' sums), x float32 [C, H]
    -> h [H], post [C], comb [C, C] float32 (pre's sigmoids, the Sinkhorn normalisation and
    h = sum_i pre[i] x[i], as ds4_ops.hc_pre). Scratch: mixes float32 [M], c float64
    [1, C, C], pre float32 [C]."""
    C, H = x.shape
    M = acc.shape[0]
    for m in range(M):
        mixes[m] = np.float32(acc[m])
    for i in range(C):
        pre[i] = _sigmoid32(mixes[i] * scale[0] + base[i]) + np.float32(eps_hc)
        post[i] = np.float32(2.0) * _sigmoid32(mixes[C + i] * scale[1] + base[C + i])
    for a in range(C):  # softmax over dst, + eps (ds4_ops.sinkhorn's first step)
        mx = -np.inf
        for b in range(C):
            c[0, a, b] = np.float64(mixes[2 * C + a * C + b] * scale[2] + base[2 * C + a * C + b])
            mx = max(mx, c[0, a, b])
        for b in range(C):
            c[0, a, b] = np.exp(c[0, a, b] - mx)
        tot = c[0, a, 0]
        for b in range(1, C):
            tot += c[0, a, b]
        for b in range(C):
            c[0, a, b] = c[0, a, b] / tot + eps_hc
    _sinkhorn_iters(c, iters, eps_hc)
    for a in range(C):
        for b in range(C):
            comb[a, b] = np.float32(c[0, a, b])
    for j in range(H):
        s = pre[0] * x[0, j]
        for i in range(1, C):
            s += pre[i] * x[i, j]
        h[j] = s


(P_X, P_FNT, P_F64, P_SCALE, P_BASE, P_EPS, P_ITERS, P_XN, P_H, P_POST, P_COMB, P_T, P_C, P_H_DIM, P_LEN) = (
    range(15)
)


def _hc_pre_item(items_ptr, i, op_ptr):
    """Tokens [it[2], it[3]) of a pooled hc_pre (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, P_LEN)
    b = i * _pool.ITEM_W
    t0, t1 = it[b + 2], it[b + 3]
    T, C, H = op[P_T], op[P_C], op[P_H_DIM]
    M = (2 + C) * C
    x = view_f32(op[P_X], T * C * H).reshape((T, C, H))
    xn = view_f32(op[P_XN], T * C * H).reshape((T, C * H))
    h = view_f32(op[P_H], T * H).reshape((T, H))
    post = view_f32(op[P_POST], T * C).reshape((T, C))
    comb = view_f32(op[P_COMB], T * C * C).reshape((T, C, C))
    scale = view_f32(op[P_SCALE], 3)
    base = view_f32(op[P_BASE], M)
    eps = view_f32(op[P_EPS], 4).view(np.float64)
    if op[P_F64]:  # two call sites: numba types each table's dtype apart
        fnT64 = view_f32(op[P_FNT], 2 * C * H * M).view(np.float64).reshape((C * H, M))
        _hc_pre_rows(
            x[t0:t1],
            fnT64,
            scale,
            base,
            eps[0],
            eps[1],
            op[P_ITERS],
            xn[t0:t1],
            h[t0:t1],
            post[t0:t1],
            comb[t0:t1],
            False,
        )
    else:
        fnT32 = view_f32(op[P_FNT], C * H * M).reshape((C * H, M))
        _hc_pre_rows(
            x[t0:t1],
            fnT32,
            scale,
            base,
            eps[0],
            eps[1],
            op[P_ITERS],
            xn[t0:t1],
            h[t0:t1],
            post[t0:t1],
            comb[t0:t1],
            True,
        )


_POOL_MIN_TOKENS = 8  # hc_pre / hc_post steps of fewer tokens run on the calling thread


def _run_token_ranges(pool: Any, fn: Any, op: np.ndarray, T: int) -> None:
    """Run the K_CALL item ``fn`` over tokens 0..T in ranges (each token is computed by the
    same code whichever range it lands in: the same bits as one call)."""
    # ~4 ranges per worker, of at least _MIX_TOKENS: the pool's workers claim them as they go,
    # so one held up by another process does not hold the step
    step = max(_MIX_TOKENS, -(-T // (4 * pool.n_workers)))
    items = [(_pool.K_CALL, _pool.call_item_address(fn), t, min(T, t + step)) for t in range(0, T, step)]
    job = _pool.Job.build([_pool._spread(items, pool.n_nodes)], op)
    pool.run_arrays(job.items, job.bounds, job.op)


def hc_pre(
    x: np.ndarray,
    fnT: np.ndarray,
    scale: np.ndarray,
    base: np.ndarray,
    eps_rms: float,
    eps_hc: float,
    iters: int,
    pool: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ds4_ops.hc_pre (build_hc_pre) compiled, one pass per token: x float32 [T, C, H];
    fnT the mixing matrix as :func:`mix_table` gives it ([C*H, M] float32 or float64); scale [3]; base
    [M]. Returns (h [T, H], post [T, C], comb [T, C, C]) float32. The mixes sum in float64
    over the C*H terms in order (the reference: BLAS's order, both rounded to float32), the
    rest in the reference's arithmetic. Streams C < 8 (the Sinkhorn loops' exact-copy range;
    V4 has 4). ``pool``: a WorkerPool to spread the tokens over when there are at least
    _POOL_MIN_TOKENS (the same bits). ValueError for shapes that do not agree."""
    T, C, H = x.shape
    if fnT.shape != (C * H, (2 + C) * C) or base.shape[0] != (2 + C) * C or C >= 8:
        raise ValueError(f"hc_pre: x {x.shape}, mixing table {fnT.shape}, base {base.shape} do not agree")
    xc = np.ascontiguousarray(x, dtype=np.float32)
    h = np.empty((T, H), np.float32)
    post = np.empty((T, C), np.float32)
    comb = np.empty((T, C, C), np.float32)
    sc = np.ascontiguousarray(scale, dtype=np.float32)
    bs = np.ascontiguousarray(base, dtype=np.float32)
    xn = np.empty((T, C * H), np.float32)
    if pool is not None and pool.n_workers > 1 and T >= _POOL_MIN_TOKENS:
        fn = np.ascontiguousarray(fnT)
        if fn.dtype not in (np.float32, np.float64):
            fn = fn.astype(np.float64)
        eps = np.array([eps_rms, eps_hc], np.float64)
        op = np.zeros(P_LEN, np.int64)
        op[P_X], op[P_FNT], op[P_F64] = xc.ctypes.data, fn.ctypes.data, int(fn.dtype == np.float64)
        op[P_SCALE], op[P_BASE], op[P_EPS], op[P_ITERS] = (
            sc.ctypes.data,
            bs.ctypes.data,
            eps.ctypes.data,
            iters,
        )
        op[P_XN], op[P_H], op[P_POST], op[P_COMB] = (
            xn.ctypes.data,
            h.ctypes.data,
            post.ctypes.data,
            comb.ctypes.data,
        )
        op[P_T], op[P_C], op[P_H_DIM] = T, C, H
        _run_token_ranges(pool, _hc_pre_item, op, T)
        return h, post, comb
    _hc_pre_rows(
        xc,
        fnT,
        sc,
        bs,
        np.float64(eps_rms),
        np.float64(eps_hc),
        int(iters),
        xn,
        h,
        post,
        comb,
        fnT.dtype == np.float32 and fnT.flags.c_contiguous,
    )
    return h, post, comb


@njit(**_JIT)
def _hc_post_rows(y, x, post, comb, out):
    T, C, H = x.shape
    for t in range(T):
        for dst in range(C):  # per element: ((c0 x0 + c1 x1) + ...) then post y + that, across j
            p = post[t, dst]
            c0 = comb[t, 0, dst]
            for j in range(H):
                out[t, dst, j] = c0 * x[t, 0, j]
            for src in range(1, C):
                c = comb[t, src, dst]
                for j in range(H):
                    out[t, dst, j] += c * x[t, src, j]
            for j in range(H):
                out[t, dst, j] = p * y[t, j] + out[t, dst, j]


(Q_Y, Q_X, Q_POST, Q_COMB, Q_OUT, Q_T, Q_C, Q_H, Q_LEN) = range(9)


def _hc_post_item(items_ptr, i, op_ptr):
    """Tokens [it[2], it[3]) of a pooled hc_post (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, Q_LEN)
    b = i * _pool.ITEM_W
    t0, t1 = it[b + 2], it[b + 3]
    T, C, H = op[Q_T], op[Q_C], op[Q_H]
    y = view_f32(op[Q_Y], T * H).reshape((T, H))
    x = view_f32(op[Q_X], T * C * H).reshape((T, C, H))
    post = view_f32(op[Q_POST], T * C).reshape((T, C))
    comb = view_f32(op[Q_COMB], T * C * C).reshape((T, C, C))
    out = view_f32(op[Q_OUT], T * C * H).reshape((T, C, H))
    _hc_post_rows(y[t0:t1], x[t0:t1], post[t0:t1], comb[t0:t1], out[t0:t1])


def hc_post(y: np.ndarray, x: np.ndarray, post: np.ndarray, comb: np.ndarray, pool: Any = None) -> np.ndarray:
    """ds4_ops.hc_post (build_hc_post) compiled: x'[dst] = post[dst] y + sum_src comb[src, dst]
    x[src] in float32, the sum over src in order. y [T, H], x [T, C, H], post [T, C], comb
    [T, C, C] -> float32 [T, C, H]. ``pool``: as :func:`hc_pre`'s (the same bits)."""
    T, C, H = x.shape
    out = np.empty((T, C, H), np.float32)
    yc = np.ascontiguousarray(y, dtype=np.float32)
    xc = np.ascontiguousarray(x, dtype=np.float32)
    pc = np.ascontiguousarray(post, dtype=np.float32)
    cc = np.ascontiguousarray(comb, dtype=np.float32)
    if pool is not None and pool.n_workers > 1 and T >= _POOL_MIN_TOKENS:
        op = np.array(
            [yc.ctypes.data, xc.ctypes.data, pc.ctypes.data, cc.ctypes.data, out.ctypes.data, T, C, H],
            np.int64,
        )
        _run_token_ranges(pool, _hc_post_item, op, T)
        return out
    _hc_post_rows(yc, xc, pc, cc, out)
    return out
