"""A float64 reference of the deepseek2 forward pass, written from the HF modeling code's
definition (not from the engine): dequantized weights, MHA with per-head K and V expanded
from the latent (no absorption), YaRN rotary from the float64 formula, routing from the
float64 rule. For tests: slow, one sequence, whole prompt at once."""

from __future__ import annotations

import math

import numpy as np
from gguf.quants import dequantize

from moe_service.engine.arch.base import GATING_SIGMOID
from moe_service.engine.arch.rope import yarn_corr_dims


def _w(cat, ws, name) -> np.ndarray:
    t = cat.tensors[name]
    return dequantize(ws.tensor(name), t.ggml_type).reshape(t.shape).astype(np.float64)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def forward(cat, ws, arch, tokens: list[int]) -> np.ndarray:
    """float64 logits [T, V] of every prompt position; ``arch``: the model's Deepseek2."""
    hp = arch.hp
    W = lambda n: _w(cat, ws, n)  # noqa: E731
    T, NH, Dn, Dr, Dv, Rkv = len(tokens), hp.n_head, hp.qk_nope, hp.qk_rope, hp.v_head, hp.kv_lora_rank
    y = hp.yarn
    # YaRN (float64): per pair j, blend of interpolated and extrapolated frequencies
    j = np.arange(Dr // 2)
    extrap = hp.rope_base ** (-2.0 * j / Dr)
    if y.ext_factor:
        lo, hi = yarn_corr_dims(Dr, y.n_ctx_orig, hp.rope_base, 32.0, 1.0)
        ramp = 1 - np.clip((j - lo) / max(0.001, hi - lo), 0, 1)
        freq = extrap * y.freq_scale * (1 - ramp) + extrap * ramp
        mag = 1.0  # the rope magnitude cancels (llama.cpp's attn_factor correction)
        m = 1 + 0.1 * y.log_mul * math.log(1 / y.freq_scale)
    else:
        freq, mag, m = extrap * y.freq_scale, 1.0, 1.0
    ang = np.arange(T)[:, None] * freq[None, :]
    cos, sin = np.cos(ang) * mag, np.sin(ang) * mag
    scale = m * m / math.sqrt(Dn + Dr)

    def rope(x):  # x [T, heads, Dr], adjacent pairs
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)

    x = W("token_embd.weight")[tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        h = _rms(x, W(b + "attn_norm.weight"), hp.rms_eps)
        if hp.q_lora_rank:
            q = _rms(h @ W(b + "attn_q_a.weight").T, W(b + "attn_q_a_norm.weight"), hp.rms_eps) @ W(b + "attn_q_b.weight").T
        else:
            q = h @ W(b + "attn_q.weight").T
        q = q.reshape(T, NH, Dn + Dr)
        kv = h @ W(b + "attn_kv_a_mqa.weight").T
        c = _rms(kv[:, :Rkv], W(b + "attn_kv_a_norm.weight"), hp.rms_eps)
        k_pe = rope(kv[:, None, Rkv:])
        if hp.split_mla:
            kb = W(b + "attn_k_b.weight")  # [NH, Rkv, Dn]
            vb = W(b + "attn_v_b.weight")  # [NH, Dv, Rkv]
            k_nope = np.einsum("hrd,tr->thd", kb, c)
            v = np.einsum("hvr,tr->thv", vb, c)
        else:
            kvb = W(b + "attn_kv_b.weight").reshape(NH, Dn + Dv, Rkv)
            k_nope = np.einsum("hdr,tr->thd", kvb[:, :Dn], c)
            v = np.einsum("hvr,tr->thv", kvb[:, Dn:], c)
        qf = np.concatenate([q[..., :Dn], rope(q[..., Dn:])], -1)
        kf = np.concatenate([k_nope, np.broadcast_to(k_pe, (T, NH, Dr))], -1)
        s = np.einsum("thd,lhd->htl", qf, kf) * scale + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("htl,lhv->thv", p, v).reshape(T, NH * Dv)
        x = x + o @ W(b + "attn_output.weight").T
        h = _rms(x, W(b + "ffn_norm.weight"), hp.rms_eps)
        if i < hp.n_dense_lead:
            y = (_silu(h @ W(b + "ffn_gate.weight").T) * (h @ W(b + "ffn_up.weight").T)) @ W(b + "ffn_down.weight").T
        else:
            logits = h @ W(b + "ffn_gate_inp.weight").T
            if hp.gating == GATING_SIGMOID:
                probs = 1 / (1 + np.exp(-logits))
            else:
                probs = np.exp(logits - logits.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
            sel = probs + (W(b + "exp_probs_b.bias") if b + "exp_probs_b.bias" in cat.tensors else 0.0)
            E = hp.n_expert
            if hp.n_group > 1:
                g = sel.reshape(T, hp.n_group, E // hp.n_group)
                gs = np.sort(g, -1)[..., -2:].sum(-1)
                keep = np.argsort(-gs, -1, kind="stable")[:, : hp.n_group_used]
                drop = np.ones_like(gs, bool)
                np.put_along_axis(drop, keep, False, 1)
                sel = np.where(drop[:, :, None], -np.inf, g).reshape(T, E)
            ids = np.argsort(-sel, -1, kind="stable")[:, : hp.n_expert_used]
            wts = np.take_along_axis(probs, ids, -1)
            if hp.weights_norm:
                wts = wts / wts.sum(-1, keepdims=True)
            wts = wts * hp.weights_scale
            G, U, D = W(b + "ffn_gate_exps.weight"), W(b + "ffn_up_exps.weight"), W(b + "ffn_down_exps.weight")
            y = np.zeros_like(h)
            for t in range(T):
                for k, e in enumerate(ids[t]):
                    y[t] += wts[t, k] * (D[e] @ (_silu(G[e] @ h[t]) * (U[e] @ h[t])))
            if hp.n_expert_shared:
                y = y + (_silu(h @ W(b + "ffn_gate_shexp.weight").T) * (h @ W(b + "ffn_up_shexp.weight").T)) \
                    @ W(b + "ffn_down_shexp.weight").T
        x = x + y
    return _rms(x, W("output_norm.weight"), hp.rms_eps) @ W("output.weight").T
