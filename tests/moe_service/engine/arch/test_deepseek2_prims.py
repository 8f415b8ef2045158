"""deepseek2 primitives against float64 references: routing (sigmoid, selection bias, groups,
norm, scale) on both backends, YaRN rope tables and DeepSeek's softmax scale, per-head
quantized matmuls, the latent attention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_service.engine import attention, cpu_layers, mla, quant
from moe_service.engine.arch.base import GATING_SIGMOID, GATING_SOFTMAX, HParamError, HParamReader, Routing
from moe_service.engine.arch.deepseek2 import yarn_from_metadata
from moe_service.engine.arch.rope import RopeSpec, rope_tables, yarn_corr_dims
from moe_service.engine.model import torch_route


class routing:  # the rule's names as the tests use them
    GATING_SOFTMAX = GATING_SOFTMAX
    GATING_SIGMOID = GATING_SIGMOID


def _route_cpu(logits, k, gating, n_group, n_group_used, bias, norm, scale):
    T = logits.shape[0]
    ids, w = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
    b = bias if bias is not None else np.zeros(0, np.float32)
    cpu_layers.route(np.ascontiguousarray(logits), k, gating, norm, np.float32(scale), b, bias is not None,
                     max(n_group, 1), max(n_group_used, 1), ids, w)
    return ids, w


# ----------------------------------------------------------------------------- routing
def _route_ref(logits, k, gating, n_group, n_group_used, bias, norm, scale):
    """float64 reference of the rule in routing's docstring."""
    x = logits.astype(np.float64)
    if gating == routing.GATING_SOFTMAX:
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    else:
        p = 1.0 / (1.0 + np.exp(-x))
    sel = p + (bias.astype(np.float64) if bias is not None else 0.0)
    T, E = x.shape
    if n_group > 1:
        g = sel.reshape(T, n_group, E // n_group)
        score = np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-score, -1, kind="stable")[:, :n_group_used]
        mask = np.ones((T, n_group), bool)
        np.put_along_axis(mask, keep, False, 1)
        sel = np.where(mask[:, :, None], -np.inf, g).reshape(T, E)
    ids = np.argsort(-sel, -1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    if norm:
        w = w / np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
    return ids, w * scale


CASES = [
    # gating, n_group, n_group_used, bias, norm, scale   (V3/R1/K2, V2, V2-Lite, qwen-like)
    (routing.GATING_SIGMOID, 8, 4, True, True, 2.5),
    (routing.GATING_SOFTMAX, 8, 3, False, False, 16.0),
    (routing.GATING_SOFTMAX, 0, 0, False, False, 1.0),
    (routing.GATING_SOFTMAX, 1, 1, False, True, 1.0),
    (routing.GATING_SIGMOID, 4, 2, True, True, 1.0),
]


@pytest.mark.parametrize("gating,n_group,n_used,has_bias,norm,scale", CASES)
def test_routing_matches_the_float64_rule(gating, n_group, n_used, has_bias, norm, scale):
    rng = np.random.default_rng(7)
    T, E, K = 64, 64, 6
    logits = (rng.standard_normal((T, E)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.3).astype(np.float32) if has_bias else None
    ids, w = _route_cpu(logits, K, gating, n_group, n_used, bias, norm, scale)
    rids, rw = _route_ref(logits, K, gating, n_group, n_used, bias, norm, scale)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=2e-6, atol=1e-7)
    rule = Routing(k=K, gating=gating, norm=norm, scale=scale, n_group=max(n_group, 1),
                   n_group_used=max(n_used, 1))
    tids, tw = torch_route(torch.from_numpy(logits), rule, None if bias is None else torch.from_numpy(bias))
    np.testing.assert_array_equal(tids.numpy(), rids)
    np.testing.assert_allclose(tw.numpy(), rw, rtol=2e-6, atol=1e-7)


def test_selection_bias_moves_the_choice_not_the_weight():
    logits = np.zeros((1, 8), np.float32)
    logits[0, 3] = 0.1  # the best probability
    bias = np.zeros(8, np.float32)
    bias[5] = 1.0  # expert 5 wins the selection with an equal-or-lower probability
    ids, w = _route_cpu(logits, 1, GATING_SIGMOID, 1, 1, bias, False, 1.0)
    assert ids[0, 0] == 5
    assert w[0, 0] == pytest.approx(0.5)  # sigmoid(0): the unbiased probability


def test_group_limit_excludes_the_best_expert_of_a_weak_group():
    logits = np.full((1, 8), -4.0, np.float32)
    logits[0, 0] = 3.0  # group 0 = experts 0..3: one strong expert, the rest weak
    logits[0, 4:8] = 2.0  # group 1: four good experts (top-2 sum 2*sigmoid(2) > sigmoid(3)+sigmoid(-4))
    ids, _ = _route_cpu(logits, 2, GATING_SIGMOID, 2, 1, None, True, 1.0)
    assert set(ids[0]) <= {4, 5, 6, 7}


# ----------------------------------------------------------------------------- YaRN
def _v3_md(log_mul=0.1):
    md = {"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 40.0,
          "deepseek2.rope.scaling.original_context_length": 4096}
    if log_mul is not None:
        md["deepseek2.rope.scaling.yarn_log_multiplier"] = log_mul
    return md


def _yarn(md, n_ctx_train=163840):
    return yarn_from_metadata(HParamReader(md, "deepseek2", "x.gguf"), n_ctx_train)


def test_yarn_tables_match_the_float64_formula():
    y = _yarn(_v3_md())
    d, n = 64, 300
    spec = RopeSpec(dim=d, base=10000.0, neox=False, freq_scale=y.freq_scale, ext_factor=y.ext_factor,
                    attn_factor=y.attn_factor, n_ctx_orig=y.n_ctx_orig)
    cos, sin = rope_tables(spec, n)
    # float64 YaRN (jquesnelle/yarn, as ggml): interpolated vs extrapolated frequency per pair
    lo, hi = yarn_corr_dims(d, 4096, 10000.0, 32.0, 1.0)
    assert (lo, hi) == (10.0, 23.0)  # DeepSeek-V3: beta 32/1, 4096 original positions, base 1e4
    j = np.arange(d // 2)
    extrap = 10000.0 ** (-2.0 * j / d)
    ramp = 1 - np.clip((j - lo) / max(0.001, hi - lo), 0, 1)
    freq = extrap / 40.0 * (1 - ramp) + extrap * ramp
    ang = np.arange(n)[:, None] * freq[None, :]
    np.testing.assert_allclose(cos, np.cos(ang), atol=2e-4)  # float32 theta recurrence at pos 300
    np.testing.assert_allclose(sin, np.sin(ang), atol=2e-4)
    assert abs(y.attn_factor * (1 + 0.1 * math.log(40)) - 1.0) < 1e-6  # rope magnitude ~1
    # DeepSeek-V3 softmax scale: mscale = 1 + 0.1 * 1.0 * ln 40, squared, over sqrt(192)
    m = 1 + 0.1 * math.log(40)
    assert y.kq_scale(192) == pytest.approx(m * m / math.sqrt(192), rel=1e-6)


def test_yarn_deepseek_v2_lite_mscale_and_no_scaling():
    y = _yarn(_v3_md(0.0707))
    m = 1 + 0.1 * 0.707 * math.log(40)
    assert y.kq_scale(192) == pytest.approx(m * m / math.sqrt(192), rel=1e-5)
    assert abs(y.attn_factor * (1 + 0.1 * math.log(40)) - 1.0) < 1e-6
    plain = _yarn({}, 4096)
    assert (plain.freq_scale, plain.ext_factor, plain.attn_factor) == (1.0, 0.0, 1.0)
    assert plain.kq_scale(192) == pytest.approx(1 / math.sqrt(192), rel=1e-7)
    with pytest.raises(HParamError, match="rope.scaling.type"):
        _yarn({"deepseek2.rope.scaling.type": "warp"})


# ----------------------------------------------------------------------------- per-head matmul
@pytest.mark.parametrize("ggml_type", [quant.GGML_Q8_0, quant.GGML_F16, quant.GGML_F32, quant.GGML_Q4_K])
def test_head_matmul_matches_dequantized_float64(ggml_type):
    rng = np.random.default_rng(3)
    NH, R, C, T = 4, 48, 256, 5
    w = quant.random_blocks(rng, ggml_type, NH * R, C, scale=0.02)
    arena = np.concatenate([np.zeros(64, np.uint8), w])
    x = rng.standard_normal((T, NH, C)).astype(np.float32)
    out = mla.head_matmul(arena, 64, ggml_type, NH, R, C, x)
    wf = quant.dequantize(arena, ggml_type, NH * R, C, 64).reshape(NH, R, C).astype(np.float64)
    ref = np.einsum("thc,hrc->thr", x.astype(np.float64), wf)
    tol = 1e-4 if ggml_type == quant.GGML_F32 else 2e-2  # activation quantized to 8 bits / f16
    np.testing.assert_allclose(out, ref, atol=tol * np.abs(ref).max())
    # the same as the single-tensor matmul per head (same kernels, same activation rounding)
    for h in range(NH):
        single = quant.matmul(arena, 64 + h * R * quant.row_bytes(ggml_type, C), ggml_type, R, C, x[:, h])
        np.testing.assert_array_equal(out[:, h], single)


def test_head_matmul_with_a_head_stride_and_bounds():
    rng = np.random.default_rng(4)
    NH, DN, DV, C = 3, 32, 64, 64
    w = quant.random_blocks(rng, quant.GGML_Q8_0, NH * (DN + DV), C)
    rb = quant.row_bytes(quant.GGML_Q8_0, C)
    x = rng.standard_normal((2, NH, C)).astype(np.float32)
    v = mla.head_matmul(w, DN * rb, quant.GGML_Q8_0, NH, DV, C, x, head_stride_bytes=(DN + DV) * rb)
    wf = quant.dequantize(w, quant.GGML_Q8_0, NH * (DN + DV), C).reshape(NH, DN + DV, C)[:, DN:]
    ref = np.einsum("thc,hrc->thr", x.astype(np.float64), wf.astype(np.float64))
    np.testing.assert_allclose(v, ref, atol=2e-2 * np.abs(ref).max())
    with pytest.raises(ValueError, match="arena ends"):
        mla.head_matmul(w, (DN + 1) * rb, quant.GGML_Q8_0, NH, DV, C, x, head_stride_bytes=(DN + DV) * rb)



@pytest.mark.parametrize("ggml_type", [quant.GGML_Q8_0, quant.GGML_Q6_K])
def test_head_matmul_in_place_sources_and_the_pool_equal_per_head_matmuls(ggml_type):
    """Rows quantized head-major from x read in place (a column slice of a wider array, as
    q[:, :, :Dn]; a transposed view), a float64 x (copied), on the pool or the calling thread:
    every (token, head) equals the single-tensor matmul of that head, bit for bit."""
    from moe_service.engine.pool import WorkerPool

    rng = np.random.default_rng(5)
    NH, R, C, T = 8, 64, 256, 64  # T * R * C = 2^20: the pooled path
    w = quant.random_blocks(rng, ggml_type, NH * R, C, scale=0.02)
    rb = quant.row_bytes(ggml_type, C)
    wide = rng.standard_normal((T, NH, C + 64)).astype(np.float32)
    sources = {"column slice": wide[:, :, :C], "transposed": np.ascontiguousarray(wide[:, :, :C].transpose(1, 0, 2))
               .transpose(1, 0, 2), "float64": wide[:, :, :C].astype(np.float64)}
    want = np.stack([quant.matmul(w, h * R * rb, ggml_type, R, C, np.ascontiguousarray(wide[:, h, :C]))
                     for h in range(NH)], axis=1)
    pool = WorkerPool(n_threads=2)
    try:
        for name, x in sources.items():
            for p in (None, pool):
                got = mla.head_matmul(w, 0, ggml_type, NH, R, C, x, pool=p)
                assert got.shape == (T, NH, R), name
                np.testing.assert_array_equal(got, want, err_msg=f"{name}, pool {p is not None}")
    finally:
        pool.close()


# ----------------------------------------------------------------------------- latent attention
def test_latent_attention_matches_float64():
    """vc is kc (V = first Rkv dims of each cache row), one KV head for all query heads."""
    rng = np.random.default_rng(5)
    NH, RKV, DR, S, C = 4, 64, 16, 2, 32
    L = RKV + DR
    spans = [(1, 0, 5, 0), (0, 5, 6, 3)]  # a 5-token prefill of slot 1, one decode token of slot 0 at 3
    kc = np.zeros((S, C, 1, L), np.uint16)
    pre = rng.standard_normal((3, 1, L)).astype(np.float32)  # slot 0's earlier rows
    attention.store(kc, kc, pre, None, [(0, 0, 3, 0)])
    k = rng.standard_normal((6, 1, L)).astype(np.float32)
    q = rng.standard_normal((6, NH, L)).astype(np.float32)
    attention.store(kc, kc, k, None, spans)
    out = np.empty((6, NH, RKV), np.float32)
    scale = 1 / math.sqrt(192)
    attention.attend(None, q, kc, kc, spans, scale, out)
    keys = kc.view(np.float16).astype(np.float64)
    for s, a, e, n0 in spans:
        for t in range(a, e):
            L_t = n0 + (t - a) + 1
            kk = keys[s, :L_t, 0]
            sc = (q[t].astype(np.float64) @ kk.T) * scale  # [NH, L_t]
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[t], p @ kk[:, :RKV], atol=3e-3)
