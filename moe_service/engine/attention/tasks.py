"""The task kernels: what one pool item runs. A task is a row of the task table (layout:
TASK_W) over the op array of its call (layout: O_*).

Default mode (the two-pass contract): :func:`run_task_exact` (gather the query rows,
:func:`_tile_pass` over K, :func:`softmax._softmax_rows`, :func:`_tile_pass` over V); a decode
split by key range runs four phases: :func:`run_part_k`, :func:`run_norm`, :func:`run_part_v`,
:func:`run_combine`. Online mode: :func:`run_task` (one pass, running maximum), parts joined by
:func:`run_merge`. :func:`_item` is the one function the worker pool calls for every item
(pool.K_CALL, through :func:`item_address`); :func:`_run_serial` runs a small step's tasks on
the calling thread.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from moe_service.engine import pool as _pool
from moe_service.engine import quant as _q
from moe_service.engine.attention.cache_rows import _load_rows
from moe_service.engine.attention.layout import (
    _JIT,
    _JIT_VEC,
    FMT_F16,
    META_W,
    O_BK,
    O_D,
    O_DV,
    O_GROUP,
    O_HAS_SINKS,
    O_K_HEAD,
    O_K_POS,
    O_K_SEQ,
    O_KC,
    O_KFMT,
    O_META,
    O_NH,
    O_NTOK,
    O_OUT,
    O_PACC,
    O_PML,
    O_Q,
    O_RMAX,
    O_SC,
    O_SCALE,
    O_SINKS,
    O_TASKS,
    O_V_HEAD,
    O_V_POS,
    O_V_SEQ,
    O_VC,
    O_VFMT,
    O_WIDE,
    O_WINDOW,
    OP_LEN,
    TASK_W,
    _view_f64,
    _view_u16,
)
from moe_service.engine.attention.scores import (
    _score_heads_wide16,
    _score_keys,
    _score_keys4,
    _score_keys_wide16,
    _score_latent,
)
from moe_service.engine.attention.softmax import _exp_shifted, _finish_row, _row_keys, _softmax_rows
from moe_service.engine.attention.values import _pv, _pv_exact, _pv_heads_f16, _scale_row
from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits


@njit(**_JIT_VEC)
def run_task(op, tasks, ti, pml, pacc):
    """Task ``ti``: its query rows of every head of KV head g over keys k_lo..k_hi-1 (masked
    per row: causal and window), online softmax; the normalised result into out (part < 0)
    or (m, l, acc) into partial slot ``part`` of pml float64 [*, RMAX, 2] / pacc float32
    [*, RMAX, Dv] (flat)."""
    nh, d, dv, group, bk = op[O_NH], op[O_D], op[O_DV], op[O_GROUP], op[O_BK]
    ntok = op[O_NTOK]
    tb = ti * TASK_W
    seq, t_lo, t_hi, p0 = tasks[tb], tasks[tb + 1], tasks[tb + 2], tasks[tb + 3]
    g, k_lo, k_hi, part = tasks[tb + 4], tasks[tb + 5], tasks[tb + 6], tasks[tb + 7]
    scale = _q.view_f32(op.ctypes.data + 8 * O_SCALE, 1)[0]
    window = op[O_WINDOW]
    nq = t_hi - t_lo
    R = nq * group
    qb = _gather_q(op, t_lo, nq, g, 0, group)
    m = np.full(R, -np.inf, np.float32)
    lsum = np.zeros(R, np.float64)
    acc = np.zeros(R * dv, np.float32)
    kt = np.empty(bk * d, np.float32)
    vt = np.empty(bk * dv, np.float32)
    s = np.empty(bk, np.float32)
    p_last = p0 + nq - 1
    j_end = min(k_hi, p_last + 1)
    j_start = k_lo
    if window > 0:
        j_start = max(k_lo, p0 - window + 1)
    kfmt, kseq, kpos, khead = op[O_KFMT], op[O_K_SEQ], op[O_K_POS], op[O_K_HEAD]
    vfmt, vseq, vpos, vhead = op[O_VFMT], op[O_V_SEQ], op[O_V_POS], op[O_V_HEAD]
    wide = op[O_WIDE] != 0
    for j0 in range(j_start, j_end, bk):
        nb = min(bk, j_end - j0)
        _load_rows(op[O_KC], kfmt, seq * kseq + j0 * kpos + g * khead, kpos, nb, d, kt)
        _load_rows(op[O_VC], vfmt, seq * vseq + j0 * vpos + g * vhead, vpos, nb, dv, vt)
        for tt in range(nq):
            jlo, jhi = _row_keys(p0 + tt, window, j0, j0 + nb)
            if jhi <= jlo:
                continue
            ja, jb = jlo - j0, jhi - j0
            for hh in range(group):
                r = tt * group + hh
                mx = max(m[r], _score_keys(qb, r * d, kt, 0, d, s, 0, ja, jb, d, scale, wide))
                if mx > m[r]:
                    if m[r] > -np.inf:
                        f = np.exp(m[r] - mx)
                        lsum[r] *= np.float64(f)
                        _scale_row(acc, r * dv, f, dv)
                    m[r] = mx
                lsum[r] += _exp_shifted(s, ja, jb, mx)
                _pv(acc, r * dv, s, vt, ja, jb, dv)
    if part < 0:
        out = _q.view_f32(op[O_OUT], ntok * nh * dv)
        sinks = _q.view_f32(op[O_SINKS], nh)
        for tt in range(nq):
            for hh in range(group):
                r = tt * group + hh
                h = g * group + hh
                _finish_row(out, ((t_lo + tt) * nh + h) * dv, acc, r * dv, m[r], lsum[r], dv,
                            op[O_HAS_SINKS] != 0, sinks[h])
    else:
        rmax = op[O_RMAX]
        for r in range(R):
            pml[(part * rmax + r) * 2] = m[r]
            pml[(part * rmax + r) * 2 + 1] = lsum[r]
            o = (part * rmax + r) * dv
            for i in range(dv):
                pacc[o + i] = acc[r * dv + i]


@njit(**_JIT_VEC)
def _gather_q(op, t_lo, nq, g, h_lo, gh):
    """The query rows of tokens t_lo..t_lo+nq-1 x heads h_lo..h_lo+gh-1 of KV head g's group,
    rounded to float16 (as float32): float32 [nq * gh * D], row r = tt * gh + hh."""
    nh, d, group = op[O_NH], op[O_D], op[O_GROUP]
    q = _q.view_f32(op[O_Q], op[O_NTOK] * nh * d)
    qb = np.empty(nq * gh * d, np.float32)
    for tt in range(nq):
        for hh in range(gh):
            qo = ((t_lo + tt) * nh + g * group + h_lo + hh) * d
            for i in range(d):
                qb[(tt * gh + hh) * d + i] = _f16_bits_to_f32(_f32_to_f16_bits(q[qo + i]))
    return qb


@njit(**_JIT_VEC)
def _tile_pass(op, values, qb, seq, p0, nq, gh, g, kp_lo, kp_hi, sc, so, L, mrow, acc, ao):
    """One pass of the two-pass contract over keys kp_lo..kp_hi-1, key tile by key tile (a
    tile serves every row), each row masked (causal, window); rows r = tt * gh + hh, their
    values at sc[so + r * L + j] (so already minus the row's first key).

    values False (the K pass): sc = (q_r . k_j) * scale for the query rows in qb, mrow[r]
    raised to the row's maximum. values True (the V pass): acc[ao + r * Dv ...] += the
    probabilities in sc times V in key order. A float16 cache is read in place; a Q8_0 cache
    is widened to a float32 tile first."""
    bk, window, d = op[O_BK], op[O_WINDOW], op[O_D]
    if values:
        n_dim, fmt, pos, addr = op[O_DV], op[O_VFMT], op[O_V_POS], op[O_VC]
        base = seq * op[O_V_SEQ] + g * op[O_V_HEAD]
    else:
        n_dim, fmt, pos, addr = d, op[O_KFMT], op[O_K_POS], op[O_KC]
        base = seq * op[O_K_SEQ] + g * op[O_K_HEAD]
    scale = _q.view_f32(op.ctypes.data + 8 * O_SCALE, 1)[0]
    wide = op[O_WIDE] != 0
    c16 = _view_u16(addr, 1)
    # A prefill widens each key tile once into a contiguous float32 tile that all its rows
    # read. Read in place, one KV head's rows sit NKV x D x 2 bytes apart, so a tile's lines
    # share few L1 sets with the query rows and scores. Measured on Qwen3-30B-A3B shapes (32
    # heads, 4 KV heads, D = 128), 128 new tokens at depth 3968, two threads: 9.2 -> 8.8 ns
    # per (head, key) for the whole attend call. A Q8_0 cache is always widened.
    tiled = fmt != FMT_F16 or not wide
    tile = np.empty(bk * n_dim if tiled else 1, np.float32)
    ltile = np.empty(8 * n_dim if (fmt == FMT_F16 and not values and wide and n_dim == 576) else 1, np.float32)
    for j0 in range(kp_lo, kp_hi, bk):
        nb = min(bk, kp_hi - j0)
        if tiled:
            _load_rows(addr, fmt, base + j0 * pos, pos, nb, n_dim, tile)
        for tt in range(nq):
            jlo, jhi = _row_keys(p0 + tt, window, j0, j0 + nb)
            if jhi <= jlo:
                continue
            hh0 = 0
            if not values and not wide and d % 16 == 0:  # prefill: two to four heads of the token per K read
                while hh0 + 2 <= gh:
                    r = tt * gh + hh0
                    nr = min(6 if d == 576 else 4, gh - hh0)
                    _score_keys4(qb, r * d, d, tile, -j0 * d, d, sc, so + r * L, L, jlo, jhi, scale, mrow, r, nr)
                    hh0 += nr
            elif not values and wide and fmt == FMT_F16 and gh >= 8 and d == 576:  # a latent cache: K widened once
                r = tt * gh
                _score_latent(qb, r * d, gh, c16, base, pos, sc, so + r * L, L, jlo, jhi, d, scale, mrow, r, ltile)
                hh0 = gh
            elif not values and wide and fmt == FMT_F16 and gh > 1 and (d == 64 or d == 128):  # the group's heads per K read
                r = tt * gh
                _score_heads_wide16(qb, r * d, gh, c16, base, pos, sc, so + r * L, L, jlo, jhi, d, scale, mrow, r)
                hh0 = gh
            elif values and fmt == FMT_F16 and n_dim % 16 == 0:  # the token's heads per V read
                r = tt * gh
                if tiled:
                    _pv_heads_f16(acc, ao + r * n_dim, gh, sc, so + r * L, L, tile, -j0 * n_dim, n_dim, jlo, jhi, n_dim,
                                  n_dim >= 256)  # (six heads per value read: a latent cache's 512 dims)
                else:
                    _pv_heads_f16(acc, ao + r * n_dim, gh, sc, so + r * L, L, c16, base, pos, jlo, jhi, n_dim)
                hh0 = gh
            for hh in range(hh0, gh):
                r = tt * gh + hh
                if values and not tiled:
                    _pv_exact(acc, ao + r * n_dim, sc, so + r * L, c16, base, pos, jlo, jhi, n_dim)
                elif values:
                    _pv_exact(acc, ao + r * n_dim, sc, so + r * L, tile, -j0 * n_dim, n_dim, jlo, jhi, n_dim)
                else:
                    if not tiled and d % 64 == 0:
                        mx = _score_keys_wide16(qb, r * d, c16, base, pos, sc, so + r * L, jlo, jhi, d, scale)
                    elif not tiled:
                        mx = _score_keys(qb, r * d, c16, base, pos, sc, so + r * L, jlo, jhi, d, scale, wide)
                    else:
                        mx = _score_keys(qb, r * d, tile, -j0 * d, d, sc, so + r * L, jlo, jhi, d, scale, wide)
                    if mx > mrow[r]:
                        mrow[r] = mx


@njit(**_JIT_VEC)
def run_task_exact(op, tasks, ti):
    """Task ``ti`` with the two-pass softmax of the package docstring's contract: the scores of
    every key of the task's range for its R query rows (heads h_lo..h_hi-1 of the group) into
    a scratch [R, L] while streaming K once, then per row the maximum, the float64 sum of the
    exponentials and the float16-rounded probabilities, then P.V streaming V once."""
    nh, dv, group = op[O_NH], op[O_DV], op[O_GROUP]
    tb = ti * TASK_W
    seq, t_lo, t_hi, p0 = tasks[tb], tasks[tb + 1], tasks[tb + 2], tasks[tb + 3]
    g, h_lo, h_hi = tasks[tb + 4], tasks[tb + 5], tasks[tb + 6]
    nq = t_hi - t_lo
    gh = h_hi - h_lo
    R = nq * gh
    qb = _gather_q(op, t_lo, nq, g, h_lo, gh)
    j_end = p0 + nq
    j_start = max(0, p0 - op[O_WINDOW] + 1) if op[O_WINDOW] > 0 else 0
    L = j_end - j_start
    sc = np.empty(R * L, np.float32)
    mrow = np.full(R, -np.inf, np.float32)
    acc = np.zeros(R * dv, np.float32)
    _tile_pass(op, False, qb, seq, p0, nq, gh, g, j_start, j_end, sc, -j_start, L, mrow, acc, 0)
    _softmax_rows(op, sc, 0, L, j_start, p0, nq, gh, g, h_lo, mrow)
    _tile_pass(op, True, qb, seq, p0, nq, gh, g, j_start, j_end, sc, -j_start, L, mrow, acc, 0)
    out = _q.view_f32(op[O_OUT], op[O_NTOK] * nh * dv)
    for tt in range(nq):
        for hh in range(gh):
            r = tt * gh + hh
            o = ((t_lo + tt) * nh + g * group + h_lo + hh) * dv
            for i in range(dv):
                _q.st(out, o + i, acc[r * dv + i])


@njit(**_JIT_VEC)
def _part_rows(op, tasks, ti, meta):
    """(seq, t_lo, nq, p0, g, heads part gh, h_lo, key range, meta row) of split part ``ti``."""
    tb = ti * TASK_W
    mi = tasks[tb + 7]
    mb = mi * META_W
    return (tasks[tb], tasks[tb + 1], tasks[tb + 2] - tasks[tb + 1], tasks[tb + 3], tasks[tb + 4],
            meta[mb + 4] - meta[mb + 3], meta[mb + 3], tasks[tb + 5], tasks[tb + 6], mb)


@njit(**_JIT_VEC)
def run_part_k(op, tasks, ti, meta, sc):
    """Exact split, phase 0: the scores of keys kp_lo..kp_hi-1 for the group's rows into the
    group's scores buffer (as run_task_exact's first pass, over one key range)."""
    seq, t_lo, nq, p0, g, gh, h_lo, kp_lo, kp_hi, mb = _part_rows(op, tasks, ti, meta)
    qb = _gather_q(op, t_lo, nq, g, h_lo, gh)
    mrow = np.full(nq * gh, -np.inf, np.float32)
    _tile_pass(op, False, qb, seq, p0, nq, gh, g, kp_lo, kp_hi, sc, meta[mb] - meta[mb + 2], meta[mb + 1], mrow,
               mrow, 0)


@njit(**_JIT_VEC)
def run_norm(op, tasks, meta, mi, sc):
    """Exact split, phase 1: per row of group ``mi`` the maximum over all its keys (and the
    sink), the float64 sum of the exponentials (:func:`_exp_shifted`), float16 probabilities in place."""
    mb = mi * META_W
    ti = meta[mb + 5]
    tb = ti * TASK_W
    nq, p0, g = tasks[tb + 2] - tasks[tb + 1], tasks[tb + 3], tasks[tb + 4]
    sc_off, L, j_start, h_lo, gh = meta[mb], meta[mb + 1], meta[mb + 2], meta[mb + 3], meta[mb + 4] - meta[mb + 3]
    window = op[O_WINDOW]
    mrow = np.empty(nq * gh, np.float32)
    for tt in range(nq):
        lo, hi = _row_keys(p0 + tt, window, j_start, p0 + tt + 1)
        for hh in range(gh):
            r = tt * gh + hh
            mx = np.float32(-np.inf)
            for j in range(sc_off + r * L + lo - j_start, sc_off + r * L + hi - j_start):
                mx = max(mx, _q.ld(sc, j))
            mrow[r] = mx
    _softmax_rows(op, sc, sc_off, L, j_start, p0, nq, gh, g, h_lo, mrow)


@njit(**_JIT_VEC)
def run_part_v(op, tasks, ti, meta, sc, pacc):
    """Exact split, phase 2: P.V over keys kp_lo..kp_hi-1 into this part's partial rows."""
    seq, t_lo, nq, p0, g, gh, h_lo, kp_lo, kp_hi, mb = _part_rows(op, tasks, ti, meta)
    dv = op[O_DV]
    R = nq * gh
    ao = (meta[mb + 7] + (ti - meta[mb + 5]) * R) * dv  # meta[7]: the group's first partial row
    for i in range(R * dv):
        pacc[ao + i] = 0.0
    _tile_pass(op, True, pacc, seq, p0, nq, gh, g, kp_lo, kp_hi, sc, meta[mb] - meta[mb + 2], meta[mb + 1],
               pacc, pacc, ao)  # (qb and mrow unused by the V pass)


