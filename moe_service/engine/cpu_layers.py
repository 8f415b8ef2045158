"""The dense glue of a transformer layer on the CPU, as numba kernels with ggml's rounding.

The quantized matmuls and the fused MoE step run on the worker pool (pool.py, moe.py); what is
left per layer (RMSNorm, RoPE, the float16 KV cache and attention, the router's softmax and
top-k, SwiGLU) is small work whose cost on a 30-layer model is the Python and torch per-op
overhead, not arithmetic. Each function here is one call per layer, on the calling thread.

Rounding follows ggml's CPU backend (so that our activations reach the next 8-bit
quantization with the same bits as llama.cpp's):

- rms_norm: squares in float32 summed in float64, mean rounded to float32,
  scale = 1/sqrtf(mean + eps), y = (x * scale) * w;
- K and V stored as float16; attention (non-flash path): Q rounded to float16, K·Q in float32,
  softmax of (scores * scale) with the exponentials summed in float64 and scaled by
  float32(1/sum), probabilities rounded to float16, then P·V in float32;
- SwiGLU: silu(g) * u with silu(x) = x / (1 + expf(-x)).

Shapes: T tokens, H hidden, NH / NKV heads, D head dim, C cache length, E experts, K top-k.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from moe_service.engine.quant.ir import dot_f32_ggml

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@intrinsic
def _f32_to_f16_bits(typingctx, x):
    """float32 -> IEEE half (nearest even) bits as uint16."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return sig, codegen


