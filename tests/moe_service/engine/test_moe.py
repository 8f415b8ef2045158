"""The fused MoE step: assignment (pure), grouping, fused vs reference vs float64.

Tolerances:
- fused vs reference (``fused=False``): the same kernels on the same quantized inputs in the
  same order (rows are dotted 4 tokens at a time or 1 at a time with identical accumulation
  order, combine in k order as ggml), so they agree to float32 rounding of the activation
  function at most: |diff| <= 1e-6 * max|ref| (bit-identical on this host).
- vs float64 of the dequantized weights, see _check_against_float64: 1e-4 of max|ref| when
  the reference quantizes x and h as the kernels do, 5% without (8-bit activations twice).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import quants as gq

from moe_service.engine import moe as M
from moe_service.engine import pool as P
from moe_service.engine import quant as q

CPUS = sorted(os.sched_getaffinity(0))
EXPERT_TYPES = [q.GGML_Q8_0, q.GGML_Q4_0, q.GGML_Q4_1, q.GGML_Q4_K, q.GGML_Q6_K, q.GGML_MXFP4]


@pytest.fixture(scope="module")
def pool():
    p = P.WorkerPool(pin_caller=False, spin_s=0.002)
    yield p
    p.close()


# ---------------------------------------------------------------------------------------
# Assignment and grouping (no kernels)


def test_group_pairs_sorts_pairs_by_expert():
    ids = np.array([[3, 1], [1, 0], [3, 2]], np.int32)
    pair_tok, slot_pair, groups = M.group_pairs(ids, 5)
    assert groups.tolist() == [[0, 0, 1], [1, 1, 3], [2, 3, 4], [3, 4, 6]]
    assert pair_tok.tolist() == [1, 0, 1, 2, 0, 2]
    for t in range(3):
        for k in range(2):
            p = slot_pair[t * 2 + k]
            e = ids[t, k]
            assert pair_tok[p] == t and groups[groups[:, 0] == e][0, 1] <= p < groups[groups[:, 0] == e][0, 2]
    with pytest.raises(ValueError):
        M.group_pairs(np.array([[5]], np.int32), 5)


def test_assign_prefers_primary_and_skips_missing_copies():
    copy_nodes = np.array([[0, 1], [1, -1], [2, 0]], np.int32)
    per_node = M.assign_items(np.array([[0, 1, 2]], np.int32), copy_nodes, 3, 1.0)
    # equal costs: each expert goes to its least-loaded copy; ties keep the primary
    assert sorted(per_node[0] + per_node[1] + per_node[2]) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert [len(n) for n in per_node] == [1, 1, 1]
    # a replica on an idle node takes load off a busy one
    per_node = M.assign_items(np.array([[0, 1]], np.int32), np.array([[0, -1], [0, 1]], np.int32), 2, 1.0)
    assert per_node == [[(0, 0, 0)], [(1, 1, 0)]]


def test_replicas_lower_node_imbalance_on_a_skewed_trace():
    """Decode-like steps (T=1, K=8) over 64 experts with Zipf-skewed popularity on 4 nodes:
    replicas of the 16 hottest experts on a far node lower the mean max/mean node load, and
    a full mirror (a copy on every node) balances every step perfectly."""
    rng = np.random.default_rng(7)
    n_expert, n_nodes, k_n, steps, n_chunks = 64, 4, 8, 300, 2
    popularity = 1.0 / np.arange(1, n_expert + 1) ** 1.1
    popularity /= popularity.sum()
    primary = (np.arange(n_expert) % n_nodes).astype(np.int32)
    no_rep = np.stack([primary, np.full(n_expert, -1, np.int32)], axis=1)
    with_rep = no_rep.copy()
    hot = np.argsort(-popularity)[:16]
    with_rep[hot, 1] = (primary[hot] + 2) % n_nodes
    mirror = np.stack([(primary + j) % n_nodes for j in range(n_nodes)], axis=1).astype(np.int32)
    cost = np.ones(n_expert)
    imbalance = {"none": [], "hot": [], "mirror": []}
    node_index = np.arange(n_nodes, dtype=np.int64)
    for _ in range(steps):
        ids = rng.choice(n_expert, k_n, replace=False, p=popularity).astype(np.int32).reshape(1, k_n)
        _, _, groups = M.group_pairs(ids, n_expert)
        for name, copies in (("none", no_rep), ("hot", with_rep), ("mirror", mirror)):
            _, _, load = M.assign_chunks(groups, copies, node_index, n_nodes, cost, 0.25, n_chunks)
            imbalance[name].append(load.max() / load.mean())
    mean = {k: float(np.mean(v)) for k, v in imbalance.items()}
    assert mean["hot"] < mean["none"] - 0.05, mean
    assert mean["mirror"] == 1.0, mean


def test_plan_homes_chunks_on_their_copy_node():
    """With two (fake) nodes and a replica of every expert on the other node, gate/up and down
    items use the copy on the node whose queue holds them, and the step still matches."""
    rng = np.random.default_rng(11)
    ex, arena = _experts(rng, q.GGML_Q8_0, q.GGML_Q8_0, n_expert=4, h=256, i_w=256, replicas=True)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = np.full((2, 2), 0.5, np.float32)
    spec = M._Spec.of(ex)
    op = np.zeros(M.OP_LEN, np.int64)
    moe = M.MoE(None)
    moe._fill_static(op, spec)
    out = np.empty((2, 256), np.float32)
    items, bounds, _, _ = M.plan_step(op, arena, x, ids, w, out, 4, *spec.copies["gate"], *spec.copies["up"],
                                      *spec.copies["down"], False, False, np.array([0, 1], np.int64), 2, 2, 4, 16,
                                      spec.cost_gu, spec.cost_d, 0.25, 0)
    seen_nodes = set()
    for phase, kind, kind_name in ((1, M.K_MOE_GATEUP, "gate"), (3, M.K_MOE_DOWN, "down")):
        offs, nodes = spec.copies[kind_name]
        for nd in range(2):
            for it in items[bounds[phase, nd, 0]: bounds[phase, nd, 1]]:
                assert it[0] == kind
                e = it[1]
                copy = list(offs[e]).index(it[6])
                assert nodes[e, copy] == nd
                seen_nodes.add(nd)
    assert seen_nodes == {0, 1}  # both nodes got work
    with P.WorkerPool({0: [CPUS[0]], 1: [CPUS[-1]]} if len(CPUS) > 1 else {0: CPUS}, pin_caller=False) as pool:
        y = M.MoE(pool).forward(arena, x, ids, w, ex)
    np.testing.assert_array_equal(y, M.MoE(None).forward(arena, x, ids, w, ex, fused=False))


def test_plan_bounds_item_bytes_of_large_experts():
    """max_item_bytes cuts each expert's rows into items of about that many weight bytes (edges
    on 16-row kernel tiles), where chunks_per_worker alone would make one item per expert, and
    the step is still bit-identical to the reference path."""
    rng = np.random.default_rng(12)
    ex, arena = _experts(rng, q.GGML_Q8_0, q.GGML_Q8_0, n_expert=4, h=256, i_w=256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ids = np.array([[0, 1, 2, 3]], np.int32)
    w = np.full((1, 4), 0.25, np.float32)
    spec = M._Spec.of(ex)
    rb = q.row_bytes(q.GGML_Q8_0, 256)
    limit = 32 << 10
    for max_bytes, want_gu, want_d in ((0, 1, 1), (limit, 5, 3)):
        op = np.zeros(M.OP_LEN, np.int64)
        M.MoE(None)._fill_static(op, spec)
        out = np.empty((1, 256), np.float32)
        items, bounds, _, _ = M.plan_step(op, arena, x, ids, w, out, 4, *spec.copies["gate"], *spec.copies["up"],
                                          *spec.copies["down"], False, False, np.array([0], np.int64), 1, 2, 1, 16,
                                          spec.cost_gu, spec.cost_d, 0.25, max_bytes)
        for kind, n_chunks, row_bytes in ((M.K_MOE_GATEUP, want_gu, 2 * rb), (M.K_MOE_DOWN, want_d, rb)):
            its = items[items[:, 0] == kind]
            assert len(its) == 4 * n_chunks
            for e in range(4):
                edges = sorted((int(a), int(b)) for a, b in its[its[:, 1] == e][:, 4:6])
                assert edges[0][0] == 0 and edges[-1][1] == 256
                assert all(a[1] == b[0] for a, b in zip(edges, edges[1:], strict=False))  # contiguous
                assert all(lo % 16 == 0 for lo, _ in edges)
                if max_bytes:
                    assert all((hi - lo - 15) * row_bytes <= max_bytes for lo, hi in edges)
    with P.WorkerPool({0: CPUS}, pin_caller=False) as pool:
        y = M.MoE(pool, max_item_bytes=limit).forward(arena, x, ids, w, ex)
    np.testing.assert_array_equal(y, M.MoE(None).forward(arena, x, ids, w, ex, fused=False))


# ---------------------------------------------------------------------------------------
# Numerics


def _experts(rng, t_gu, t_d, *, n_expert=8, h=256, i_w=256, fused_gate_up=False, replicas=False, biases=False):
    parts, off = [], 0

    def add(b):
        nonlocal off
        parts.append(b)
        o = off
        off += b.size
        return o

    def slabs(t, rows, cols):
        offs = np.array([add(q.random_blocks(rng, t, rows, cols, scale=0.02)) for _ in range(n_expert)], np.int64)
        if not replicas:
            return offs.reshape(-1, 1), np.zeros((n_expert, 1), np.int32)
        # replica on the other node: a byte copy of the primary
        rep = np.array([add(np.concatenate(parts)[o: o + q.row_bytes(t, cols) * rows].copy()) for o in offs])
        nodes = np.stack([np.arange(n_expert) % 2, (np.arange(n_expert) + 1) % 2], axis=1).astype(np.int32)
        return np.stack([offs, rep], axis=1), nodes

    types, copies = {"down": t_d}, {}
    if fused_gate_up:
        types["gate_up"] = t_gu
        copies["gate_up"] = slabs(t_gu, 2 * i_w, h)
    else:
        types["gate"] = types["up"] = t_gu
        copies["gate"] = slabs(t_gu, i_w, h)
        copies["up"] = slabs(t_gu, i_w, h)
    copies["down"] = slabs(t_d, h, i_w)
    bias = {}
    if biases:
        gu_len = n_expert * 2 * i_w if fused_gate_up else n_expert * i_w
        names = (["gate_up"] if fused_gate_up else ["gate", "up"]) + ["down"]
        for k in names:
            n = n_expert * h if k == "down" else gu_len
            bias[k] = add((rng.standard_normal(n).astype(np.float32) * 0.5).view(np.uint8))
    arena = np.concatenate(parts)
    return M.ExpertWeights(n_expert, h, i_w, types, copies, bias), arena


def _float64_reference(arena, x, ids, w, ex, act=M.ACT_SILU, alpha=1.702, limit=7.0, quantized=False):
    """out [T, H] in float64 from dequantized weights. quantized=True mirrors the kernels'
    quantization points: x and h pass through their 8-bit partner formats (quant's
    quantizers, checked bit-exact against ggml in test_quant), everything else is float64."""
    h, i_w = ex.n_embd, ex.n_ff_exp

    def deq(kind, e, rows, cols):
        off = int(ex.copies[kind][0][e, 0])
        t = ex.types[kind]
        raw = arena[off: off + q.row_bytes(t, cols) * rows].reshape(rows, -1)
        return np.asarray(gq.dequantize(raw, G(t)), np.float64).reshape(rows, cols)

    def bias(kind, e, n):
        if kind not in ex.biases:
            return 0.0
        o = ex.biases[kind] + 4 * e * n
        return arena[o: o + 4 * n].view(np.float32).astype(np.float64)

    def through(kind, v):
        """The activation the kernels multiply with, and for Q8_1 the per-block sums s the
        kernels use for the weights' min term (ggml: m * s, s = f16(d * sum q))."""
        if not quantized:
            return np.asarray(v, np.float64), None
        pa = q.quantize_activations(np.asarray(v, np.float32).reshape(1, -1), q.block_format(ex.types[kind]).partner)
        if pa.partner in (q.Partner.F32, q.Partner.F16, q.Partner.BF16):
            return pa.xf.astype(np.float64), None
        blk = q.PARTNER_BLOCK[pa.partner]
        a = (pa.xq.reshape(-1, blk).astype(np.float64) * pa.xd.reshape(-1, 1)).reshape(-1)
        return a, (pa.xs.astype(np.float64) if pa.partner == q.Partner.Q8_1 else None)

    def matvec(kind, e, rows, cols, a_s):
        a, s = a_s
        y = deq(kind, e, rows, cols) @ a
        if s is not None:  # replace m * sum(a) by m * s, block by block
            off = int(ex.copies[kind][0][e, 0])
            f = q.block_format(ex.types[kind])
            blocks = arena[off: off + f.row_bytes(cols) * rows].reshape(rows, cols // 32, f.block_bytes)
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
            y += m @ (s - a.reshape(-1, 32).sum(axis=1))
        return y

    g_kind = "gate_up" if "gate_up" in ex.copies else "gate"
    out = np.zeros((x.shape[0], h))
    for t in range(x.shape[0]):
        xa = through(g_kind, x[t])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if "gate_up" in ex.copies:
                gu = matvec("gate_up", e, 2 * i_w, h, xa) + bias("gate_up", e, 2 * i_w)
                g, u = gu[:i_w], gu[i_w:]
            else:
                g = matvec("gate", e, i_w, h, xa) + bias("gate", e, i_w)
                u = matvec("up", e, i_w, h, xa) + bias("up", e, i_w)
            with np.errstate(over="ignore"):  # exp(-g) = inf for very negative g: silu -> 0
                if act == M.ACT_SILU:
                    hh = g / (1 + np.exp(-g)) * u
                else:
                    gc = np.minimum(g, limit)
                    uc = np.clip(u, -limit, limit)
                    hh = gc / (1 + np.exp(-alpha * gc)) * (uc + 1)
            out[t] += w[t, k] * (matvec("down", e, h, i_w, through("down", hh)) + bias("down", e, h))
    return out


def _check_against_float64(y, arena, x, ids, w, ex, **act):
    """Quantization-aware float64 reference: only float32 rounding differs (observed <= 2e-7
    of max|ref|); allow 1e-4, which also covers an h element that float32 rounding moves
    across a quantization boundary (one 8-bit step of one element). Exact float64 (no 8-bit
    activations): x and h each lose up to half a step per element (~0.4% of their block's
    largest value); these random tensors give heavy-tailed h, so allow 5% of max|exact|
    (observed up to 3.2%, Q4_K)."""
    ref_q = _float64_reference(arena, x, ids, w, ex, quantized=True, **act)
    assert np.abs(y - ref_q).max() <= 1e-4 * np.abs(ref_q).max()
    exact = _float64_reference(arena, x, ids, w, ex, **act)
    assert np.abs(y - exact).max() <= 0.05 * np.abs(exact).max()


def _routing(rng, n_tok, n_expert, k_n):
    ids = np.stack([rng.choice(n_expert, k_n, replace=False) for _ in range(n_tok)]).astype(np.int32)
    w = rng.random((n_tok, k_n)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("n_tok", [1, 3, 64])
@pytest.mark.parametrize("tid", EXPERT_TYPES, ids=[q.FORMATS[t].name for t in EXPERT_TYPES])
def test_fused_matches_reference_and_float64(pool, tid, n_tok):
    rng = np.random.default_rng(100 * tid + n_tok)
    ex, arena = _experts(rng, tid, tid)
    x = rng.standard_normal((n_tok, 256)).astype(np.float32)
    ids, w = _routing(rng, n_tok, 8, 4)
    moe = M.MoE(pool)
    y = moe.forward(arena, x, ids, w, ex)
    ref = moe.forward(arena, x, ids, w, ex, fused=False)
    assert y.shape == (n_tok, 256) and y.dtype == np.float32
    scale = np.abs(ref).max()
    assert np.abs(y - ref).max() <= 1e-6 * scale
    if n_tok <= 3:  # the float64 reference is slow-ish: the small cases suffice
        _check_against_float64(y, arena, x, ids, w, ex)


def test_fused_gate_up_with_gpt_oss_activation_and_biases(pool):
    rng = np.random.default_rng(5)
    ex, arena = _experts(rng, q.GGML_MXFP4, q.GGML_MXFP4, fused_gate_up=True, biases=True)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    ids, w = _routing(rng, 5, 8, 4)
    moe = M.MoE(pool, act=M.ACT_SWIGLU_OAI, alpha=1.702, limit=7.0)
    y = moe.forward(arena, x, ids, w, ex)
    ref = moe.forward(arena, x, ids, w, ex, fused=False)
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()
    _check_against_float64(y, arena, x, ids, w, ex, act=M.ACT_SWIGLU_OAI)


def test_layer_activation_comes_from_the_experts(pool):
    """A gpt-oss layer declares its clamped SwiGLU on its ExpertWeights (act/alpha/limit): the
    one MoE step of the engine (default SiLU) runs it for that layer and SiLU for the next,
    in the fused and the reference path."""
    rng = np.random.default_rng(11)
    ex, arena = _experts(rng, q.GGML_MXFP4, q.GGML_MXFP4, biases=True)
    oai = M.ExpertWeights(ex.n_expert, ex.n_embd, ex.n_ff_exp, ex.types, ex.copies, ex.biases,
                          act=M.ACT_SWIGLU_OAI, alpha=1.702, limit=7.0)
    x = rng.standard_normal((3, 256)).astype(np.float32) * 4  # gate/up beyond the limit of 7 somewhere
    ids, w = _routing(rng, 3, 8, 4)
    moe = M.MoE(pool)  # SiLU unless the layer says otherwise
    y_oai = moe.forward(arena, x, ids, w, oai)
    y_silu = moe.forward(arena, x, ids, w, ex)
    assert np.array_equal(y_oai, M.MoE(pool, act=M.ACT_SWIGLU_OAI).forward(arena, x, ids, w, ex))
    assert np.abs(moe.forward(arena, x, ids, w, oai, fused=False) - y_oai).max() <= 1e-6 * np.abs(y_oai).max()
    assert np.abs(y_oai - y_silu).max() > 0.1 * np.abs(y_silu).max()
    _check_against_float64(y_oai, arena, x, ids, w, ex, act=M.ACT_SWIGLU_OAI)


def test_mixed_types_and_separate_gate_up_biases(pool):
    rng = np.random.default_rng(9)
    ex, arena = _experts(rng, q.GGML_Q4_K, q.GGML_Q6_K, biases=True)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    ids, w = _routing(rng, 4, 8, 8)  # every expert chosen by every token
    moe = M.MoE(pool)
    y = moe.forward(arena, x, ids, w, ex)
    ref = moe.forward(arena, x, ids, w, ex, fused=False)
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()
    _check_against_float64(y, arena, x, ids, w, ex)


def test_no_affinity_syscalls_per_step(pool, monkeypatch):
    rng = np.random.default_rng(2)
    ex, arena = _experts(rng, q.GGML_Q8_0, q.GGML_Q8_0)
    moe = M.MoE(pool)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ids, w = _routing(rng, 1, 8, 4)
    moe.forward(arena, x, ids, w, ex)
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: calls.append(a))
    for _ in range(20):
        moe.forward(arena, x, ids, w, ex)
    assert calls == []


def test_forward_validates_inputs(pool):
    rng = np.random.default_rng(4)
    ex, arena = _experts(rng, q.GGML_Q8_0, q.GGML_Q8_0)
    moe = M.MoE(pool)
    x = np.zeros((2, 256), np.float32)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
        moe.forward(arena, x, np.array([[0, 8], [1, 2]], np.int32), np.ones((2, 2), np.float32), ex)
    with pytest.raises(ValueError, match="disagree"):
        moe.forward(arena, x, np.zeros((2, 2), np.int32), np.ones((2, 3), np.float32), ex)
    with pytest.raises(ValueError, match="hidden size is 256"):
        moe.forward(arena, np.zeros((2, 128), np.float32), np.zeros((2, 2), np.int32), np.ones((2, 2), np.float32), ex)