@njit(**_JIT_VEC)
def run_combine(op, tasks, meta, mi, pacc):
    """Exact split, phase 3: out = the parts' partial P.V summed in part (key) order."""
    mb = mi * META_W
    ti = meta[mb + 5]
    tb = ti * TASK_W
    t_lo, nq, g = tasks[tb + 1], tasks[tb + 2] - tasks[tb + 1], tasks[tb + 4]
    h_lo, gh, n_parts, acc0 = meta[mb + 3], meta[mb + 4] - meta[mb + 3], meta[mb + 6], meta[mb + 7]
    nh, dv, group = op[O_NH], op[O_DV], op[O_GROUP]
    R = nq * gh
    out = _q.view_f32(op[O_OUT], op[O_NTOK] * nh * dv)
    for tt in range(nq):
        for hh in range(gh):
            r = tt * gh + hh
            o = ((t_lo + tt) * nh + g * group + h_lo + hh) * dv
            for i in range(dv):
                a = _q.ld(pacc, (acc0 + r) * dv + i)
                for c in range(1, n_parts):
                    a += _q.ld(pacc, (acc0 + c * R + r) * dv + i)
                _q.st(out, o + i, a)


@njit(**_JIT_VEC)
def run_merge(op, tasks, first, n_parts, pml, pacc):
    """Combine the partial results of tasks first..first+n_parts-1 (same rows and head,
    consecutive key ranges) into out: M = max m_c, l = sum l_c exp(m_c - M), acc likewise."""
    nh, dv, group, rmax, ntok = op[O_NH], op[O_DV], op[O_GROUP], op[O_RMAX], op[O_NTOK]
    tb = first * TASK_W
    t_lo, t_hi, g = tasks[tb + 1], tasks[tb + 2], tasks[tb + 4]
    nq = t_hi - t_lo
    out = _q.view_f32(op[O_OUT], ntok * nh * dv)
    sinks = _q.view_f32(op[O_SINKS], nh)
    acc = np.zeros(dv, np.float32)
    for tt in range(nq):
        for hh in range(group):
            r = tt * group + hh
            mx = np.float32(-np.inf)
            for c in range(n_parts):
                part = tasks[(first + c) * TASK_W + 7]
                mc = np.float32(pml[(part * rmax + r) * 2])
                if mc > mx:
                    mx = mc
            lsum = 0.0
            for i in range(dv):
                acc[i] = 0.0
            for c in range(n_parts):
                part = tasks[(first + c) * TASK_W + 7]
                mc = np.float32(pml[(part * rmax + r) * 2])
                if mc == -np.inf:
                    continue
                f = np.exp(mc - mx)
                lsum += pml[(part * rmax + r) * 2 + 1] * np.float64(f)
                o = (part * rmax + r) * dv
                for i in range(dv):
                    _q.st(acc, i, _q.ld(acc, i) + _q.ld(pacc, o + i) * f)
            h = g * group + hh
            _finish_row(out, ((t_lo + tt) * nh + h) * dv, acc, 0, mx, lsum, dv, op[O_HAS_SINKS] != 0, sinks[h])