@intrinsic
def _f16_bits_to_f32(typingctx, h):
    """IEEE half bits (uint16) -> float32, exact."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


_JIT_ROW = {**_JIT, "inline": "always"}
"""The row helpers: inlined into their kernels at numba's IR level (no call, the loops as if
written there)."""


@njit(**_JIT_ROW)
def _rms_scale_row(x, s, w, eps, out):
    """The rest of :func:`_rms_norm_row` given ``s``, the float64 sum of x's float32 squares
    in index order (add_rms_norm sums them in its add's pass): mean rounded to float32,
    scale = 1/sqrtf(mean + eps), out = (x * scale) * w. x, out float32 [n] (may alias)."""
    n = x.shape[0]
    mean = np.float32(s / n)
    scale = np.float32(1.0) / np.sqrt(mean + eps)
    for i in range(n):
        out[i] = (x[i] * scale) * w[i]


@njit(**_JIT_ROW)
def _rms_norm_row(x, w, eps, out):
    """out = (x * 1/sqrtf(mean(x^2) + eps)) * w of one row, ggml's rounding (module
    docstring): x, out float32 [n] (may alias), w float32 [n], eps float32."""
    s = 0.0
    for i in range(x.shape[0]):
        v = x[i]
        s += np.float64(v * v)
    _rms_scale_row(x, s, w, eps, out)


@njit(**_JIT_ROW)
def _rope_row(x, cos, sin, p, rope_dim, neox):
    """One head row x float32 [D] in place: its first ``rope_dim`` dims rotated at position
    ``p`` (cos, sin float32 [C, rope_dim/2]); neox: pairs (j, j + rope_dim/2), else adjacent
    pairs (2j, 2j+1)."""
    half = rope_dim // 2
    for j in range(half):
        c = cos[p, j]
        s = sin[p, j]
        if neox:
            a = x[j]
            b = x[j + half]
            x[j] = a * c - b * s
            x[j + half] = a * s + b * c
        else:
            a = x[2 * j]
            b = x[2 * j + 1]
            x[2 * j] = a * c - b * s
            x[2 * j + 1] = a * s + b * c


@njit(**_JIT)
def rms_norm(x, w, eps, out):
    """out[t] = (x[t] * 1/sqrtf(mean(x[t]^2) + eps)) * w, as ggml_rms_norm then ggml_mul.

    x, out: float32 [T, H] (may alias); w: float32 [H]; eps: float32.
    """
    for t in range(x.shape[0]):
        _rms_norm_row(x[t], w, eps, out[t])


@njit(**_JIT)
def rms_norm_heads(x, w, eps):
    """rms_norm over each head vector in place: x float32 [T, heads, D], w float32 [D]
    (qwen3moe's q/k norms)."""
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            _rms_norm_row(x[t, h], w, eps, x[t, h])


@njit(**_JIT)
def rope(x, positions, cos, sin, rope_dim, neox):
    """Rotate the first ``rope_dim`` dims of every head in place.

    x: float32 [T, heads, D]; positions: int64 [T]; cos, sin: float32 [C, rope_dim/2] (the
    model's ggml-rounded tables); neox: pairs (i, i + rope_dim/2) (qwen) instead of adjacent
    pairs (2i, 2i+1) (llama).
    """
    for t in range(x.shape[0]):
        p = positions[t]
        for h in range(x.shape[1]):
            _rope_row(x[t, h], cos, sin, p, rope_dim, neox)


@njit(**_JIT)
def add_rms_norm(x, o, w, eps, x_out, h_out):
    """x_out = x + o, then h_out = rms_norm(x_out) * w (:func:`rms_norm`'s rounding), in one
    call: the residual add and the next norm of a layer (llama.py's block).

    x, o, x_out, h_out: float32 [T, H] (x_out may alias x); w: float32 [H]; eps: float32.
    The same bits as numpy's ``x + o`` followed by :func:`rms_norm`.
    """
    for t in range(x.shape[0]):
        s = 0.0
        for i in range(x.shape[1]):
            v = x[t, i] + o[t, i]
            x_out[t, i] = v
            s += np.float64(v * v)
        _rms_scale_row(x_out[t], s, w, eps, h_out[t])


@njit(**_JIT)
def _norm_rope_heads(x, w, has_norm, eps, p, cos, sin, rope_dim, neox):
    """One token's heads x float32 [heads, D] in place: :func:`rms_norm_heads` (when
    ``has_norm``) then :func:`rope` at position ``p``, head by head (the same row helpers, so
    the same bits as the two calls)."""
    for h in range(x.shape[0]):
        if has_norm:
            _rms_norm_row(x[h], w, eps, x[h])
        _rope_row(x[h], cos, sin, p, rope_dim, neox)


@njit(**_JIT)
def qk_norm_rope_one(q, k, wq, wk, has_norm, eps, p, cos, sin, rope_dim, neox):
    """One decode token's q float32 [NH, D] and k float32 [NKV, D] in place: the per-head
    RMSNorm by wq / wk float32 [D] (qwen3, qwen3moe; skipped when not ``has_norm``), then
    RoPE at position ``p`` (cos, sin float32 [C, rope_dim/2]; neox pairing as :func:`rope`).
    One compiled call instead of four (rms_norm_heads twice, rope twice): the same bits."""
    _norm_rope_heads(q, wq, has_norm, eps, p, cos, sin, rope_dim, neox)
    _norm_rope_heads(k, wk, has_norm, eps, p, cos, sin, rope_dim, neox)


@njit(**_JIT)
def attention(q, kc, vc, seq, n0, scale, out, kf, vf, scores):
    """Causal attention of n new tokens (positions n0..n0+n-1) of one sequence over its cache:
    the single-threaded scalar statement of engine/attention's default (two-pass) contract,
    kept as the tests' reference (the engine calls engine/attention/).

    q: float32 [n, NH, D]; kc, vc: uint16 float16 caches [S, C, NKV, D] already holding the new
    tokens; out: float32 [n, NH, Dv]; kf, vf: float32 scratch [>= n0 + n, NKV, D|Dv];
    scores: float32 scratch [>= n0 + n]. Query head h reads KV head h // (NH / NKV) (GQA).
    Rounding as ggml's non-flash path (module docstring). The cache rows are widened to
    float32 once per call and read by every query and every head of their group.
    """
    n, nh, d = q.shape
    nkv = kc.shape[2]
    dv = vc.shape[3]
    group = nh // nkv
    for j in range(n0 + n):
        for g in range(nkv):
            for i in range(d):
                kf[j, g, i] = _f16_bits_to_f32(kc[seq, j, g, i])
            for i in range(dv):
                vf[j, g, i] = _f16_bits_to_f32(vc[seq, j, g, i])
    qh = np.empty(d, np.float32)
    acc_v = np.empty(dv, np.float32)
    for t in range(n):
        L = n0 + t + 1
        for h in range(nh):
            g = h // group
            for i in range(d):
                qh[i] = _f16_bits_to_f32(_f32_to_f16_bits(q[t, h, i]))
            mx = np.float32(-np.inf)
            for j in range(L):
                acc = np.float32(0.0)
                for i in range(d):
                    acc += qh[i] * kf[j, g, i]
                sc = acc * scale
                scores[j] = sc
                if sc > mx:
                    mx = sc
            total = 0.0
            for j in range(L):
                e = np.exp(scores[j] - mx)
                scores[j] = e
                total += np.float64(e)
            inv = np.float32(1.0 / total)
            for i in range(dv):
                acc_v[i] = 0.0
            for j in range(L):
                pj = _f16_bits_to_f32(_f32_to_f16_bits(scores[j] * inv))
                for i in range(dv):
                    acc_v[i] += pj * vf[j, g, i]
            for i in range(dv):
                out[t, h, i] = acc_v[i]


@njit(**_JIT)
def router_logits(h, w_bytes, w_off, out):
    """out[t, e] = router row e . h[t] in ggml's F32 order (quant.ir.dot_f32_ggml, the same
    numbers as the F32 matmul kernel on the worker pool). h: float32 [T, H] C-contiguous;
    the router: E rows of H float32 at byte ``w_off`` of ``w_bytes`` (uint8: the arena, or a
    float32 matrix's bytes); out: float32 [T, E]. The caller checks the bounds."""
    n_tok, n = h.shape
    hf = h.reshape(-1)
    for t in range(n_tok):
        for e in range(out.shape[1]):
            out[t, e] = dot_f32_ggml(w_bytes, w_off + e * n * 4, hf, t * n, n)


@njit(**_JIT)
def silu_mul(g, u, out):
    """out = silu(g) * u elementwise (float32 [T, F]), silu(x) = x / (1 + expf(-x))."""
    for t in range(g.shape[0]):
        for i in range(g.shape[1]):
            a = g[t, i]
            out[t, i] = (a / (np.float32(1.0) + np.exp(-a))) * u[t, i]


@njit(**_JIT)
def route(logits, k, gating, norm, scale, bias, has_bias, n_group, n_group_used, ids, weights):
    """Router (arch.base.Routing, after llama.cpp's build_moe_ffn), per token of logits float32
    [T, E]:

    - probabilities: gating 0 softmax, 1 sigmoid, 2 the logits themselves (gpt-oss: softmax
      over the selected ones below);
    - selection score = probability (+ bias[e] when has_bias: selects, does not weight);
    - group-limited when n_group > 1: experts in n_group equal groups, a group's score is the
      sum of its two best selection scores, only the n_group_used best groups compete;
    - the k best scores, ties to the lower id; weights = probabilities at the picked ids
      (gating 2: their softmax), renormalised to sum 1 when ``norm`` (the sum clamped below
      at 2^-14 as llama.cpp), times ``scale``.

    Writes ids int32 [T, K] and weights float32 [T, K]. Never reads outside its arrays:
    k <= E and n_group_used <= n_group, E % n_group == 0 are the caller's checks
    (arch modules' check_hparams); a token always gets k distinct ids.
    """
    n_e = logits.shape[1]
    probs = np.empty(n_e, np.float32)
    score = np.empty(n_e, np.float32)
    taken = np.zeros(n_e, np.bool_)
    gsc = np.empty(max(n_group, 1), np.float32)
    gkeep = np.zeros(max(n_group, 1), np.bool_)
    per = n_e // n_group if n_group > 1 else n_e
    for t in range(logits.shape[0]):
        if gating == 0:
            mx = logits[t, 0]
            for e in range(n_e):
                mx = max(mx, logits[t, e])
            total = 0.0
            for e in range(n_e):
                v = np.exp(logits[t, e] - mx)
                probs[e] = v
                total += np.float64(v)
            inv = np.float32(1.0 / total)
            for e in range(n_e):
                probs[e] = probs[e] * inv
        elif gating == 1:
            for e in range(n_e):
                probs[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[t, e]))
        else:
            for e in range(n_e):
                probs[e] = logits[t, e]
        for e in range(n_e):
            score[e] = probs[e] + (bias[e] if has_bias else np.float32(0.0))
            taken[e] = False
        if n_group > 1:
            for g in range(n_group):
                b1 = np.float32(-np.inf)
                b2 = np.float32(-np.inf)
                for e in range(g * per, (g + 1) * per):
                    if score[e] > b1:
                        b2 = b1
                        b1 = score[e]
                    elif score[e] > b2:
                        b2 = score[e]
                gsc[g] = b1 + b2 if per > 1 else b1
                gkeep[g] = False
            for _ in range(n_group_used):
                best = -1
                for g in range(n_group):
                    if not gkeep[g] and (best < 0 or gsc[g] > gsc[best]):
                        best = g
                gkeep[best] = True
            for g in range(n_group):
                if not gkeep[g]:
                    for e in range(g * per, (g + 1) * per):
                        score[e] = np.float32(-np.inf)
        for j in range(k):
            best = -1
            for e in range(n_e):
                if not taken[e] and (best < 0 or score[e] > score[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = probs[best]
        if gating == 2:
            mx = weights[t, 0]
            for j in range(k):
                mx = max(mx, weights[t, j])
            total = 0.0
            for j in range(k):
                v = np.exp(weights[t, j] - mx)
                weights[t, j] = v
                total += np.float64(v)
            inv = np.float32(1.0 / total)
            for j in range(k):
                weights[t, j] = weights[t, j] * inv
        wsum = 0.0  # float64, as ggml_sum_rows
        for j in range(k):
            wsum += np.float64(weights[t, j])
        wsum = max(np.float32(wsum), np.float32(6.103515625e-5))
        for j in range(k):
            w = weights[t, j] / wsum if norm else weights[t, j]
            weights[t, j] = w * scale


def _resident_zeros_u16(shape: tuple[int, ...]) -> np.ndarray:
    """uint16 zeros of ``shape`` on 2 MiB-aligned, huge-page-advised memory, every page
    faulted in now (the engine's KV cache is now moe_service.engine.kv.KVCache.allocate,
    which does this for all layers in one mapping bound to a node)."""
    from moe_service.memory import reserve_thp_arena

    n = int(np.prod(shape))
    a = reserve_thp_arena(max(2 * n, 2)).view(np.uint16)[:n].reshape(shape)
    a.fill(0)
    return a
