"""gpt-oss primitives on the seam: YaRN RoPE tables and the scaling llama.cpp derives from a
file (arch/rope.py), routing by the top-k raw logits with a softmax over the selected
(cpu_layers.route gating 2, model.torch_route), attention with a sliding window and sinks on
both dense paths (engine/attention/, TorchPath.attention).

Tolerances: the CPU (numba) and torch versions follow the same ggml rounding points but sum
in different orders, so they agree to float32 summation noise (1e-5 of the values' scale);
the float64 references check the formulas themselves (1e-5 relative for tables built in
float32, 2e-3 for attention outputs, whose probabilities are rounded to float16 as ggml does).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_service.engine import attention, cpu_layers
from moe_service.engine.arch import GATING_SOFTMAX_WEIGHT, HParamError, HParamReader, RopeSpec, Routing
from moe_service.engine.arch import rope as R
from moe_service.engine.model import TorchPath, torch_route


def _scaling(md: dict, arch: str, n_ctx_train: int) -> dict:
    return R.scaling_from_metadata(HParamReader(md, arch, "m.gguf"), n_ctx_train)


# ---------------------------------------------------------------------------------------------
# RoPE tables


def _plain_tables_as_model(n_ctx, rope_dim, base):
    """The engine's pre-YaRN table code (model._rope_tables): the unscaled case must not move."""
    half = rope_dim // 2
    theta_scale = np.float32(np.float32(base) ** np.float32(-2.0 / rope_dim))
    theta = np.empty((n_ctx, half), dtype=np.float32)
    theta[:, 0] = np.arange(n_ctx, dtype=np.float32)
    for j in range(1, half):
        theta[:, j] = theta[:, j - 1] * theta_scale
    ang = theta.astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def test_unscaled_tables_are_the_engine_tables_bit_for_bit():
    cos, sin = R.rope_tables(RopeSpec(dim=64, base=150000.0, neox=True), 300)
    c0, s0 = _plain_tables_as_model(300, 64, 150000.0)
    assert np.array_equal(cos, c0) and np.array_equal(sin, s0)
    # linear scaling without YaRN: angles times freq_scale, magnitude attn_factor (1)
    cl, _ = R.rope_tables(RopeSpec(dim=64, base=10000.0, neox=True, freq_scale=0.25), 300)
    ang = np.arange(300)[:, None] * 0.25 * 10000.0 ** (-np.arange(32) / 32.0)
    assert np.abs(cl - np.cos(ang)).max() < 2e-4  # float32 theta chain over 300 positions


