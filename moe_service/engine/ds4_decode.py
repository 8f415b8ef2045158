"""DeepSeek V4 one-token (decode) work outside the matmuls spread over the worker pool, where
:mod:`moe_service.engine.ds4_compiled` runs a one-token step on the calling thread.

The hyper-connection pre mix of one token (:func:`hc_pre_one`): its cost in a decode step is
reading the mixing table (C*H x M float32, 1.5 MB for V4-Flash's 4 x 4096 x 24) from memory,
since the layer's weight streaming has evicted it since the last step. One thread reads it
at ~10 GB/s; :class:`HcPreOne` gives each worker the table's columns of its own share, stored
apart (each worker streams only its bytes), and every mix is summed by the same code as
``ds4_compiled.hc_pre`` sums it (float64 products added in k order from 0: the same bits; the
sigmoids, Sinkhorn and h are ``ds4_compiled._hc_pre_tail``, on the calling thread).

Shapes: C streams, H hidden, M = (2 + C) C mixes, K = C*H.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, types

from moe_service.engine import pool as _pool
from moe_service.engine.ds4_compiled import (
    _ONE_HEADS,
    _POOL_MIN_MACS,
    _attend_one_range,
    _gather_rows,
    _hc_pre_tail,
    _heads_rows,
)
from moe_service.engine.ds4_ops import _pairwise_sum, _rms_rows
from moe_service.engine.quant.ir import _addr_view, mix_rows_f64, view_f32, view_i64

view_u16 = _addr_view(types.uint16)
_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def _mix_cols(xn, tab, acc):
    """acc[m] = sum over k in order of float64(xn[k]) * float64(tab[k, m]), from 0, each
    product rounded to float64 and added in float64 (no fma): the sums of
    quant.ir.mix_rows_f64 and of ds4_compiled._hc_pre_rows' loop, bit for bit. xn float32
    [K]; tab float32 [K, m_cols]; acc float64 [m_cols] (written)."""
    K, Mc = tab.shape
    if Mc == 12:  # V4's 24 mixes in 2 shares: the sums in registers
        mix_rows_f64(xn, 0, tab.reshape(-1), K, 12, acc)
        return
    if Mc == 8:
        mix_rows_f64(xn, 0, tab.reshape(-1), K, 8, acc)
        return
    for m in range(Mc):
        acc[m] = 0.0
    for k in range(K):
        v = np.float64(xn[k])
        for m in range(Mc):
            acc[m] += v * np.float64(tab[k, m])


(O_X, O_TAB, O_XN, O_ACC, O_K, O_MC, O_EPS, O_LEN) = range(8)


def _hc_mix_item(items_ptr, i, op_ptr):
    """Worker share it[2] of one token's mixes (a K_CALL item, pool.CALL_ITEM_SIG): x's rms
    into the share's own scratch (each share computes it: no barrier), then the share's
    columns of the split table (op: see :class:`HcPreOne`)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, O_LEN)
    j = it[i * _pool.ITEM_W + 2]
    K, Mc = op[O_K], op[O_MC]
    x = view_f32(op[O_X], K).reshape((1, K))
    xn = view_f32(op[O_XN] + j * K * 4, K).reshape((1, K))
    tab = view_f32(op[O_TAB] + j * K * Mc * 4, K * Mc).reshape((K, Mc))
    acc = view_f32(op[O_ACC] + j * Mc * 8, 2 * Mc).view(np.float64)
    eps = view_f32(op[O_EPS], 2).view(np.float64)
    _rms_rows(x, eps[0], xn)
    _mix_cols(xn[0], tab, acc)