# Item fields: (K_CALL, fn address, kind, a, b): kind 0 = online task a; kind 1 = merge of
# online tasks a..a+b-1; kind 2 = exact (two-pass) task a; kinds 3-6 = the exact split
# decode's phases (K part a, normalise group a, V part a, combine group a).
def _item(items_ptr, i, op_ptr):
    """A K_CALL item (compiled as a cfunc of pool.CALL_ITEM_SIG by item_address)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, OP_LEN)
    b = i * _pool.ITEM_W
    tasks = _q.view_i64(op[O_TASKS], 1)
    pml = _view_f64(op[O_PML], 1)
    pacc = _q.view_f32(op[O_PACC], 1)
    kind = it[b + 2]
    if kind == 2:
        run_task_exact(op, tasks, it[b + 3])
    elif kind >= 3:
        meta = _q.view_i64(op[O_META], 1)
        sc = _q.view_f32(op[O_SC], 1)
        if kind == 3:
            run_part_k(op, tasks, it[b + 3], meta, sc)
        elif kind == 4:
            run_norm(op, tasks, meta, it[b + 3], sc)
        elif kind == 5:
            run_part_v(op, tasks, it[b + 3], meta, sc, pacc)
        else:
            run_combine(op, tasks, meta, it[b + 3], pacc)
    elif kind == 0:
        run_task(op, tasks, it[b + 3], pml, pacc)
    else:
        run_merge(op, tasks, it[b + 3], it[b + 4], pml, pacc)


def item_address() -> int:
    """Address of the compiled item function (pool.K_CALL), compiled or loaded once."""
    return _pool.call_item_address(_item)


@njit(**_JIT)
def _run_serial(op, tasks, n_tasks, pml, pacc, exact):
    """Every task on the calling thread (none split): small steps skip the pool dispatch."""
    for ti in range(n_tasks):
        if exact:
            run_task_exact(op, tasks, ti)
        else:
            run_task(op, tasks, ti, pml, pacc)