def _yarn_float64(n_ctx, dim, base, factor, n_orig, beta_fast=32.0, beta_slow=1.0):
    """YaRN as the paper/HF write it (float64): per-pair blend of interpolated and extrapolated
    frequencies with a linear ramp between the correction dims, magnitude 1 + 0.1 ln(factor)."""
    def corr(b):
        return dim * math.log(n_orig / (b * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(corr(beta_fast))), min(dim - 1, math.ceil(corr(beta_slow)))
    j = np.arange(dim // 2)
    ramp = 1 - np.clip((j - low) / max(0.001, high - low), 0, 1)  # 1: extrapolate (high freq)
    inv = base ** (-2.0 * j / dim)
    freq = inv / factor * (1 - ramp) + inv * ramp
    ang = np.arange(n_ctx)[:, None] * freq[None, :]
    m = 1 + 0.1 * math.log(factor)
    return np.cos(ang) * m, np.sin(ang) * m


def test_yarn_tables_match_the_formula_for_gpt_oss_parameters():
    md = {"gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0,
          "gpt-oss.rope.scaling.original_context_length": 4096}
    sc = _scaling(md, "gpt-oss", 131072)
    assert sc["freq_scale"] == 1 / 32 and sc["ext_factor"] == 1.0 and sc["n_ctx_orig"] == 4096
    # llama.cpp cancels get_mscale(32) in attn_factor because rope_yarn multiplies it in again
    assert abs(sc["attn_factor"] - 1.0) <= 1.2e-7
    cos, sin = R.rope_tables(RopeSpec(dim=64, base=150000.0, neox=True, **sc), 2048)
    rc, rs = _yarn_float64(2048, 64, 150000.0, 32.0, 4096)
    # float32 theta products drift ~1e-7 relative per step; angles up to ~2000 rad: 1e-3 abs
    assert np.abs(cos - rc).max() < 2e-3 and np.abs(sin - rs).max() < 2e-3
    assert np.abs(cos[:64] - rc[:64]).max() < 1e-5
    assert math.isclose(float(np.hypot(cos[5, 3], sin[5, 3])), 1 + 0.1 * math.log(32), rel_tol=1e-6)


def test_scaling_from_metadata_rules():
    assert _scaling({}, "llama", 4096) == {"freq_scale": 1.0, "ext_factor": 0.0, "attn_factor": 1.0,
                                           "n_ctx_orig": 4096}
    none = _scaling({"a.rope.scaling.type": "none", "a.rope.scaling.factor": 4.0}, "a", 100)
    assert none["freq_scale"] == 1.0 and none["ext_factor"] == 0.0
    lin = _scaling({"a.rope.scale_linear": 2.0}, "a", 100)  # the old key
    assert lin["freq_scale"] == 0.5 and lin["ext_factor"] == 0.0
    # a log multiplier (deepseek2-style keys): mscale / mscale_all_dims, then the rope_yarn cancel
    md = {"d.rope.scaling.type": "yarn", "d.rope.scaling.factor": 40.0, "d.rope.scaling.yarn_log_multiplier": 0.1}
    want = (1 + 0.1 * math.log(40)) / (1 + 0.1 * 0.1 * math.log(40)) / (1 + 0.1 * math.log(40))
    assert math.isclose(_scaling(md, "d", 4096)["attn_factor"], want, rel_tol=1e-6)
    with pytest.raises(HParamError, match=r"x\.rope\.scaling\.type is 'longrope'"):
        _scaling({"x.rope.scaling.type": "longrope"}, "x", 10)
    with pytest.raises(HParamError, match=r"x\.rope\.scaling\.factor"):
        _scaling({"x.rope.scaling.factor": -2.0}, "x", 10)


# ---------------------------------------------------------------------------------------------
# Routing: top-k of raw logits, softmax over the selected


def _route_cpu(logits, k, scale=1.0):
    ids = np.empty((logits.shape[0], k), np.int32)
    w = np.empty((logits.shape[0], k), np.float32)
    cpu_layers.route(logits, k, GATING_SOFTMAX_WEIGHT, False, np.float32(scale), np.zeros(0, np.float32), False,
                     1, 1, ids, w)
    return ids, w


def test_topk_softmax_routing_cpu_torch_and_reference():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((37, 32)) * 3).astype(np.float32)
    ids, w = _route_cpu(logits, 4)
    tids, tw = torch_route(torch.from_numpy(logits), Routing(k=4, gating=GATING_SOFTMAX_WEIGHT, norm=False), None)
    assert np.array_equal(ids, tids.numpy())
    assert np.abs(w - tw.numpy()).max() <= 3e-7  # torch sums the softmax in float32: a few ulps
    ref_ids = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :4]
    assert np.array_equal(ids, ref_ids)
    sel = np.take_along_axis(logits.astype(np.float64), ref_ids, axis=1)
    ref_w = np.exp(sel - sel.max(1, keepdims=True))
    ref_w /= ref_w.sum(1, keepdims=True)
    assert np.abs(w - ref_w).max() <= 2e-7
    # not the softmax over all experts: the selected weights sum to 1
    assert np.allclose(w.sum(1), 1.0, atol=1e-6)
    ids2, w2 = _route_cpu(logits, 4, scale=2.5)
    assert np.array_equal(ids2, ids) and np.allclose(w2, w * np.float32(2.5), rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# Attention with a sliding window and sinks


def _attention_float64(q, k, v, positions, window, sinks, scale, group):
    """Exact reference for one sequence whose keys sit at 0..L-1: q [n, NH, D] at positions."""
    n, nh, _ = q.shape
    out = np.zeros((n, nh, v.shape[2]))
    for t in range(n):
        p = positions[t]
        lo = max(0, p - window + 1) if window else 0
        for h in range(nh):
            g = h // group
            s = (k[lo:p + 1, g].astype(np.float64) @ q[t, h].astype(np.float64)) * scale
            m = max(s.max(), sinks[h]) if sinks is not None else s.max()
            e = np.exp(s - m)
            den = e.sum() + (math.exp(sinks[h] - m) if sinks is not None else 0.0)
            out[t, h] = (e / den) @ v[lo:p + 1, g].astype(np.float64)
    return out


@pytest.mark.parametrize("window,with_sinks", [(0, False), (0, True), (5, True), (5, False)])
def test_attention_window_and_sinks_cpu_torch_reference(window, with_sinks):
    rng = np.random.default_rng(window * 2 + with_sinks)
    nh, nkv, d, dv = 4, 2, 16, 16
    n_ctx, n_seq = 32, 2
    sinks = (rng.standard_normal(nh) * 2).astype(np.float32) if with_sinks else None
    kc = np.zeros((n_seq, n_ctx, nkv, d), np.uint16)
    vc = np.zeros((n_seq, n_ctx, nkv, dv), np.uint16)
    tkc = torch.zeros((n_seq, n_ctx, nkv, d), dtype=torch.float16)
    tvc = torch.zeros((n_seq, n_ctx, nkv, dv), dtype=torch.float16)
    tp = _torch_path(tkc, tvc)
    scale = 1.0 / math.sqrt(d)
    all_k = {0: [], 1: []}
    all_v = {0: [], 1: []}
    # step 1: prefill 9 tokens of seq 1 and 12 of seq 0; step 2: one decode token each
    for lens in ([(1, 9), (0, 12)], [(0, 1), (1, 1)]):
        spans, t0 = [], 0
        for s, n in lens:
            n0 = len(all_k[s])
            spans.append((s, t0, t0 + n, n0))
            t0 += n
        T = t0
        q = rng.standard_normal((T, nh, d)).astype(np.float32)
        k = rng.standard_normal((T, nkv, d)).astype(np.float32)
        v = rng.standard_normal((T, nkv, dv)).astype(np.float32)
        for s, a, e, _ in spans:
            all_k[s].extend(k[a:e].astype(np.float16))
            all_v[s].extend(v[a:e].astype(np.float16))
        out = np.empty((T, nh, dv), np.float32)
        attention.store(kc, vc, k, v, spans)
        attention.attend(None, q, kc, vc, spans, scale, out, window=window, sinks=sinks)
        tout = tp.attention(0, torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), spans, scale,
                            window=window, sinks=torch.from_numpy(sinks) if sinks is not None else None)
        assert np.abs(tout.numpy() - out).max() <= 1e-5 * np.abs(out).max()
        for s, a, e, n0 in spans:
            ks, vs = np.array(all_k[s]), np.array(all_v[s])
            qr = q[a:e].astype(np.float16).astype(np.float32)
            ref = _attention_float64(qr, ks, vs, list(range(n0, n0 + e - a)), window, sinks, scale, nh // nkv)
            assert np.abs(out[a:e] - ref).max() <= 2e-3 * max(1.0, np.abs(ref).max())
    assert np.array_equal(tkc.view(torch.int16).numpy().view(np.uint16), kc)


def _torch_path(kc, vc) -> TorchPath:
    """The torch backend over one layer's caches (what its attention primitive touches)."""
    return TorchPath(SimpleNamespace(kv=SimpleNamespace(k=[kc], v=[vc]), device=torch.device("cpu")))


def test_sinks_only_shrink_the_weights():
    """A sink of -inf is no sink; a large sink takes the mass and the output goes to 0."""
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((3, 2, 8)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((3, 1, 8)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((3, 1, 8)).astype(np.float32))
    tp = _torch_path(torch.zeros((1, 4, 1, 8), dtype=torch.float16), torch.zeros((1, 4, 1, 8), dtype=torch.float16))
    spans = [(0, 0, 3, 0)]
    base = tp.attention(0, q, k, v, spans, 0.3)
    none = tp.attention(0, q, k, v, spans, 0.3, sinks=torch.full((2,), -float("inf")))
    big = tp.attention(0, q, k, v, spans, 0.3, sinks=torch.full((2,), 60.0))
    assert torch.equal(base, none)
    assert big.abs().max() < 1e-12
    kc = np.zeros((1, 4, 1, 8), np.uint16)
    vc = np.zeros((1, 4, 1, 8), np.uint16)
    attention.store(kc, vc, k.numpy(), v.numpy(), spans)
    out = np.empty((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match="3 sinks for 2 heads"):
        attention.attend(None, q.numpy(), kc, vc, spans, 0.3, out, sinks=np.zeros(3, np.float32))
