"""Attention over the float16 KV cache as torch ops (the torch dense path's counterpart of
moe_service.engine.attention): causal, with an optional sliding window and per-head sinks.

Same contract and numerics as :mod:`moe_service.engine.attention` (ggml's CPU non-flash path):
Q rounded to float16, K.Q in float32 times ``scale``, masked (causal; with ``window`` > 0 a
query at position p sees keys j with p - window < j <= p, llama.cpp's
``LLAMA_SWA_TYPE_STANDARD``), the maximum taken over the scores and the head's sink logit,
exponentials summed in float64 (plus exp(sink - max)), scaled by float32(1/sum), probabilities
rounded to float16, then P.V in float32. Sinks (gpt-oss ``attn_sinks``) join the denominator
and contribute no value.

Shapes: T tokens of the step, S sequence slots, C cache length, NH query heads, NKV KV heads
(query head h reads KV head h // (NH / NKV)), D key dim, Dv value dim. ``spans``: list of
(seq, a, e, n0) as in attention.py. Caches: torch float16 [S, C, NKV, D] / [S, C, NKV, Dv].
"""

from __future__ import annotations

import torch


def store(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans) -> None:
    """Append the step's keys k [T, NKV, D] and values v [T, NKV, Dv] (float32) at each
    span's positions n0..n0+(e-a)-1, rounded to float16."""
    for s, a, e, n0 in spans:
        n = e - a
        kc[s, n0: n0 + n] = k[a:e].to(torch.float16)
        vc[s, n0: n0 + n] = v[a:e].to(torch.float16)


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, spans, scale: float, out: torch.Tensor, *,
           window: int = 0, sinks: torch.Tensor | None = None) -> None:
    """Attention of every span's queries q [T, NH, D] (float32) over its sequence's cache
    (already holding the new keys) into out [T, NH, Dv] (float32). window: 0 = full causal;
    sinks: float32 [NH] or None. Raises ValueError for shapes that do not agree."""
    nh, d = q.shape[1], q.shape[2]
    nkv = kc.shape[2]
    if nkv == 0 or nh % nkv or kc.shape[3] != d or vc.shape[2] != nkv or out.shape[1] != nh:
        raise ValueError(f"attention: q {tuple(q.shape)}, k cache {tuple(kc.shape)}, v cache {tuple(vc.shape)}, "
                         f"out {tuple(out.shape)} do not agree")
    if sinks is not None and sinks.shape[0] != nh:
        raise ValueError(f"attention: {sinks.shape[0]} sinks for {nh} heads")
    group = nh // nkv
    dev = q.device
    sk = sinks.float().view(nh, 1, 1) if sinks is not None else None  # [NH, 1, 1]
    for s, a, e, n0 in spans:
        n = e - a
        L = n0 + n
        if L > kc.shape[1]:
            raise ValueError(f"attention: sequence {s} needs {L} cache rows of {kc.shape[1]}")
        lo = max(0, n0 - window + 1) if window > 0 else 0  # first key any of these queries sees
        keys = kc[s, lo:L].float().repeat_interleave(group, dim=1)  # [L', NH, D]
        vals = vc[s, lo:L].float().repeat_interleave(group, dim=1)  # [L', NH, Dv]
        qs = q[a:e].to(torch.float16).float()  # ggml computes K.Q with Q converted to f16
        scores = torch.einsum("thd,lhd->htl", qs, keys) * scale  # [NH, n, L']
        qpos = torch.arange(n0, L, device=dev)[:, None]
        kpos = torch.arange(lo, L, device=dev)[None, :]
        masked = kpos > qpos
        if window > 0:
            masked = masked | (kpos <= qpos - window)
        if masked.any():
            scores = scores.masked_fill(masked, float("-inf"))
        mx = scores.max(dim=-1, keepdim=True).values  # [NH, n, 1]
        if sk is not None:
            mx = torch.maximum(mx, sk)
        ex = torch.exp(scores - mx)
        total = ex.double().sum(-1, keepdim=True)
        if sk is not None:
            total = total + torch.exp(sk - mx).double()
        probs = (ex * (1.0 / total).float()).to(torch.float16).float()  # ggml: KQ to f16 for V.KQ
        out[a:e] = torch.einsum("htl,lhd->thd", probs, vals)
