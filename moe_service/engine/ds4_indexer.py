"""The lightning indexer of DeepSeek V4 compiled (numba): each query's scores over the
compressed keys and its top-k, reference ``deepseek4._top_k`` (llama.cpp models/deepseek4.cpp
build_lid_top_k: ReLU'd per-head q.k, weighted over the heads, ggml_top_k's tie order, here
ds4_ops._heap_select_rows). :func:`index_one` serves a decode step (one query; pooled from
_INDEX_ONE_POOL_KEYS keys), :func:`lid_top_k` multi-token steps. Both sum in float64 in a fixed
order (each query's choice does not depend on the step it is in); their orders differ from
each other and from BLAS's, so a near-tie closer than ~1e-15 relative could be broken
differently (tests/moe_service/engine/arch/test_ds4_compiled.py compares them with the
reference).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from moe_service.engine import pool as _pool
from moe_service.engine.cpu_layers import _f16_bits_to_f32
from moe_service.engine.ds4_compiled import _JIT, _run_token_ranges
from moe_service.engine.ds4_ops import _heap_select_rows
from moe_service.engine.quant.ir import (
    _I32,
    _call,
    _ci,
    _data,
    _shuf,
    _vt,
    index_scores16_f64,
    view_f32,
    view_i64,
    view_u8,
)

_F64 = ir.DoubleType()


# ---------------------------------------------------------------------------------------
# the lightning indexer


@njit(**_JIT)
def _index_one_range(q64, w64, k16, n_heads, dim, j0, j1, score):
    """score[j] for keys j0 <= j < j1 (:func:`index_one`): the keys by 16, transposed to
    float64 (exact), scored by quant.ir.index_scores16_f64."""
    kt = np.zeros(dim * 16, np.float64)
    o16 = np.empty(16, np.float64)
    for jb in range(j0, j1, 16):
        nk = min(16, j1 - jb)
        for u in range(nk):
            for d in range(dim):
                kt[d * 16 + u] = np.float64(_f16_bits_to_f32(k16[(jb + u) * dim + d]))
        for u in range(nk, 16):
            for d in range(dim):
                kt[d * 16 + u] = 0.0
        index_scores16_f64(q64, w64, n_heads, dim, kt, o16)
        for u in range(nk):
            score[jb + u] = o16[u]


(I_Q, I_W, I_K, I_SCORE, I_NI, I_DI, I_NB, I_LEN) = range(8)


def _index_one_item(items_ptr, i, op_ptr):
    """Keys [it[2], it[3]) of a pooled index_one (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, I_LEN)
    b = i * _pool.ITEM_W
    Ni, Di, nb = op[I_NI], op[I_DI], op[I_NB]
    q64 = view_f32(op[I_Q], 2 * Ni * Di).view(np.float64)
    w64 = view_f32(op[I_W], 2 * Ni).view(np.float64)
    k16 = view_u8(op[I_K], 2 * nb * Di).view(np.uint16)
    score = view_f32(op[I_SCORE], 2 * nb).view(np.float64)
    _index_one_range(q64, w64, k16, Ni, Di, it[b + 2], it[b + 3], score)


_INDEX_ONE_POOL_KEYS = 1024  # below this many keys the scores run on the calling thread


def index_one(
    q: np.ndarray, w: np.ndarray, k: np.ndarray, n_valid: int, top_k: int, pool: Any = None
) -> np.ndarray:
    """The lightning indexer's choice for one token (a decode step; llama.cpp
    src/models/deepseek4.cpp build_lid_top_k): the ascending indices of the ``top_k`` rows
    among the first ``n_valid`` compressed keys by score = sum over heads (in order) of
    relu(q_h . k) * w_h, in float64, ties broken as ggml's top-k (ds4_ops.top_k_rows). q
    float32 [Ni, Di] (roped), w float32 [Ni] (scaled), k float16 [nb, Di] (the indexer's
    compressed keys), n_valid <= nb. Each key's score is computed by the same code whatever
    the key range and worker (quant.ir.index_scores16_f64: float64 fma chains in dimension
    order), so it does not depend on the pool; against deepseek4._top_k's BLAS dgemm it
    differs in the last bits only (another order of float64 sums: a tie closer than ~1e-15
    relative may resolve differently). ``pool``: a WorkerPool to spread the keys over when
    there are enough. ValueError for shapes that do not agree."""
    Ni, Di = q.shape
    if w.shape != (Ni,) or k.ndim != 2 or k.shape[1] != Di or not 0 <= n_valid <= k.shape[0] or top_k < 1:
        raise ValueError(
            f"index_one: q {q.shape}, w {w.shape}, keys {k.shape}, {n_valid} valid, top_k {top_k} do not agree"
        )
    q64 = np.ascontiguousarray(q, dtype=np.float64).reshape(-1)
    w64 = np.ascontiguousarray(w, dtype=np.float64)
    k16 = np.ascontiguousarray(k[:n_valid], dtype=np.float16).view(np.uint16).reshape(-1)
    score = np.empty(max(1, n_valid), np.float64)
    n_workers = pool.n_workers if pool is not None else 1
    if n_workers > 1 and n_valid >= _INDEX_ONE_POOL_KEYS:
        op = np.array(
            [q64.ctypes.data, w64.ctypes.data, k16.ctypes.data, score.ctypes.data, Ni, Di, n_valid], np.int64
        )
        step = -(-n_valid // (2 * n_workers))
        step = -(-step // 16) * 16  # whole blocks of 16 keys per item
        fn = _pool.call_item_address(_index_one_item)
        items = [(_pool.K_CALL, fn, j, min(n_valid, j + step)) for j in range(0, n_valid, step)]
        job = _pool.Job.build([_pool._spread(items, pool.n_nodes)], op)
        pool.run_arrays(job.items, job.bounds, job.op)
    else:
        _index_one_range(q64, w64, k16, Ni, Di, 0, n_valid, score)
    from moe_service.engine import ds4_ops

    chosen = ds4_ops.top_k_rows(score[None, :n_valid], np.array([n_valid]), int(top_k))
    return np.flatnonzero(chosen[0])


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
