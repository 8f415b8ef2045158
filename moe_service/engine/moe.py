"""Fused MoE FFN on the CPU worker pool: experts read in place from their node's copy.

Shape legend: T tokens, K experts per token (top-k), E experts, C copies per expert
(primary + replicas), H hidden, I expert width, P = T*K (token, slot) pairs, G expert
groups (distinct experts chosen in this step).

::

    ids [T, K], w [T, K] ─group─> pairs sorted by expert: pair_tok [P], groups (e, p0, p1)
            │                      assign: row chunks of each group -> least-loaded node
            │                      holding a copy (replicas balance nodes; own node first,
            │                      then steal)
            v
    phase 0  QX      x [T, H] -> gate/up partner format (once per token)       items: token ranges
    phase 1  GATEUP  GU[p, r] = act(gate_e x_t + bg, up_e x_t + bu), r in chunk  items: (e, rows, copy)
    phase 2  QH      h = GU[p, :I] -> down partner format (once per pair)       items: pair ranges
    phase 3  DOWN    Y[p, r] = down_e h_p + bd, r in chunk                       items: (e, rows, copy)
    phase 4  COMBINE out[t, c] = sum_k w[t,k] * Y[pair(t,k), c], k in order     items: column ranges

Each expert's weights are streamed once per step however many tokens chose it (the
kernels dot each weight row with the group's tokens 4 at a time). Every item writes a
disjoint block of GU / Y / out, so no locks. Row chunks are sized so that the step has
enough items for every worker (on 96 threads each expert's rows are cut into up to I/16
chunks) and so that no item streams more than ``max_item_bytes`` (4 MiB) of weights: few
large experts (DeepSeek-V3: 16.5 MB of gate+up per expert) would otherwise make T=1 on 2
threads 8 items of ~2 ms per phase, and a worker that the OS preempts (or that is just
slower) holding one leaves the other spinning at the phase barrier. Chunk edges are
multiples of 16 rows (whole kernel tiles).

act: SiLU(g) * u (ggml's swiglu), or gpt-oss' clamped form g' = min(g, limit),
u' = clamp(u, -limit, limit), out = g' * sigmoid(alpha g') * (u' + 1). Optional per-expert
biases (gpt-oss) are float32 tensors in the arena, added to gate/up/down outputs.

``MoE.forward(..., fused=False)`` is the kill switch: a straightforward single-threaded
per-(token, expert) path through quant.matmul, used as the reference in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from moe_service.engine import quant as _q
from moe_service.engine.quant import (
    bits_f32,
    ld,
    ld_f32,
    st,
    view_f32,
    view_i8,
    view_i16,
    view_i64,
    view_u8,
)

__all__ = ["MoE", "ExpertWeights", "assign_items", "ACT_SILU", "ACT_SWIGLU_OAI", "ACT_SWIGLU_CLAMP",
           "K_MOE_FIRST", "K_MOE_LAST", "run_moe_item", "group_pairs"]

ACT_SILU = 0
ACT_SWIGLU_OAI = 1  # gpt-oss: clamped SwiGLU with alpha, limit
ACT_SWIGLU_CLAMP = 2  # deepseek4 (ggml_swiglu_clamp): silu(min(g, limit)) * clamp(u, -limit, limit)

# Item kinds (the pool's executor hands kinds K_MOE_FIRST..K_MOE_LAST to run_moe_item).
K_MOE_QX = 10  # (kind, which: 0 gate / 1 up partner, t_lo, t_hi)
K_MOE_GATEUP = 11  # (kind, expert, p0, p1, r_lo, r_hi, gate byte offset, up byte offset)
K_MOE_QH = 12  # (kind, p_lo, p_hi)
K_MOE_DOWN = 13  # (kind, expert, p0, p1, r_lo, r_hi, down byte offset)
K_MOE_COMBINE = 14  # (kind, t_lo, t_hi, c_lo, c_hi)
K_MOE_FIRST = K_MOE_QX
K_MOE_LAST = K_MOE_COMBINE

# Op array layout (int64): addresses of the step's buffers and its scalars.
M_ARENA = 0
M_X = 1  # float32 [T, H]
M_T = 2
M_H = 3
M_I = 4
M_K = 5
M_G_TYPE = 6
M_U_TYPE = 7
M_D_TYPE = 8
M_FUSED = 9  # 1: one gate_up tensor (gate rows first)
M_G_PARTNER = 10
M_U_PARTNER = 11
M_D_PARTNER = 12
M_XG = 16  # 5 addresses: gate-partner xf, xq, xd, xs, xbs [T, H]
M_XU = 21  # 5 addresses: up-partner arrays (the same as M_XG when the partners agree)
M_HQ = 26  # 5 addresses: down-partner arrays [P, I]
M_GU = 31  # float32 [P, 2I]: gate outputs (then act) in [:, :I], up outputs in [:, I:]
M_Y = 32  # float32 [P, H]
M_OUT = 33  # float32 [T, H]
M_PAIR_TOK = 34  # int64 [P]: token of each pair, pairs sorted by expert
M_PAIR_IDX = 35  # int64 [P]: arange(P)
M_SLOT_PAIR = 36  # int64 [T*K]: pair index of (t, k)
M_W = 37  # float32 [T*K] routing weights
M_ACT = 38
M_ALPHA = 39  # float32 bits
M_LIMIT = 40  # float32 bits
M_BIAS_G = 41  # arena byte offset of float32 gate bias [E, stride] or -1
M_BIAS_U = 42
M_BIAS_STRIDE = 43  # elements per expert in the gate/up bias tensors
M_BIAS_D = 44  # arena byte offset of float32 down bias [E, H] or -1
M_G_ROWB = 45
M_U_ROWB = 46
M_D_ROWB = 47
M_P = 48
M_KERNELS = 49  # address of quant's kernel table
OP_LEN = 56

# A typed zero: a literal 0 argument would make numba compile a second specialization of
# matmul_rows (Literal[int] instead of int64) and double the cold compile time.
_ZERO = np.int64(0)


# ---------------------------------------------------------------------------------------
# Numba: activation, items
# ---------------------------------------------------------------------------------------


@njit(nogil=True, cache=True, inline="always")
def act_value(kind, g, u, alpha, limit):
    """One activation value: SiLU(g)*u as ggml (g / (1 + expf(-g)) * u), or gpt-oss' clamped
    SwiGLU (ggml's swiglu_oai): min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u) + 1)."""
    if kind == ACT_SILU:
        return g / (np.float32(1.0) + np.exp(-g)) * u
    x = min(g, limit)
    y = min(max(u, -limit), limit)
    if kind == ACT_SWIGLU_CLAMP:
        return x / (np.float32(1.0) + np.exp(-x)) * y
    return x / (np.float32(1.0) + np.exp(alpha * -x)) * (y + np.float32(1.0))


@njit(nogil=True, cache=True)
def act_rows(kind, g, u, alpha, limit, out):
    """out[i] = act_value(g[i], u[i]) over flat float32 arrays (the reference path)."""
    for i in range(g.shape[0]):
        out[i] = act_value(kind, g[i], u[i], alpha, limit)


@njit(nogil=True, cache=True)
def _partner_views(op, base, n_rows, n):
    big = n_rows * n
    return (view_f32(ld(op, base), big), view_i8(ld(op, base + 1), big), view_f32(ld(op, base + 2), big),
            view_f32(ld(op, base + 3), big), view_i16(ld(op, base + 4), big))


@njit(nogil=True, cache=True)
def _item_qx(op, which, t_lo, t_hi):
    n_tok = ld(op, M_T)
    h = ld(op, M_H)
    partner = ld(op, M_G_PARTNER if which == 0 else M_U_PARTNER)
    xf, xq, xd, xs, xbs = _partner_views(op, M_XG if which == 0 else M_XU, n_tok, h)
    _q.quantize_partner_rows_range(partner, view_f32(ld(op, M_X), n_tok * h), t_lo, t_hi, h, xf, xq, xd, xs, xbs)


@njit(nogil=True, cache=True)
def _item_gateup(op, e, p0, p1, r_lo, r_hi, off_g, off_u):
    n_tok = ld(op, M_T)
    h = ld(op, M_H)
    i_w = ld(op, M_I)
    n_pairs = ld(op, M_P)
    arena = view_u8(ld(op, M_ARENA), 1)
    gu = view_f32(ld(op, M_GU), n_pairs * 2 * i_w)
    a_rows = view_i64(ld(op, M_PAIR_TOK) + 8 * p0, p1 - p0)
    o_rows = view_i64(ld(op, M_PAIR_IDX) + 8 * p0, p1 - p0)
    gf, gq, gd, gs, gb = _partner_views(op, M_XG, n_tok, h)
    kernels = view_i64(ld(op, M_KERNELS), 64)
    if ld(op, M_FUSED) == 1:
        _q.matmul_rows(arena, off_g, ld(op, M_G_TYPE), h, ld(op, M_G_ROWB), r_lo, r_hi, gf, gq, gd, gs, gb,
                       a_rows, o_rows, gu, 2 * i_w, _ZERO, kernels)
        _q.matmul_rows(arena, off_g, ld(op, M_G_TYPE), h, ld(op, M_G_ROWB), i_w + r_lo, i_w + r_hi, gf, gq, gd, gs,
                       gb, a_rows, o_rows, gu, 2 * i_w, _ZERO, kernels)
    else:
        uf, uq, ud, us, ub = _partner_views(op, M_XU, n_tok, h)
        _q.matmul_rows(arena, off_g, ld(op, M_G_TYPE), h, ld(op, M_G_ROWB), r_lo, r_hi, gf, gq, gd, gs, gb,
                       a_rows, o_rows, gu, 2 * i_w, _ZERO, kernels)
        _q.matmul_rows(arena, off_u, ld(op, M_U_TYPE), h, ld(op, M_U_ROWB), r_lo, r_hi, uf, uq, ud, us, ub,
                       a_rows, o_rows, gu, 2 * i_w, i_w, kernels)
    kind = ld(op, M_ACT)
    alpha = bits_f32(ld(op, M_ALPHA))
    limit = bits_f32(ld(op, M_LIMIT))
    bg = ld(op, M_BIAS_G)
    bu = ld(op, M_BIAS_U)
    bstride = ld(op, M_BIAS_STRIDE)
    for p in range(p0, p1):
        row = p * 2 * i_w
        for r in range(r_lo, r_hi):
            g = ld(gu, row + r)
            u = ld(gu, row + i_w + r)
            if bg >= 0:
                g = g + ld_f32(arena, bg + 4 * (e * bstride + r))
            if bu >= 0:
                u = u + ld_f32(arena, bu + 4 * (e * bstride + r))
            st(gu, row + r, act_value(kind, g, u, alpha, limit))


@njit(nogil=True, cache=True)
def _item_qh(op, p_lo, p_hi):
    i_w = ld(op, M_I)
    n_pairs = ld(op, M_P)
    gu = view_f32(ld(op, M_GU), n_pairs * 2 * i_w)
    xf, xq, xd, xs, xbs = _partner_views(op, M_HQ, n_pairs, i_w)
    partner = ld(op, M_D_PARTNER)
    for p in range(p_lo, p_hi):
        _q.quantize_partner_row(partner, gu, p * 2 * i_w, i_w, xf, xq, xd, xs, xbs, p)


@njit(nogil=True, cache=True)
def _item_down(op, e, p0, p1, r_lo, r_hi, off_d):
    h = ld(op, M_H)
    i_w = ld(op, M_I)
    n_pairs = ld(op, M_P)
    arena = view_u8(ld(op, M_ARENA), 1)
    y = view_f32(ld(op, M_Y), n_pairs * h)
    rows = view_i64(ld(op, M_PAIR_IDX) + 8 * p0, p1 - p0)
    xf, xq, xd, xs, xbs = _partner_views(op, M_HQ, n_pairs, i_w)
    _q.matmul_rows(arena, off_d, ld(op, M_D_TYPE), i_w, ld(op, M_D_ROWB), r_lo, r_hi, xf, xq, xd, xs, xbs,
                   rows, rows, y, h, _ZERO, view_i64(ld(op, M_KERNELS), 64))
    bd = ld(op, M_BIAS_D)
    if bd >= 0:
        for p in range(p0, p1):
            for r in range(r_lo, r_hi):
                st(y, p * h + r, ld(y, p * h + r) + ld_f32(arena, bd + 4 * (e * h + r)))


@njit(nogil=True, cache=True)
def _item_combine(op, t_lo, t_hi, c_lo, c_hi):
    h = ld(op, M_H)
    k_n = ld(op, M_K)
    n_pairs = ld(op, M_P)
    n_tok = ld(op, M_T)
    y = view_f32(ld(op, M_Y), n_pairs * h)
    out = view_f32(ld(op, M_OUT), n_tok * h)
    w = view_f32(ld(op, M_W), n_tok * k_n)
    slot_pair = view_i64(ld(op, M_SLOT_PAIR), n_tok * k_n)
    for t in range(t_lo, t_hi):
        p = ld(slot_pair, t * k_n)
        wk = ld(w, t * k_n)
        for c in range(c_lo, c_hi):
            st(out, t * h + c, ld(y, p * h + c) * wk)
        for k in range(1, k_n):  # ((y0 w0 + y1 w1) + y2 w2) + ...: ggml's order
            p = ld(slot_pair, t * k_n + k)
            wk = ld(w, t * k_n + k)
            for c in range(c_lo, c_hi):
                st(out, t * h + c, ld(out, t * h + c) + ld(y, p * h + c) * wk)


@njit(nogil=True, cache=True)
def run_moe_item(items, i, op):
    """Execute MoE item i (int64 [*, 8] rows; see the K_MOE_* layouts)."""
    b = i * 8
    kind = ld(items, b)
    if kind == K_MOE_GATEUP:
        _item_gateup(op, ld(items, b + 1), ld(items, b + 2), ld(items, b + 3), ld(items, b + 4),
                     ld(items, b + 5), ld(items, b + 6), ld(items, b + 7))
    elif kind == K_MOE_DOWN:
        _item_down(op, ld(items, b + 1), ld(items, b + 2), ld(items, b + 3), ld(items, b + 4),
                   ld(items, b + 5), ld(items, b + 6))
    elif kind == K_MOE_QX:
        _item_qx(op, ld(items, b + 1), ld(items, b + 2), ld(items, b + 3))
    elif kind == K_MOE_QH:
        _item_qh(op, ld(items, b + 1), ld(items, b + 2))
    elif kind == K_MOE_COMBINE:
        _item_combine(op, ld(items, b + 1), ld(items, b + 2), ld(items, b + 3), ld(items, b + 4))


# ---------------------------------------------------------------------------------------
# Numba: grouping and assignment (pure integer logic, testable without kernels)
# ---------------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def group_pairs(ids, n_expert):
    """Group the (token, slot) pairs of ids int32 [T, K] by expert (counting sort, stable).

    Returns pair_tok int64 [P] (token of each pair, pairs sorted by expert then token),
    slot_pair int64 [T*K] (pair index of (t, k)), and groups int64 [G, 3] = (expert, p0, p1).
    Raises ValueError for an expert id outside [0, n_expert).
    """
    n_tok, k_n = ids.shape
    counts = np.zeros(n_expert + 1, np.int64)
    for t in range(n_tok):
        for k in range(k_n):
            e = ids[t, k]
            if e < 0 or e >= n_expert:
                raise ValueError("expert id out of range")
            counts[e + 1] += 1
    n_groups = 0
    for e in range(n_expert):
        if counts[e + 1] > 0:
            n_groups += 1
        counts[e + 1] += counts[e]
    pos = counts[:n_expert].copy()
    pair_tok = np.empty(n_tok * k_n, np.int64)
    slot_pair = np.empty(n_tok * k_n, np.int64)
    for t in range(n_tok):
        for k in range(k_n):
            e = ids[t, k]
            p = pos[e]
            pos[e] += 1
            pair_tok[p] = t
            slot_pair[t * k_n + k] = p
    groups = np.empty((n_groups, 3), np.int64)
    g = 0
    for e in range(n_expert):
        if counts[e + 1] > counts[e]:
            groups[g, 0] = e
            groups[g, 1] = counts[e]
            groups[g, 2] = counts[e + 1]
            g += 1
    return pair_tok, slot_pair, groups


@njit(nogil=True, cache=True)
def assign_chunks(groups, copy_nodes, node_index, n_nodes, expert_cost, token_cost, n_chunks):
    """Send each row chunk of each expert group to the least-loaded node holding a copy.

    groups int64 [G, 3] (expert, p0, p1); copy_nodes int32 [E, C] (node id per copy, -1 =
    none); node_index int64 [max node id + 1]: dense pool node of a node id (-1: no workers
    there); expert_cost float64 [E]: cost of streaming one expert (e.g. its bytes);
    token_cost: extra cost per additional token of a group, relative to expert_cost;
    n_chunks: row chunks per group. Groups are placed largest cost first (LPT); a chunk
    goes to the copy whose node has the least load so far (ties: the earlier copy, i.e. the
    primary). A group with no copy on a node that has workers goes to node 0.

    Returns chunk_copy int64 [G, n_chunks] (copy index used), chunk_node int64 [G, n_chunks]
    (dense node) and node_load float64 [n_nodes].
    """
    n_groups = groups.shape[0]
    n_copies = copy_nodes.shape[1]
    load = np.zeros(n_nodes, np.float64)
    chunk_copy = np.zeros((n_groups, n_chunks), np.int64)
    chunk_node = np.zeros((n_groups, n_chunks), np.int64)
    cost = np.empty(n_groups, np.float64)
    for g in range(n_groups):
        n_e = groups[g, 2] - groups[g, 1]
        cost[g] = expert_cost[groups[g, 0]] * (1.0 + token_cost * (n_e - 1)) / n_chunks
    order = np.arange(n_groups)  # stable insertion sort, largest cost first (G <= E: small)
    for a in range(1, n_groups):
        v = order[a]
        b = a - 1
        while b >= 0 and cost[order[b]] < cost[v]:
            order[b + 1] = order[b]
            b -= 1
        order[b + 1] = v
    for gi in range(n_groups):
        g = order[gi]
        e = groups[g, 0]
        for c in range(n_chunks):
            best = -1
            best_node = 0
            for cp in range(n_copies):
                nid = copy_nodes[e, cp]
                if nid < 0 or nid >= node_index.shape[0]:
                    continue
                nd = node_index[nid]
                if nd < 0:
                    continue
                if best < 0 or load[nd] < load[best_node]:
                    best = cp
                    best_node = nd
            if best < 0:
                best = 0
                best_node = 0
            chunk_copy[g, c] = best
            chunk_node[g, c] = best_node
            load[best_node] += cost[g]
    return chunk_copy, chunk_node, load


@njit(nogil=True, cache=True)
def _same_node_copy(offs, nodes, e, want_node):
    for c in range(nodes.shape[1]):
        if nodes[e, c] == want_node and offs[e, c] >= 0:
            return c
    return 0


@njit(nogil=True, cache=True, inline="always")
def _chunk_edge(c, n_chunks, n_rows):
    """First row of chunk c of n_chunks over n_rows rows: c * n_rows // n_chunks rounded down to
    a multiple of 16 (whole 4-row kernel tiles: a chunk's odd tail rows would run as single-row
    tiles, ~1/4 as fast at T >= 4), n_rows for c == n_chunks. Chunks stay non-empty while
    n_rows / n_chunks >= 16 (min_chunk_rows >= 16); a smaller min_chunk_rows may give empty
    chunks, which are harmless items that compute nothing."""
    if c >= n_chunks:
        return n_rows
    return (c * n_rows // n_chunks) // 16 * 16


@njit(nogil=True, cache=True)
def plan_step(op, arena, x, ids, w, out, n_expert, g_off, g_nodes, u_off, u_nodes, d_off, d_nodes, fused,
              two_partners, node_index, n_nodes, n_workers, chunks_per_worker, min_chunk_rows, cost_gu, cost_d,
              token_cost, max_item_bytes):
    """Build one MoE step's work items in numba (no per-step Python loops).

    Fills op's per-step addresses (arena, x, out, pairs, weights) and returns items int64
    [n, 8] sorted by (phase, home node), bounds int64 [5, n_nodes, 2], and pair_tok /
    slot_pair (which op points at: keep them alive until the step has run). For a fused
    gate_up tensor pass the same arrays as g_* and u_*.
    """
    n_tok, k_n = ids.shape
    h = ld(op, M_H)
    i_w = ld(op, M_I)
    n_pairs = n_tok * k_n
    pair_tok, slot_pair, groups = group_pairs(ids, n_expert)
    st(op, M_ARENA, arena.ctypes.data)
    st(op, M_X, x.ctypes.data)
    st(op, M_OUT, out.ctypes.data)
    st(op, M_PAIR_TOK, pair_tok.ctypes.data)
    st(op, M_SLOT_PAIR, slot_pair.ctypes.data)
    st(op, M_W, w.ctypes.data)
    n_groups = groups.shape[0]
    want = -(-(n_workers * chunks_per_worker) // max(1, n_groups))
    want_gu = want
    want_d = want
    if max_item_bytes > 0 and n_groups > 0:  # few large experts: cut each into items of bounded bytes
        e0 = groups[0, 0]
        want_gu = max(want, np.int64(-(-cost_gu[e0] // max_item_bytes)))
        want_d = max(want, np.int64(-(-cost_d[e0] // max_item_bytes)))
    ch_gu = max(1, min(want_gu, i_w // min_chunk_rows))
    ch_d = max(1, min(want_d, h // min_chunk_rows))
    gu_copy, gu_node, _ = assign_chunks(groups, g_nodes, node_index, n_nodes, cost_gu, token_cost, ch_gu)
    d_copy, d_node, _ = assign_chunks(groups, d_nodes, node_index, n_nodes, cost_d, token_cost, ch_d)
    step_t = max(1, -(-n_tok // n_workers))
    n_qx_t = -(-n_tok // step_t)
    n_which = 2 if two_partners else 1
    step_p = max(1, -(-n_pairs // n_workers))
    n_qh = -(-n_pairs // step_p)
    if n_tok >= n_workers:
        n_comb = -(-n_tok // step_t)
    else:
        n_comb = max(1, min(n_workers, h // 64))
    n_items = n_which * n_qx_t + n_groups * ch_gu + n_qh + n_groups * ch_d + n_comb
    raw = np.zeros((n_items, 8), np.int64)
    key = np.empty(n_items, np.int64)  # phase * n_nodes + node
    j = 0
    for wh in range(n_which):
        for c in range(n_qx_t):
            lo = c * step_t
            raw[j, 0] = K_MOE_QX
            raw[j, 1] = wh
            raw[j, 2] = lo
            raw[j, 3] = min(n_tok, lo + step_t)
            key[j] = 0 * n_nodes + (wh * n_qx_t + c) % n_nodes
            j += 1
    for g in range(n_groups):
        e = groups[g, 0]
        for c in range(ch_gu):
            cp = gu_copy[g, c]
            raw[j, 0] = K_MOE_GATEUP
            raw[j, 1] = e
            raw[j, 2] = groups[g, 1]
            raw[j, 3] = groups[g, 2]
            raw[j, 4] = _chunk_edge(c, ch_gu, i_w)
            raw[j, 5] = _chunk_edge(c + 1, ch_gu, i_w)
            raw[j, 6] = g_off[e, cp]
            if fused:
                raw[j, 7] = g_off[e, cp]
            else:
                raw[j, 7] = u_off[e, _same_node_copy(u_off, u_nodes, e, g_nodes[e, cp])]
            key[j] = 1 * n_nodes + gu_node[g, c]
            j += 1
    for c in range(n_qh):
        lo = c * step_p
        raw[j, 0] = K_MOE_QH
        raw[j, 1] = lo
        raw[j, 2] = min(n_pairs, lo + step_p)
        key[j] = 2 * n_nodes + c % n_nodes
        j += 1
    for g in range(n_groups):
        e = groups[g, 0]
        for c in range(ch_d):
            raw[j, 0] = K_MOE_DOWN
            raw[j, 1] = e
            raw[j, 2] = groups[g, 1]
            raw[j, 3] = groups[g, 2]
            raw[j, 4] = _chunk_edge(c, ch_d, h)
            raw[j, 5] = _chunk_edge(c + 1, ch_d, h)
            raw[j, 6] = d_off[e, d_copy[g, c]]
            key[j] = 3 * n_nodes + d_node[g, c]
            j += 1
    for c in range(n_comb):
        raw[j, 0] = K_MOE_COMBINE
        if n_tok >= n_workers:
            raw[j, 1] = c * step_t
            raw[j, 2] = min(n_tok, (c + 1) * step_t)
            raw[j, 3] = 0
            raw[j, 4] = h
        else:
            raw[j, 1] = 0
            raw[j, 2] = n_tok
            raw[j, 3] = c * h // n_comb
            raw[j, 4] = (c + 1) * h // n_comb
        key[j] = 4 * n_nodes + c % n_nodes
        j += 1
    # Stable counting sort by (phase, node).
    n_keys = 5 * n_nodes
    start = np.zeros(n_keys + 1, np.int64)
    for i in range(n_items):
        start[key[i] + 1] += 1
    for k in range(n_keys):
        start[k + 1] += start[k]
    bounds = np.empty((5, n_nodes, 2), np.int64)
    for k in range(n_keys):
        bounds[k // n_nodes, k % n_nodes, 0] = start[k]
        bounds[k // n_nodes, k % n_nodes, 1] = start[k + 1]
    items = np.empty((n_items, 8), np.int64)
    pos = start[:n_keys].copy()
    for i in range(n_items):
        dst = pos[key[i]]
        for c in range(8):
            items[dst, c] = raw[i, c]
        pos[key[i]] += 1
    return items, bounds, pair_tok, slot_pair


def assign_items(ids: np.ndarray, copy_nodes: np.ndarray, n_nodes: int, expert_cost, *, n_chunks: int = 1,
                 token_cost: float = 0.25) -> list[list[tuple[int, int, int]]]:
    """Per node, the work items of one MoE step: (expert, copy index, row chunk).

    ids int32 [T, K]; copy_nodes int32 [E, C] node id of each copy (-1 = none; node ids are
    0..n_nodes-1 here); expert_cost: float [E] or a scalar. Pure: no kernels, no threads.
    Each expert group (all tokens that chose the expert) is cut into ``n_chunks`` row
    chunks, each sent to the least-loaded node holding a copy (see assign_chunks).
    """
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    copy_nodes = np.ascontiguousarray(copy_nodes, dtype=np.int32)
    n_expert = copy_nodes.shape[0]
    cost = np.broadcast_to(np.asarray(expert_cost, dtype=np.float64), (n_expert,)).copy()
    _, _, groups = group_pairs(ids, n_expert)
    chunk_copy, chunk_node, _ = assign_chunks(groups, copy_nodes, np.arange(n_nodes, dtype=np.int64), n_nodes,
                                              cost, float(token_cost), int(n_chunks))
    per_node: list[list[tuple[int, int, int]]] = [[] for _ in range(n_nodes)]
    for g in range(len(groups)):
        for c in range(n_chunks):
            per_node[int(chunk_node[g, c])].append((int(groups[g, 0]), int(chunk_copy[g, c]), c))
    return per_node


# ---------------------------------------------------------------------------------------
# Python side
# ---------------------------------------------------------------------------------------


@dataclass
class ExpertWeights:
    """One layer's routed experts as the MoE step reads them (the engine's ExpertSet has the
    same attributes and works as is).

    types: ggml type per kind ('gate', 'up', 'down', or 'gate_up' instead of gate/up);
    copies: kind -> (offsets int64 [E, C] arena byte offsets of each expert's slab copy,
    nodes int32 [E, C] node id of each copy; -1 = no such copy; copy 0 is the primary);
    n_expert E, n_embd H, n_ff_exp I; biases: optional kind -> arena byte offset of a float32
    bias tensor ('gate' / 'up' [E, I], 'gate_up' [E, 2I], 'down' [E, H]); act / alpha / limit:
    the layer's activation (ACT_SILU, ACT_SWIGLU_OAI), None = the MoE step's own.
    """

    n_expert: int
    n_embd: int
    n_ff_exp: int
    types: dict[str, int]
    copies: dict[str, tuple[np.ndarray, np.ndarray]]
    biases: dict[str, int] = field(default_factory=dict)
    act: int | None = None
    alpha: float = 1.702
    limit: float = 7.0


@dataclass
class _Scratch:
    n_tok: int
    k_n: int
    h: int
    i_w: int
    partners: tuple
    arrays: list
    op: np.ndarray
    spec: object = None


def _as_2d(a, dtype) -> np.ndarray:
    if isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 2 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(np.atleast_2d(a), dtype=dtype)


def _check_ids(ids: np.ndarray, n_expert: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"expert ids must be in [0, {n_expert}) (got {ids.min()}..{ids.max()})")


class MoE:
    """The MoE FFN step over a WorkerPool (or single-threaded with fused=False).

    chunks_per_worker: row chunks per worker and phase the plan aims for; min_chunk_rows: the
    smallest chunk (rows); token_cost: extra cost of each further token of an expert group,
    relative to streaming the expert (node balancing); max_item_bytes: the most weight bytes
    one gate/up or down item streams (0: no limit), see the module docstring.
    act: ACT_SILU (default) or ACT_SWIGLU_OAI with ``alpha`` / ``limit`` (gpt-oss: 1.702, 7),
    used for expert sets that do not carry their own (the engine's ExpertSet carries the
    architecture's ``act``/``alpha``/``limit``, which win).
    Buffers are kept between calls (per shape) so a decode step allocates nothing large.
    """

    def __init__(self, pool=None, *, act: int = ACT_SILU, alpha: float = 1.702, limit: float = 7.0,
                 chunks_per_worker: int = 4, min_chunk_rows: int = 16, token_cost: float = 0.25,
                 max_item_bytes: int = 4 << 20):
        self.pool = pool
        self.act = int(act)
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.chunks_per_worker = chunks_per_worker
        self.min_chunk_rows = min_chunk_rows
        self.token_cost = token_cost
        self.max_item_bytes = int(max_item_bytes)
        self._scratch: dict[tuple, _Scratch] = {}
        self._static: dict[int, tuple] = {}  # id(spec) -> (spec, op indices, values): _fill_static
        self._lock = threading.Lock()  # the scratch buffers serve one step at a time

    # -- public ----------------------------------------------------------------------------

    def forward(self, arena: np.ndarray, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts,
                *, fused: bool = True) -> np.ndarray:
        """out float32 [T, H] = sum_k w[t,k] * down_e(act(gate_e x_t, up_e x_t)), e = ids[t,k].

        arena: uint8 [*] (the weight store's arena); x float32 [T, H]; ids int32 [T, K];
        weights float32 [T, K]; experts: ExpertWeights (or the engine's ExpertSet).
        fused=False runs the single-threaded reference path (the kill switch).
        Raises ValueError for inconsistent shapes or an expert id outside [0, E).
        """
        x2 = _as_2d(x, np.float32)
        ids2 = _as_2d(ids, np.int32)
        w2 = _as_2d(weights, np.float32)
        spec = _Spec.of(experts)
        if x2.shape[1] != spec.h:
            raise ValueError(f"x has {x2.shape[1]} columns, the experts' hidden size is {spec.h}")
        if ids2.shape != w2.shape or ids2.shape[0] != x2.shape[0]:
            raise ValueError(f"ids {ids2.shape}, weights {w2.shape} and x {x2.shape} disagree on [T, K]")
        if not fused or self.pool is None:
            _check_ids(ids2, spec.n_expert)
            return self._reference(arena, x2, ids2, w2, spec)
        try:
            with self._lock:
                return self._fused(arena, x2, ids2, w2, spec)
        except ValueError:
            _check_ids(ids2, spec.n_expert)  # group_pairs refused an id: say which
            raise

    # -- reference (kill switch) -------------------------------------------------------------

    def _reference(self, arena, x, ids, w, spec) -> np.ndarray:
        n_tok, k_n = ids.shape
        h, i_w = spec.h, spec.i_w
        out = np.zeros((n_tok, h), np.float32)
        act, alpha_f, limit_f = self._act(spec)
        alpha, limit = np.float32(alpha_f), np.float32(limit_f)
        for t in range(n_tok):
            xt = _q.Activations(x[t: t + 1])
            acc = None
            for k in range(k_n):
                e = int(ids[t, k])
                g, u = spec.gate_up(arena, e, xt)
                bg, bu = spec.bias_gate_up(arena, e)
                if bg is not None:
                    g = g + bg
                if bu is not None:
                    u = u + bu
                hbuf = np.empty(i_w, np.float32)
                act_rows(act, g.reshape(-1), u.reshape(-1), alpha, limit, hbuf)
                off, typ = spec.offset("down", e, 0), spec.types["down"]
                y = _q.matmul(arena, off, typ, h, i_w, hbuf.reshape(1, i_w))[0]
                bd = spec.bias_down(arena, e)
                if bd is not None:
                    y = y + bd
                yw = y * w[t, k]
                acc = yw if acc is None else acc + yw
            out[t] = acc
        return out

    # -- fused -------------------------------------------------------------------------------

    def _fused(self, arena, x, ids, w, spec) -> np.ndarray:
        pool = self.pool
        n_tok, k_n = ids.shape
        sc = self._get_scratch(n_tok, k_n, spec)
        out = np.empty((n_tok, spec.h), np.float32)
        g_kind = "gate_up" if spec.fused else "gate"
        u_kind = "gate_up" if spec.fused else "up"
        items, bounds, pair_tok, slot_pair = plan_step(
            sc.op, arena, x, ids, w, out, spec.n_expert, *spec.copies[g_kind], *spec.copies[u_kind],
            *spec.copies["down"], spec.fused, spec.partner_g != spec.partner_u, spec.node_index(pool.node_ids),
            pool.n_nodes, pool.n_workers, self.chunks_per_worker, self.min_chunk_rows, spec.cost_gu, spec.cost_d,
            self.token_cost, self.max_item_bytes)
        pool.run_arrays(items, bounds, sc.op)
        del pair_tok, slot_pair  # op pointed at them: alive until the step has run
        return out

    def _get_scratch(self, n_tok, k_n, spec) -> _Scratch:
        key = (n_tok, k_n, spec.h, spec.i_w, spec.partner_g, spec.partner_u, spec.partner_d)
        sc = self._scratch.get(key)
        if sc is not None:
            if sc.spec is not spec:  # another layer: its types, biases, kernels
                self._fill_static(sc.op, spec)
                sc.spec = spec
            return sc
        h, i_w = spec.h, spec.i_w
        n_pairs = n_tok * k_n
        arrays = []
        op = np.zeros(OP_LEN, np.int64)
        xg = _q._alloc_partner(spec.partner_g, n_tok, h)
        xu = xg if spec.partner_u == spec.partner_g else _q._alloc_partner(spec.partner_u, n_tok, h)
        hq = _q._alloc_partner(spec.partner_d, n_pairs, i_w)
        gu = np.zeros(n_pairs * 2 * i_w, np.float32)
        y = np.zeros(n_pairs * h, np.float32)
        pair_idx = np.arange(n_pairs, dtype=np.int64)
        arrays += [xg, xu, hq, gu, y, pair_idx]
        for base, pa in ((M_XG, xg), (M_XU, xu), (M_HQ, hq)):
            op[base: base + 5] = [a.ctypes.data for a in (pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs)]
        op[M_GU] = gu.ctypes.data
        op[M_Y] = y.ctypes.data
        op[M_PAIR_IDX] = pair_idx.ctypes.data
        op[M_T] = n_tok
        op[M_K] = k_n
        op[M_P] = n_pairs
        sc = _Scratch(n_tok, k_n, h, i_w, (spec.partner_g, spec.partner_u, spec.partner_d), arrays, op, spec)
        self._fill_static(op, spec)
        if len(self._scratch) > 16:
            self._scratch.clear()
        self._scratch[key] = sc
        return sc

    def _act(self, spec) -> tuple[int, float, float]:
        """The layer's activation when its expert set carries one (the architecture's, via
        the engine's ExpertSet), else this MoE's own."""
        if spec.act is not None:
            return spec.act, spec.alpha, spec.limit
        return self.act, self.alpha, self.limit

    def _fill_static(self, op, spec) -> None:
        """Write the layer's static fields (types, row bytes, kernels, activation, biases) into
        op: computed once per expert set, then one indexed assignment per layer (a decode step
        switches layers 30-60 times; building them each time cost ~14 us per layer)."""
        hit = self._static.get(id(spec))
        if hit is None or hit[0] is not spec:
            full = np.full(OP_LEN, np.iinfo(np.int64).min, np.int64)
            self._fill_static_fields(full, spec)
            idx = np.flatnonzero(full != np.iinfo(np.int64).min)
            if len(self._static) > 4096:
                self._static.clear()
            hit = self._static[id(spec)] = (spec, idx, full[idx])
        op[hit[1]] = hit[2]

    def _fill_static_fields(self, op, spec) -> None:
        op[M_H] = spec.h
        op[M_I] = spec.i_w
        op[M_FUSED] = 1 if spec.fused else 0
        op[M_G_TYPE] = spec.types["gate_up" if spec.fused else "gate"]
        op[M_U_TYPE] = spec.types["gate_up" if spec.fused else "up"]
        op[M_D_TYPE] = spec.types["down"]
        op[M_G_PARTNER] = spec.partner_g
        op[M_U_PARTNER] = spec.partner_u
        op[M_D_PARTNER] = spec.partner_d
        op[M_G_ROWB] = _q.row_bytes(op[M_G_TYPE], spec.h)
        op[M_U_ROWB] = _q.row_bytes(op[M_U_TYPE], spec.h)
        op[M_D_ROWB] = _q.row_bytes(spec.types["down"], spec.i_w)
        op[M_KERNELS] = _q.ensure_kernels(spec.types.values()).ctypes.data
        act, alpha, limit = self._act(spec)
        op[M_ACT] = act
        op[M_ALPHA] = int(f32_bits_py(alpha))
        op[M_LIMIT] = int(f32_bits_py(limit))
        b = spec.biases
        if spec.fused and "gate_up" in b:
            op[M_BIAS_G] = b["gate_up"]
            op[M_BIAS_U] = b["gate_up"] + 4 * spec.i_w
            op[M_BIAS_STRIDE] = 2 * spec.i_w
        else:
            op[M_BIAS_G] = b.get("gate", -1)
            op[M_BIAS_U] = b.get("up", -1)
            op[M_BIAS_STRIDE] = spec.i_w
        op[M_BIAS_D] = b.get("down", -1)


def f32_bits_py(v: float) -> int:
    """IEEE-754 bits of float32(v)."""
    return int(np.array([v], np.float32).view(np.uint32)[0])


class _Spec:
    """Validated view of an ExpertWeights / ExpertSet (cached on the object by identity)."""

    _cache: dict[int, tuple[object, _Spec]] = {}

    @classmethod
    def of(cls, experts) -> _Spec:
        hit = cls._cache.get(id(experts))
        if hit is not None and hit[0] is experts:
            return hit[1]
        spec = cls(experts)
        if len(cls._cache) > 4096:
            cls._cache.clear()
        cls._cache[id(experts)] = (experts, spec)
        return spec

    def __init__(self, experts):
        self.n_expert = int(experts.n_expert)
        self.h = int(experts.n_embd)
        self.i_w = int(experts.n_ff_exp)
        self.types = {k: int(v) for k, v in experts.types.items()}
        self.copies = {k: (np.ascontiguousarray(o, dtype=np.int64), np.ascontiguousarray(n, dtype=np.int32))
                       for k, (o, n) in experts.copies.items()}
        self.biases = {k: int(v) for k, v in (getattr(experts, "biases", None) or {}).items()}
        act = getattr(experts, "act", None)  # the architecture's activation (engine ExpertSet)
        self.act = None if act is None else int(act)
        self.alpha = float(getattr(experts, "alpha", 1.702))
        self.limit = float(getattr(experts, "limit", 7.0))
        self.fused = "gate_up" in self.copies
        kinds = ["gate_up", "down"] if self.fused else ["gate", "up", "down"]
        for k in kinds:
            if k not in self.copies or k not in self.types:
                raise ValueError(f"expert layer is missing the '{k}' tensor (has {sorted(self.copies)})")
            off, nodes = self.copies[k]
            if off.shape[0] != self.n_expert or off.shape != nodes.shape:
                raise ValueError(f"'{k}' copies have shape {off.shape} / {nodes.shape}, expected [{self.n_expert}, C]")
            if (off[:, 0] < 0).any():
                raise ValueError(f"'{k}': every expert needs a primary copy (copy 0)")
            _q.block_format(self.types[k])
        g_kind = "gate_up" if self.fused else "gate"
        u_kind = "gate_up" if self.fused else "up"
        self.partner_g = int(_q.block_format(self.types[g_kind]).partner)
        self.partner_u = int(_q.block_format(self.types[u_kind]).partner)
        self.partner_d = int(_q.block_format(self.types["down"]).partner)
        gu_rows = 2 * self.i_w
        self.rb_g = _q.row_bytes(self.types[g_kind], self.h)
        self.rb_u = _q.row_bytes(self.types[u_kind], self.h)
        self.rb_d = _q.row_bytes(self.types["down"], self.i_w)
        self.cost_gu = np.full(self.n_expert, float(gu_rows * max(self.rb_g, self.rb_u)))
        self.cost_d = np.full(self.n_expert, float(self.h * self.rb_d))
        self._node_index: dict[tuple, np.ndarray] = {}

    def nodes(self, kind: str) -> np.ndarray:
        return self.copies[kind][1]

    def offset(self, kind: str, e: int, copy: int) -> int:
        return int(self.copies[kind][0][e, copy])

    def node_index(self, node_ids: Sequence[int]) -> np.ndarray:
        key = tuple(node_ids)
        ni = self._node_index.get(key)
        if ni is None:
            top = max(max(node_ids), int(max((n.max() for _, n in self.copies.values()), default=0))) + 1
            ni = np.full(top, -1, np.int64)
            for dense, nid in enumerate(node_ids):
                ni[nid] = dense
            self._node_index[key] = ni
        return ni

    def gate_up(self, arena, e, xt):
        """Reference path: gate and up outputs [1, I] for one token."""
        if self.fused:
            gu = _q.matmul(arena, self.offset("gate_up", e, 0), self.types["gate_up"], 2 * self.i_w, self.h, xt)
            return gu[:, : self.i_w], gu[:, self.i_w:]
        g = _q.matmul(arena, self.offset("gate", e, 0), self.types["gate"], self.i_w, self.h, xt)
        u = _q.matmul(arena, self.offset("up", e, 0), self.types["up"], self.i_w, self.h, xt)
        return g, u

    def _bias(self, arena, off, n):
        return arena[off: off + 4 * n].view(np.float32)

    def bias_gate_up(self, arena, e):
        b, i_w = self.biases, self.i_w
        if self.fused and "gate_up" in b:
            row = self._bias(arena, b["gate_up"] + 4 * e * 2 * i_w, 2 * i_w)
            return row[:i_w], row[i_w:]
        bg = self._bias(arena, b["gate"] + 4 * e * i_w, i_w) if "gate" in b else None
        bu = self._bias(arena, b["up"] + 4 * e * i_w, i_w) if "up" in b else None
        return bg, bu

    def bias_down(self, arena, e):
        b = self.biases
        return self._bias(arena, b["down"] + 4 * e * self.h, self.h) if "down" in b else None