class HcPreOne:
    """One token's ``ds4_compiled.hc_pre`` for one mixing table on a pool of ``n_shares``
    workers (>= 2): the table fnT float32 [K, M] (ds4_compiled.mix_table's float32 form) split
    by columns into n_shares contiguous [K, M / n_shares] blocks (M a multiple of n_shares),
    and the job's scratch kept for the layer's every step. Not for concurrent use (a layer's
    steps run one at a time: the pool's lock); n_nodes: the pool's NUMA nodes (items spread
    over them). ValueError when the table is not float32 or
    its columns do not split."""

    def __init__(self, fnT: np.ndarray, n_shares: int, eps_rms: float, n_nodes: int = 1):
        K, M = fnT.shape
        if fnT.dtype != np.float32 or n_shares < 2 or M % n_shares:
            raise ValueError(
                f"HcPreOne: a float32 mixing table with columns in {n_shares} shares (got {fnT.dtype} {fnT.shape})"
            )
        mc = M // n_shares
        self.K, self.M = K, M
        self.tab = np.ascontiguousarray(fnT.reshape(K, n_shares, mc).transpose(1, 0, 2))  # [share, K, mc]
        self.xn = np.empty((n_shares, K), np.float32)
        self.acc = np.empty(M, np.float64)  # share j's sums at j * mc.. (the table's column order)
        self.eps = np.array([eps_rms, 0.0], np.float64)
        op = np.zeros(O_LEN, np.int64)
        op[O_TAB], op[O_XN], op[O_ACC] = self.tab.ctypes.data, self.xn.ctypes.data, self.acc.ctypes.data
        op[O_K], op[O_MC], op[O_EPS] = K, mc, self.eps.ctypes.data
        fn = _pool.call_item_address(_hc_mix_item)
        items = [(_pool.K_CALL, fn, j) for j in range(n_shares)]
        self.job = _pool.Job.build([_pool._spread(items, n_nodes)], op)
        self.n_shares = n_shares

    def __call__(
        self, x: np.ndarray, scale: np.ndarray, base: np.ndarray, eps_hc: float, iters: int, pool: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x float32 [1, C, H] (C*H = K) -> (h [1, H], post [1, C], comb [1, C, C]) float32, the
        bits of ``ds4_compiled.hc_pre(x, fnT, scale, base, eps_rms, eps_hc, iters)``."""
        T, C, H = x.shape
        if T != 1 or C * H != self.K or base.shape[0] != self.M or (2 + C) * C != self.M:
            raise ValueError(
                f"HcPreOne: x {x.shape}, base {base.shape} do not fit the table [{self.K}, {self.M}]"
            )
        xc = np.ascontiguousarray(x, dtype=np.float32)
        job = self.job
        pool.run_arrays(job.items, job.bounds, job.op, x=xc, x_field=O_X)
        h = np.empty((1, H), np.float32)
        post = np.empty((1, C), np.float32)
        comb = np.empty((1, C, C), np.float32)
        _hc_pre_tail(
            self.acc,
            xc[0],
            np.ascontiguousarray(scale, dtype=np.float32),
            np.ascontiguousarray(base, dtype=np.float32),
            np.float64(eps_hc),
            int(iters),
            np.empty(self.M, np.float32),
            np.empty((1, C, C), np.float64),
            np.empty(C, np.float32),
            h[0],
            post[0],
            comb[0],
        )
        return h, post, comb


# ---------------------------------------------------------------------------------------
# one token's attention with its query preparation and the output's inverse rope


@njit(**_JIT)
def _attend_heads(q, pos, cos, sin, eps, keys, kc, sinks, scale, out, h0, h1):
    """Heads h0..h1 of one token: q's rows prepared in place as ds4_compiled.heads_inplace
    prepares them (per-head rms, rope, float16 rounding), the attention of
    ds4_compiled._attend_one_range over every key row, then the output rows' inverse rope
    (heads_inplace's mode 1). q, out float32 [NH * D] (out written for these heads)."""
    D = keys.shape[1]
    qv = q[h0 * D : h1 * D].reshape((1, h1 - h0, D))
    ov = out[h0 * D : h1 * D].reshape((1, h1 - h0, D))
    _heads_rows(qv, pos, cos, sin, eps, 0, 0, 1)
    _attend_one_range(q, keys.reshape(-1).view(np.uint8), keys, kc, sinks, scale, out, h0, h1)
    _heads_rows(ov, pos, cos, sin, eps, 1, 0, 1)


(
    F_Q,
    F_POS,
    F_COS,
    F_SIN,
    F_NCTX,
    F_HALF,
    F_EPS,
    F_RING,
    F_W,
    F_LO,
    F_N0,
    F_NEW,
    F_COMP,
    F_NC,
    F_SEL,
    F_NS,
    F_KEYS,
    F_KC,
    F_N,
    F_D,
    F_NH,
    F_SINKS,
    F_SCALE,
    F_OUT,
    F_LEN,
) = range(25)


def _gather_item(items_ptr, i, op_ptr):
    """Key rows [it[2], it[3]) of a pooled :func:`attend_one` (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, F_LEN)
    b = i * _pool.ITEM_W
    W, D, n, nc, ns = op[F_W], op[F_D], op[F_N], op[F_NC], op[F_NS]
    ring16 = view_u16(op[F_RING], W * D).reshape((W, D))
    new16 = view_u16(op[F_NEW], D)
    comp16 = view_u16(op[F_COMP], max(1, nc) * D).reshape((max(1, nc), D))
    sel = view_i64(op[F_SEL], max(1, ns))
    keys = view_f32(op[F_KEYS], n * D).reshape((n, D))
    kc = view_f32(op[F_KC], n * D if D % 16 == 0 else 1)
    _gather_rows(ring16, op[F_LO], op[F_N0], new16, comp16, sel, keys, kc, it[b + 2], it[b + 3])


def _heads_item(items_ptr, i, op_ptr):
    """Heads [it[2], it[3]) of a pooled :func:`attend_one` (a K_CALL item, pool.CALL_ITEM_SIG)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, F_LEN)
    b = i * _pool.ITEM_W
    NH, D, n, n_ctx, half = op[F_NH], op[F_D], op[F_N], op[F_NCTX], op[F_HALF]
    q = view_f32(op[F_Q], NH * D)
    pos = view_i64(op[F_POS], 1)
    cos = view_f32(op[F_COS], n_ctx * half).reshape((n_ctx, half))
    sin = view_f32(op[F_SIN], n_ctx * half).reshape((n_ctx, half))
    words = view_f32(op[F_EPS], 4).view(np.float64)  # eps, scale
    keys = view_f32(op[F_KEYS], n * D).reshape((n, D))
    kc = view_f32(op[F_KC], n * D if D % 16 == 0 else 1)
    sinks = view_f32(op[F_SINKS], NH)
    out = view_f32(op[F_OUT], NH * D)
    _attend_heads(q, pos, cos, sin, words[0], keys, kc, sinks, words[1], out, it[b + 2], it[b + 3])


def attend_one(
    q: np.ndarray,
    pos: int,
    cos: np.ndarray,
    sin: np.ndarray,
    eps: float,
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
    """One token's attention from its raw query to its output, bit for bit
    ``heads_inplace(attend_one(heads_inplace(q, queries=True), ...), queries=False)`` of
    :mod:`moe_service.engine.ds4_compiled` in one pool job: phase 1 gathers the key rows
    (ranges of rows per worker), phase 2 gives each worker whole heads, whose q rows it
    prepares (per-head rms, rope, float16 rounding), attends and inverse-ropes. q float32
    [NH, D] C-contiguous, prepared in place; pos the token's position (n0); cos / sin float32
    [n_ctx, R/2]; the rest as ds4_compiled.attend_one's. Returns float32 [1, NH, D]. On the
    calling thread when the pool has one worker or the step is small. ValueError for shapes
    that do not agree, IndexError for a position outside the tables."""
    NH, D = q.shape
    W = ring.shape[0]
    if comp is None:
        comp = np.zeros((0, D), np.float16)
    idx = (
        np.arange(comp.shape[0], dtype=np.int64) if sel is None else np.ascontiguousarray(sel, dtype=np.int64)
    )
    c32 = np.ascontiguousarray(cos, dtype=np.float32)
    s32 = np.ascontiguousarray(sin, dtype=np.float32)
    half = c32.shape[1]
    if (
        q.dtype != np.float32
        or not q.flags.c_contiguous
        or ring.ndim != 2
        or ring.shape[1] != D
        or new.shape != (D,)
        or comp.shape[1:] != (D,)
        or sinks.shape != (NH,)
        or not (max(0, n0 - W + 1) <= lo <= n0)
        or s32.shape != c32.shape
        or not 0 < 2 * half <= D
        or cos.dtype != np.float32
    ):
        raise ValueError(
            f"ds4_decode.attend_one: q {q.shape} {q.dtype}, ring {ring.shape}, new {new.shape}, compressed "
            f"{comp.shape}, window {lo}..{n0}, sinks {sinks.shape}, tables {cos.shape} do not agree"
        )
    if not 0 <= pos < c32.shape[0]:
        raise IndexError(f"ds4_decode.attend_one: position {pos} outside the tables' {c32.shape[0]} rows")
    if idx.size and (idx.min() < 0 or idx.max() >= comp.shape[0]):
        raise ValueError(
            f"ds4_decode.attend_one: selected rows {idx.min()}..{idx.max()} outside {comp.shape[0]}"
        )
    n = n0 - lo + 1 + idx.shape[0]
    keys = np.empty((n, D), np.float32)
    kc = np.empty(n * D if D % 16 == 0 else 1, np.float32)
    out = np.empty(NH * D, np.float32)
    ring16 = np.ascontiguousarray(ring).view(np.uint16)
    new16 = np.ascontiguousarray(new, dtype=np.float16).view(np.uint16)
    comp16 = np.ascontiguousarray(comp, dtype=np.float16).view(np.uint16)
    s_w = np.ascontiguousarray(sinks, dtype=np.float32)
    p = np.array([pos], np.int64)
    qf = q.reshape(-1)
    n_workers = pool.n_workers if pool is not None else 1
    if n_workers > 1 and NH > 1 and n * NH * D >= _POOL_MIN_MACS:
        words = np.array([eps, np.float32(scale)], np.float64)
        sel_w = idx if idx.size else np.zeros(1, np.int64)
        comp_w = comp16 if comp16.shape[0] else np.zeros((1, D), np.uint16)
        op = np.zeros(F_LEN, np.int64)
        op[F_Q], op[F_POS], op[F_COS], op[F_SIN] = (
            qf.ctypes.data,
            p.ctypes.data,
            c32.ctypes.data,
            s32.ctypes.data,
        )
        op[F_NCTX], op[F_HALF], op[F_EPS] = c32.shape[0], half, words.ctypes.data
        op[F_RING], op[F_W], op[F_LO], op[F_N0], op[F_NEW] = ring16.ctypes.data, W, lo, n0, new16.ctypes.data
        op[F_COMP], op[F_NC], op[F_SEL], op[F_NS] = (
            comp_w.ctypes.data,
            comp16.shape[0],
            sel_w.ctypes.data,
            idx.size,
        )
        op[F_KEYS], op[F_KC], op[F_N], op[F_D], op[F_NH] = keys.ctypes.data, kc.ctypes.data, n, D, NH
        op[F_SINKS], op[F_OUT] = s_w.ctypes.data, out.ctypes.data
        rstep = -(-n // n_workers)
        g = _pool.call_item_address(_gather_item)
        gather = [(_pool.K_CALL, g, r, min(n, r + rstep)) for r in range(0, n, rstep)]
        # whole 4-head groups, at least one item per worker (as ds4_compiled._attend_one_keys)
        step = max(4, min(_ONE_HEADS, -(-NH // n_workers) // 4 * 4))
        f = _pool.call_item_address(_heads_item)
        heads = [(_pool.K_CALL, f, h, min(NH, h + step)) for h in range(0, NH, step)]
        job = _pool.Job.build([_pool._spread(gather, pool.n_nodes), _pool._spread(heads, pool.n_nodes)], op)
        pool.run_arrays(job.items, job.bounds, job.op)
    else:
        _gather_rows(ring16, lo, n0, new16, comp16, idx, keys, kc, 0, n)
        _attend_heads(
            qf, p, c32, s32, np.float64(eps), keys, kc, s_w, np.float64(np.float32(scale)), out, 0, NH
        )
    return out.reshape(1, NH, D)


# ---------------------------------------------------------------------------------------
# one token's routing


@njit(**_JIT)
def _route_one(probs, k, bias, fixed, norm, scale, ids, w):
    """ds4_ops.route for one token, compiled: probs float32 [E]; the experts of ``fixed`` int64
    [K] when it has K entries (a hash layer), else the k largest of probs + bias (float32
    sums; bias float32 [E] or empty), ties to the lower id and NaNs last in id order (numpy's
    stable argsort of the negated scores); w = probs of the chosen, divided when ``norm`` by
    max(their float64 sum (numpy's pairwise order), 2^-14) in float64 and rounded to float32,
    then times ``scale`` (float32) when scale is not 0 or 1. ids int32 [K], w float32 [K]
    (written)."""
    E = probs.shape[0]
    K = ids.shape[0]
    if fixed.shape[0] == K:
        for j in range(K):
            ids[j] = fixed[j]
    else:
        sel = np.empty(E, np.float32)
        taken = np.zeros(E, np.bool_)
        for e in range(E):
            sel[e] = probs[e] + bias[e] if bias.shape[0] == E else probs[e]
        for j in range(k):
            best = -1
            for e in range(
                E
            ):  # the largest not taken, the lower id on ties; NaN only when nothing else is left
                if taken[e] or sel[e] != sel[e]:
                    continue
                if best < 0 or sel[e] > sel[best]:
                    best = e
            if best < 0:
                for e in range(E):
                    if not taken[e]:
                        best = e
                        break
            taken[best] = True
            ids[j] = best
    for j in range(K):
        w[j] = probs[ids[j]]
    if norm:
        w64 = np.empty(K, np.float64)
        for j in range(K):
            w64[j] = np.float64(w[j])
        frames = np.empty((64, 3), np.int64)
        left = np.empty(64, np.float64)
        s = _pairwise_sum(w64, 0, K, frames, left)
        den = s if s != s or s > 6.103515625e-5 else 6.103515625e-5
        for j in range(K):
            w[j] = np.float32(w64[j] / den)
    if scale != 0.0 and scale != 1.0:
        f = np.float32(scale)
        for j in range(K):
            w[j] = w[j] * f


def route_one(
    probs: np.ndarray, k: int, bias: np.ndarray | None, fixed_ids: np.ndarray | None, norm: bool, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """``ds4_ops.route`` for a one-token step, the same bits (:func:`_route_one`): probs float32
    [1, E]; fixed_ids [1, K] (hash layers) or None. Returns (ids int32 [1, K], w float32
    [1, K]). ValueError for shapes that do not agree."""
    p = np.ascontiguousarray(probs, dtype=np.float32)
    E = p.shape[-1]
    if fixed_ids is not None:
        fx = np.ascontiguousarray(fixed_ids, dtype=np.int64).reshape(-1)
        K = fx.shape[0]
        if fx.size and (fx.min() < 0 or fx.max() >= E):
            raise ValueError(f"route_one: fixed expert ids {fx.min()}..{fx.max()} outside {E} experts")
    else:
        fx, K = np.zeros(0, np.int64), int(k)
    b_shape = None if bias is None else bias.shape
    if p.shape[0] != 1 or p.ndim != 2 or not 0 < K <= E or b_shape not in (None, (E,)):
        raise ValueError(f"route_one: probs {p.shape}, {K} experts a token, bias {b_shape} do not agree")
    b = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    ids = np.empty((1, K), np.int32)
    w = np.empty((1, K), np.float32)
    _route_one(p[0], K, b, fx, bool(norm), float(scale), ids[0], w[0])
    return ids, w
