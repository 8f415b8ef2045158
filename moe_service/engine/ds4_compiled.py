"""Compiled (numba) forms of DeepSeek V4's per-layer work outside the matmuls, each the
formula of its numpy reference in :mod:`moe_service.engine.ds4_ops` /
:mod:`moe_service.engine.arch.deepseek4` (tests/moe_service/engine/arch/test_ds4_compiled.py
compares them): the attention over the raw window plus the selected compressed rows
(:func:`attend_rows`, reference ``ds4_ops.attend_sinks`` on the concatenated keys), the
hyper-connection pre / post mixes (:func:`hc_pre`, :func:`hc_post`; references
``ds4_ops.hc_pre`` / ``ds4_ops.hc_post``) and the lightning indexer's scores and top-k
(:func:`indexer_top_k`, reference ``deepseek4._top_k``; not used by the layer: on a quiet
AVX2 host it took 3x the CPU time of numpy's BLAS dgemm, 6.3 vs 2.2 ms at 1024 rows).

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
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from moe_service.engine import pool as _pool
from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits
from moe_service.engine.ds4_ops import _heap_select_rows, _rms_rows, _rope_last_rows, _sinkhorn_iters
from moe_service.engine.quant.ir import (
    _F32,
    _I8,
    _I32,
    _call,
    _ci,
    _data,
    _ldv,
    _shuf,
    _vt,
    dot_f32_ggml,
    view_f32,
    view_i64,
    view_u8,
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


@intrinsic
def dot2x2_f32_ggml(typingctx, arena, wo0, wo1, xf, xo0, xo1, n):
    """The four float32 dots of two rows of ``arena`` (n float32 at bytes ``wo0``, ``wo1``)
    with two rows of ``xf`` (from ``xo0``, ``xo1``) in one pass: (w0.x0, w1.x0, w0.x1,
    w1.x1), each bit for bit :func:`~moe_service.engine.quant.ir.dot_f32_ggml` of its pair
    (16 lanes of fma in element order, the same pairwise tree, the elements past the last
    multiple of 16 by fma one by one). Four independent accumulator chains (eight on AVX2)
    keep the FMA units busy where one dot is bound by the fma latency, and each row is
    loaded once for two dots."""
    sig = types.UniTuple(types.float32, 4)(arena, wo0, wo1, xf, xo0, xo1, n)

    def codegen(context, builder, signature, args):
        ty = signature.args
        base = builder.bitcast(_data(context, builder, ty[0], args[0]), _I8.as_pointer())
        w0 = context.cast(builder, args[1], ty[1], types.int64)
        w1 = context.cast(builder, args[2], ty[2], types.int64)
        xp = builder.bitcast(_data(context, builder, ty[3], args[3]), _F32.as_pointer())
        x0 = context.cast(builder, args[4], ty[4], types.int64)
        x1 = context.cast(builder, args[5], ty[5], types.int64)
        nn = context.cast(builder, args[6], ty[6], types.int64)
        v16 = _vt(_F32, 16)
        accs = [cgutils.alloca_once(builder, v16) for _ in range(4)]
        for a in accs:
            builder.store(ir.Constant(v16, [0.0] * 16), a)
        nv = builder.lshr(nn, _ci(4))
        with cgutils.for_range(builder, nv) as loop:
            j = builder.mul(loop.index, _ci(16))
            wa = _ldv(builder, base, builder.add(w0, builder.mul(j, _ci(4))), v16)
            wb = _ldv(builder, base, builder.add(w1, builder.mul(j, _ci(4))), v16)
            xs = []
            for xo in (x0, x1):
                xv = builder.load(builder.bitcast(builder.gep(xp, [builder.add(xo, j)]), v16.as_pointer()))
                xv.align = 4
                xs.append(xv)
            for a, (w, xv) in zip(accs, ((wa, xs[0]), (wb, xs[0]), (wa, xs[1]), (wb, xs[1])), strict=True):
                builder.store(_call(builder, "llvm.fma.v16f32", v16, [w, xv, builder.load(a)]), a)
        tail0 = builder.mul(nv, _ci(16))
        outs = []
        for a, (wo, xo) in zip(accs, ((w0, x0), (w1, x0), (w0, x1), (w1, x1)), strict=True):
            v = builder.load(a)
            for h in (8, 4, 2, 1):  # dot_f32_ggml's tree ('arcp': see there)
                v = builder.fadd(
                    _shuf(builder, v, range(h)), _shuf(builder, v, range(h, 2 * h)), flags=("arcp",)
                )
            res = cgutils.alloca_once(builder, _F32)
            builder.store(builder.extract_element(v, ir.Constant(_I32, 0)), res)
            with cgutils.for_range(builder, builder.sub(nn, tail0)) as loop:
                j = builder.add(tail0, loop.index)
                w = _ldv(builder, base, builder.add(wo, builder.mul(j, _ci(4))), _F32)
                xv = builder.load(builder.gep(xp, [builder.add(xo, j)]))
                builder.store(_call(builder, "llvm.fma.f32", _F32, [w, xv, builder.load(res)]), res)
            outs.append(builder.load(res))
        return context.make_tuple(builder, signature.return_type, outs)

    return sig, codegen


@njit(**_JIT)
def _attend_range(q, keys8, keys, cols, ncols, sinks, scale, out, r0, r1):
    """Rows r0..r1 of (token t, head h) = (r // NH, r % NH): softmax with a sink logit over
    the query's key rows, the same rows as values. q, out float32 [T * NH * D]; keys float32
    [N, D] (keys8: its bytes). Per token the heads of the range go in blocks of _HEAD_BLOCK
    (the block's q rows and value sums stay in L1); each (t, h) row is computed in the same
    order whatever the range: score of key i = float32 dot of 16 fixed lanes
    (dot_f32_ggml; two heads by two keys at a time, dot2x2_f32_ggml, the same bits) x scale
    in float64, float64 softmax with the sink, value sum in float32 over the keys in order
    (acc = acc + float32(p_i) k_i, each product and sum rounded; two heads by four keys per
    pass over the sums, the same roundings)."""
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
        for k0 in range(0, nh, _HEAD_BLOCK):  # a block's q rows and value sums stay in L1
            k1 = min(nh, k0 + _HEAD_BLOCK)
            for k in range(k0, k1):
                m[k] = np.float64(sinks[h0 + k])
            k = k0
            while k < k1:
                if k + 1 < k1:  # two heads by two keys per pass
                    qa, qb = (r + k) * D, (r + k + 1) * D
                    i = 0
                    while i + 1 < n:
                        oa, ob = cols[t, i] * D * 4, cols[t, i + 1] * D * 4
                        d00, d10, d01, d11 = dot2x2_f32_ggml(keys8, oa, ob, q, qa, qb, D)
                        s[k, i] = np.float64(d00) * scale
                        s[k, i + 1] = np.float64(d10) * scale
                        s[k + 1, i] = np.float64(d01) * scale
                        s[k + 1, i + 1] = np.float64(d11) * scale
                        i += 2
                    if i < n:
                        off = cols[t, i] * D * 4
                        s[k, i] = np.float64(dot_f32_ggml(keys8, off, q, qa, D)) * scale
                        s[k + 1, i] = np.float64(dot_f32_ggml(keys8, off, q, qb, D)) * scale
                    kk = 2
                else:
                    for i in range(n):
                        off = cols[t, i] * D * 4
                        s[k, i] = np.float64(dot_f32_ggml(keys8, off, q, (r + k) * D, D)) * scale
                    kk = 1
                for k2 in range(k, k + kk):
                    for i in range(n):
                        if s[k2, i] > m[k2]:
                            m[k2] = s[k2, i]
                k += kk
            for k in range(k0, k1):
                tot = 0.0
                for i in range(n):
                    e = np.exp(s[k, i] - m[k])
                    s[k, i] = e
                    tot += e
                den[k] = tot + np.exp(np.float64(sinks[h0 + k]) - m[k])
            for k in range(k0, k1):
                for i in range(n):
                    s[k, i] = np.float32(s[k, i] / den[k])  # the probability, rounded as used
            k = k0
            while k + 1 < k1:  # two heads by four keys per pass over the value sums
                i = 0
                while i + 3 < n:
                    ra, rb, rc, rd = cols[t, i], cols[t, i + 1], cols[t, i + 2], cols[t, i + 3]
                    pa, pb = np.float32(s[k, i]), np.float32(s[k, i + 1])
                    pc, pd = np.float32(s[k, i + 2]), np.float32(s[k, i + 3])
                    qa, qb = np.float32(s[k + 1, i]), np.float32(s[k + 1, i + 1])
                    qc, qd = np.float32(s[k + 1, i + 2]), np.float32(s[k + 1, i + 3])
                    for d in range(D):
                        ka, kb, kc, kd = keys[ra, d], keys[rb, d], keys[rc, d], keys[rd, d]
                        a = acc[k, d] + pa * ka
                        a = a + pb * kb
                        a = a + pc * kc
                        acc[k, d] = a + pd * kd
                        b = acc[k + 1, d] + qa * ka
                        b = b + qb * kb
                        b = b + qc * kc
                        acc[k + 1, d] = b + qd * kd
                    i += 4
                while i < n:
                    row = cols[t, i]
                    pa, qa = np.float32(s[k, i]), np.float32(s[k + 1, i])
                    for d in range(D):
                        acc[k, d] += pa * keys[row, d]
                        acc[k + 1, d] += qa * keys[row, d]
                    i += 1
                k += 2
            if k < k1:
                for i in range(n):
                    row = cols[t, i]
                    p = np.float32(s[k, i])
                    for d in range(D):
                        acc[k, d] += p * keys[row, d]
        for k in range(nh):
            for d in range(D):
                out[(r + k) * D + d] = acc[k, d]
        r += nh


_HEAD_BLOCK = 8  # heads of a token computed together: their q rows and value sums (8 x 2 KB) stay in L1


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
    del n_keys
    return out.reshape(T, NH, D)


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


(E_X, E_POS, E_COS, E_SIN, E_EPS, E_MODE, E_T, E_NH, E_D, E_NCTX, E_HALF, E_LEN) = range(12)


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


def heads_inplace(
    x: np.ndarray,
    pos: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    eps: float,
    queries: bool,
    pool: Any = None,
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
    mode = 0 if queries else 1
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
        _run_token_ranges(pool, _heads_item, op, T)
    else:
        _heads_rows(x, p, c32, s32, np.float64(eps), mode, 0, T)
    return x


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
def _hc_pre_rows(x, fnT, scale, base, eps_rms, eps_hc, iters, xn, h, post, comb):
    """:func:`hc_pre` on x float32 [T, C, H] into h [T, H], post [T, C], comb [T, C, C]; xn
    float32 [T, C*H] scratch."""
    T, C, H = x.shape
    K, M = fnT.shape
    _rms_rows(x.reshape((T, C * H)), eps_rms, xn)
    acc = np.empty((_MIX_TOKENS, M), np.float64)
    mixes = np.empty(M, np.float32)
    c = np.empty((1, C, C), np.float64)
    pre = np.empty(C, np.float32)
    for t in range(T):
        tb = t % _MIX_TOKENS
        if tb == 0:  # the mixes of the next _MIX_TOKENS tokens in one pass over fnT
            nt = min(_MIX_TOKENS, T - t)
            for u in range(nt):
                for m in range(M):
                    acc[u, m] = 0.0
            for k in range(K):
                for u in range(nt):  # each token's sums in k order: the same bits as one at a time
                    v = np.float64(xn[t + u, k])
                    for m in range(M):
                        acc[u, m] += v * np.float64(fnT[k, m])
        for m in range(M):
            mixes[m] = np.float32(acc[tb, m])
        for i in range(C):
            pre[i] = _sigmoid32(mixes[i] * scale[0] + base[i]) + np.float32(eps_hc)
            post[t, i] = np.float32(2.0) * _sigmoid32(mixes[C + i] * scale[1] + base[C + i])
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
                comb[t, a, b] = np.float32(c[0, a, b])
        for j in range(H):
            s = pre[0] * x[t, 0, j]
            for i in range(1, C):
                s += pre[i] * x[t, i, j]
            h[t, j] = s


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
    if op[P_F64]:
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


# ---------------------------------------------------------------------------------------
# the lightning indexer


@njit(**_JIT)
def _index_keys(k16, kT):
    """The indexer's float16 keys [nb, Di] (as bits) as float64 columns kT [Di, nb]."""
    nb, Di = k16.shape
    for j in range(nb):
        for d in range(Di):
            kT[d, j] = np.float64(_f16_bits_to_f32(k16[j, d]))


@njit(**_JIT)
def _index_scores(q, w, kT, score, t, j0, j1):
    """score[t, j0:j1] = sum over heads in order of relu(q[t, h] . k_j) * w[t, h], float64;
    per head the dots run across the keys (vectorised), each summed over the Di dims in order
    (the same bits whatever the key range)."""
    n, Ni, Di = q.shape
    nbj = j1 - j0
    dots = np.empty(max(1, nbj), np.float64)
    for hh in range(Ni):
        for j in range(nbj):
            dots[j] = 0.0
        for d in range(Di):
            qd = np.float64(q[t, hh, d])
            for j in range(nbj):
                dots[j] += qd * kT[d, j0 + j]
        wh = np.float64(w[t, hh])
        for j in range(nbj):
            r = dots[j] if dots[j] > 0.0 else 0.0
            if hh == 0:
                score[t, j0 + j] = r * wh
            else:
                score[t, j0 + j] += r * wh


@njit(**_JIT)
def _index_select(score, visible, top_k, sel):
    """sel[t] = the top_k rows by score among the visible (stable: ties to the lower row)."""
    n, nb = score.shape
    for t in range(n):
        for j in range(nb):
            if not visible[t, j]:
                score[t, j] = -np.inf
        order = np.argsort(-score[t], kind="mergesort")
        for i in range(min(nb, top_k)):
            j = order[i]
            sel[t, j] = visible[t, j]


(X_Q, X_W, X_KT, X_SCORE, X_N, X_NI, X_DI, X_NB, X_LEN) = range(9)


def _index_item(items_ptr, i, op_ptr):
    """Scores of token it[2], keys [it[3], it[4]) (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, X_LEN)
    b = i * _pool.ITEM_W
    n, Ni, Di, nb = op[X_N], op[X_NI], op[X_DI], op[X_NB]
    q = view_f32(op[X_Q], n * Ni * Di).reshape((n, Ni, Di))
    w = view_f32(op[X_W], n * Ni).reshape((n, Ni))
    kT = view_f32(op[X_KT], 2 * Di * nb).view(np.float64).reshape((Di, nb))
    score = view_f32(op[X_SCORE], 2 * n * nb).view(np.float64).reshape((n, nb))
    _index_scores(q, w, kT, score, it[b + 2], it[b + 3], it[b + 4])


_INDEX_MIN_KEYS = 64  # keys per pooled indexer item, at least


def indexer_top_k(
    q: np.ndarray, w: np.ndarray, k: np.ndarray, visible: np.ndarray, top_k: int, pool: Any = None
) -> np.ndarray:
    """The lightning indexer's choice (llama.cpp src/models/deepseek4.cpp, the indexer of a
    ratio-4 layer) compiled: bool [n, nb], the ``top_k`` highest-scoring compressed rows among
    the visible ones, score = sum over heads (in order) of relu(q . k) * w, in float64.
    q float32 [n, Ni, Di] (roped), w float32 [n, Ni] (scaled), k float16 [nb, Di] (the
    indexer's compressed keys), visible bool [n, nb]. Equals ``deepseek4._top_k(q, w,
    k.astype(float32), visible, top_k) & visible`` (its dots through BLAS: another order of
    float64 sums, so a tie closer than ~1e-15 relative may resolve differently). ``pool``: a
    WorkerPool to spread the scores over by ranges of keys when big enough (the same bits).
    ValueError for shapes that do not agree."""
    n, Ni, Di = q.shape
    if w.shape != (n, Ni) or k.ndim != 2 or k.shape[1] != Di or visible.shape != (n, k.shape[0]):
        raise ValueError(
            f"indexer_top_k: q {q.shape}, w {w.shape}, keys {k.shape}, visible {visible.shape} do not agree"
        )
    nb = k.shape[0]
    qc, wc = np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(w, dtype=np.float32)
    kT = np.empty((Di, nb), np.float64)
    _index_keys(np.ascontiguousarray(k, dtype=np.float16).view(np.uint16), kT)
    score = np.empty((n, nb), np.float64)
    n_workers = pool.n_workers if pool is not None else 1
    if n_workers > 1 and nb >= 2 * _INDEX_MIN_KEYS and n * Ni * Di * nb >= _POOL_MIN_MACS:
        op = np.array(
            [qc.ctypes.data, wc.ctypes.data, kT.ctypes.data, score.ctypes.data, n, Ni, Di, nb], np.int64
        )
        step = max(_INDEX_MIN_KEYS, -(-nb // n_workers))
        fn = _pool.call_item_address(_index_item)
        items = [(_pool.K_CALL, fn, t, j, min(nb, j + step)) for t in range(n) for j in range(0, nb, step)]
        job = _pool.Job.build([_pool._spread(items, pool.n_nodes)], op)
        pool.run_arrays(job.items, job.bounds, job.op)
    else:
        for t in range(n):
            _index_scores(qc, wc, kT, score, t, 0, nb)
    sel = np.zeros(visible.shape, np.bool_)
    _index_select(score, np.ascontiguousarray(visible, np.bool_), int(top_k), sel)
    return sel


# ---------------------------------------------------------------------------------------
# the lightning indexer, blocked (multi-token steps and decode alike)


def _make_dot_f64(nh: int, nk: int):
    """An intrinsic: the nh x nk float64 dots of nh rows of ``x`` (from element ``xo``, rows
    ``xs`` apart) with nk rows of ``k`` (from ``ko``, ``ks`` apart), n elements each, as a
    tuple [h][j]. Each dot in one fixed order whatever nh, nk: 4 lanes, lane l = fma over
    elements l, l + 4, ... in order, then (l0 + l2) + (l1 + l3), then the elements past the
    last multiple of 4 by fma one by one. nh x nk independent chains keep the FMA units busy."""

    @intrinsic
    def dot_f64(typingctx, k, ko, ks, x, xo, xs, n):
        sig = types.UniTuple(types.float64, nh * nk)(k, ko, ks, x, xo, xs, n)

        def codegen(context, builder, signature, args):
            ty = signature.args
            kp = builder.bitcast(_data(context, builder, ty[0], args[0]), _F64.as_pointer())
            k0, kst = (context.cast(builder, args[i], ty[i], types.int64) for i in (1, 2))
            xp = builder.bitcast(_data(context, builder, ty[3], args[3]), _F64.as_pointer())
            x0, xst = (context.cast(builder, args[i], ty[i], types.int64) for i in (4, 5))
            nn = context.cast(builder, args[6], ty[6], types.int64)
            v4 = _vt(_F64, 4)
            krow = [builder.add(k0, builder.mul(kst, _ci(j))) for j in range(nk)]
            xrow = [builder.add(x0, builder.mul(xst, _ci(h))) for h in range(nh)]
            accs = [[cgutils.alloca_once(builder, v4) for _ in range(nk)] for _ in range(nh)]
            for row in accs:
                for a in row:
                    builder.store(ir.Constant(v4, [0.0] * 4), a)

            def ld4(ptr, off):
                v = builder.load(builder.bitcast(builder.gep(ptr, [off]), v4.as_pointer()))
                v.align = 8
                return v

            nv = builder.lshr(nn, _ci(2))
            with cgutils.for_range(builder, nv) as loop:
                e = builder.mul(loop.index, _ci(4))
                kv = [ld4(kp, builder.add(r, e)) for r in krow]
                for h in range(nh):
                    xv = ld4(xp, builder.add(xrow[h], e))
                    for j in range(nk):
                        a = accs[h][j]
                        builder.store(_call(builder, "llvm.fma.v4f64", v4, [xv, kv[j], builder.load(a)]), a)
            tail0 = builder.mul(nv, _ci(4))
            outs = []
            for h in range(nh):
                for j in range(nk):
                    v = builder.load(accs[h][j])
                    v = builder.fadd(_shuf(builder, v, (0, 1)), _shuf(builder, v, (2, 3)), flags=("arcp",))
                    v = builder.fadd(
                        builder.extract_element(v, ir.Constant(_I32, 0)),
                        builder.extract_element(v, ir.Constant(_I32, 1)),
                        flags=("arcp",),
                    )
                    res = cgutils.alloca_once(builder, _F64)
                    builder.store(v, res)
                    with cgutils.for_range(builder, builder.sub(nn, tail0)) as loop:
                        e = builder.add(tail0, loop.index)
                        xv = builder.load(builder.gep(xp, [builder.add(xrow[h], e)]))
                        kv1 = builder.load(builder.gep(kp, [builder.add(krow[j], e)]))
                        builder.store(_call(builder, "llvm.fma.f64", _F64, [xv, kv1, builder.load(res)]), res)
                    outs.append(builder.load(res))
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    return dot_f64


_dot_f64_2x4 = _make_dot_f64(2, 4)
_dot_f64_1x4 = _make_dot_f64(1, 4)
_dot_f64_2x1 = _make_dot_f64(2, 1)
_dot_f64_1x1 = _make_dot_f64(1, 1)


@njit(**_JIT)
def _lid_rows(q64, w, k64, nvalid, top_k, score, sel, t0, t1):
    """Tokens t0..t1: score[t, j] = sum over heads in order of max(q[t, h] . k_j, 0) * w[t, h]
    (float64; the dots of _make_dot_f64's order), for the keys j < nvalid[t], then the top_k
    of them (ds4_ops._heap_select_rows: ggml's tie order) into sel[t]."""
    n, Ni, Di = q64.shape
    nb = k64.shape[0]
    kflat = k64.reshape(-1)
    qflat = q64.reshape(-1)
    for t in range(t0, t1):
        m = min(nvalid[t], nb)
        if m <= top_k:  # all of them (heap select keeps every one)
            for j in range(m):
                sel[t, j] = True
            continue
        for j in range(m):
            score[t, j] = 0.0
        j = 0
        while j < m:
            nk = 4 if j + 4 <= m else 1
            h = 0
            while h < Ni:
                xo = (t * Ni + h) * Di
                wa = np.float64(w[t, h])
                if h + 1 < Ni:
                    wb = np.float64(w[t, h + 1])
                    if nk == 4:
                        d = _dot_f64_2x4(kflat, j * Di, Di, qflat, xo, Di, Di)
                        for jj in range(4):
                            score[t, j + jj] += max(d[jj], 0.0) * wa
                        for jj in range(4):
                            score[t, j + jj] += max(d[4 + jj], 0.0) * wb
                    else:
                        d2 = _dot_f64_2x1(kflat, j * Di, Di, qflat, xo, Di, Di)
                        score[t, j] += max(d2[0], 0.0) * wa
                        score[t, j] += max(d2[1], 0.0) * wb
                    h += 2
                else:
                    if nk == 4:
                        d4 = _dot_f64_1x4(kflat, j * Di, Di, qflat, xo, Di, Di)
                        for jj in range(4):
                            score[t, j + jj] += max(d4[jj], 0.0) * wa
                    else:
                        d1 = _dot_f64_1x1(kflat, j * Di, Di, qflat, xo, Di, Di)
                        score[t, j] += max(d1[0], 0.0) * wa
                    h += 1
            j += nk
        _heap_select_rows(score[t : t + 1], nvalid[t : t + 1], top_k, sel[t : t + 1])


(L_Q, L_W, L_K, L_NV, L_SCORE, L_SEL, L_N, L_NI, L_DI, L_NB, L_TOPK, L_LEN) = range(12)


def _lid_item(items_ptr, i, op_ptr):
    """Tokens [it[2], it[3]) of a pooled :func:`lid_top_k` (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, L_LEN)
    b = i * _pool.ITEM_W
    n, Ni, Di, nb = op[L_N], op[L_NI], op[L_DI], op[L_NB]
    q64 = view_f32(op[L_Q], 2 * n * Ni * Di).view(np.float64).reshape((n, Ni, Di))
    w = view_f32(op[L_W], n * Ni).reshape((n, Ni))
    k64 = view_f32(op[L_K], 2 * nb * Di).view(np.float64).reshape((nb, Di))
    nv = view_i64(op[L_NV], n)
    score = view_f32(op[L_SCORE], 2 * n * nb).view(np.float64).reshape((n, nb))
    sel = view_u8(op[L_SEL], n * nb).view(np.bool_).reshape((n, nb))
    _lid_rows(q64, w, k64, nv, op[L_TOPK], score, sel, it[b + 2], it[b + 3])


def lid_top_k(
    q: np.ndarray, w: np.ndarray, k: np.ndarray, n_visible: np.ndarray, top_k: int, pool: Any = None
) -> np.ndarray:
    """The lightning indexer's choice (llama.cpp src/models/deepseek4.cpp build_lid_top_k;
    the reference ``deepseek4._top_k``), blocked: bool [n, nb], per query t the ``top_k``
    highest-scoring of the compressed rows 0..n_visible[t]-1 (all of them when there are at
    most top_k), ties broken as ggml's top-k (ds4_ops.top_k_rows). score = sum over heads in
    order of relu(q . k) * w in float64 (products of float32 values, exact in float64; each
    dot in one fixed order of 4 lanes, so a query's choice does not depend on the step's
    other queries, the pool, or its position in a block; the reference's BLAS order differs
    only in the last bits of a float64 sum). q float32 [n, Ni, Di] (roped), w float32
    [n, Ni] (scaled), k float32 or float16 [nb, Di], n_visible int [n]. ``pool``: a
    WorkerPool to spread the queries over (the same bits). ValueError for shapes that do not
    agree."""
    n, Ni, Di = q.shape
    nv = np.minimum(np.ascontiguousarray(n_visible, dtype=np.int64).reshape(-1), k.shape[0])
    if w.shape != (n, Ni) or k.ndim != 2 or k.shape[1] != Di or nv.shape != (n,) or top_k < 1:
        raise ValueError(
            f"lid_top_k: q {q.shape}, w {w.shape}, keys {k.shape}, n_visible {nv.shape}, top_k {top_k} do not agree"
        )
    nb = k.shape[0]
    q64 = np.ascontiguousarray(q, dtype=np.float64)
    k64 = np.ascontiguousarray(k, dtype=np.float64)
    wc = np.ascontiguousarray(w, dtype=np.float32)
    score = np.empty((n, max(nb, 1)), np.float64)
    sel = np.zeros((n, nb), np.bool_)
    if pool is not None and pool.n_workers > 1 and n >= 2 and int(nv.max(initial=0)) > top_k:
        op = np.zeros(L_LEN, np.int64)
        op[L_Q], op[L_W], op[L_K], op[L_NV] = q64.ctypes.data, wc.ctypes.data, k64.ctypes.data, nv.ctypes.data
        op[L_SCORE], op[L_SEL], op[L_N], op[L_NI] = score.ctypes.data, sel.ctypes.data, n, Ni
        op[L_DI], op[L_NB], op[L_TOPK] = Di, max(nb, 1), int(top_k)
        _run_token_ranges(pool, _lid_item, op, n)
    else:
        _lid_rows(q64, wc, k64, nv, int(top_k), score, sel, 0, n)
    return sel
