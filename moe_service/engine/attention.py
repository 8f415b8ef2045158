"""Attention over the KV cache on the CPU: the one interface every architecture calls.

This module is the contract between the per-architecture blocks (they compute q, k, v and
call :func:`store` then :func:`attend` once per layer with every sequence of the step) and
the attention kernels (how the work is split over cores, tiled and vectorised). Its
callers never see the cache's element format or the work split.

Shapes: T tokens of this step (all sequences together), S sequence slots, C cache length,
NH query heads, NKV KV heads, D key dim, Dv value dim.

``spans``: a list of (seq, a, e, n0): the step's tokens a..e-1 belong to sequence slot
``seq`` and sit at positions n0..n0+(e-a)-1 of its cache.

Caches (one pair per layer, as the KV cache holds them): ``kc`` [S, C, NKV, D] and ``vc``
[S, C, NKV, Dv], float16 values held as uint16 bits (numba has no float16 type). A latent
(MLA) cache passes ``vc is kc``: V is then the first Dv dims of each K row, and
:func:`store` writes K only.

Numerics (ggml's CPU non-flash path, which llama.cpp takes on these files): Q rounded to
float16, K.Q summed in float32, scores = K.Q * scale, masked (causal, and the sliding window
when ``window`` > 0), softmax with the maximum taken over the scores (and the head's sink
logit when ``sinks`` is given), exponentials summed in float64, scaled by float32(1/sum),
probabilities rounded to float16, then P.V in float32.

Sliding window (llama.cpp ``LLAMA_SWA_TYPE_STANDARD``): a query at position p sees keys
at positions j with p - window < j <= p. Sinks (gpt-oss ``attn_sinks``): one logit per
query head that joins the softmax's denominator and contributes no value.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def _store_span(k, kc, seq, n0, a, e):
    """kc[seq, n0 + t - a] = float16(k[t]) for t in a..e-1 (k float32 [T, NKV, D'])."""
    for t in range(a, e):
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                kc[seq, n0 + t - a, h, i] = _f32_to_f16_bits(k[t, h, i])


@njit(**_JIT)
def _attend_span(q, kc, vc, seq, a, e, n0, scale, window, sinks, has_sinks, out):
    """Queries a..e-1 of one sequence over its cache rows 0..n0+(e-a)-1 (module docstring)."""
    nh, d = q.shape[1], q.shape[2]
    nkv = kc.shape[2]
    dv = out.shape[2]
    group = nh // nkv
    L_max = n0 + (e - a)
    scores = np.empty(L_max, np.float32)
    qh = np.empty(d, np.float32)
    acc_v = np.empty(dv, np.float32)
    for t in range(a, e):
        p = n0 + t - a
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        for h in range(nh):
            g = h // group
            for i in range(d):
                qh[i] = _f16_bits_to_f32(_f32_to_f16_bits(q[t, h, i]))
            mx = np.float32(-np.inf)
            for j in range(lo, p + 1):
                acc = np.float32(0.0)
                for i in range(d):
                    acc += qh[i] * _f16_bits_to_f32(kc[seq, j, g, i])
                sc = acc * scale
                scores[j] = sc
                if sc > mx:
                    mx = sc
            if has_sinks and sinks[h] > mx:
                mx = sinks[h]
            total = 0.0
            for j in range(lo, p + 1):
                ex = np.exp(scores[j] - mx)
                scores[j] = ex
                total += np.float64(ex)
            if has_sinks:
                total += np.float64(np.exp(sinks[h] - mx))
            inv = np.float32(1.0 / total)
            for i in range(dv):
                acc_v[i] = 0.0
            for j in range(lo, p + 1):
                pj = _f16_bits_to_f32(_f32_to_f16_bits(scores[j] * inv))
                for i in range(dv):
                    acc_v[i] += pj * _f16_bits_to_f32(vc[seq, j, g, i])
            for i in range(dv):
                out[t, h, i] = acc_v[i]


_NO_SINKS = np.zeros(1, np.float32)


def store(kc: np.ndarray, vc: np.ndarray, k: np.ndarray, v: np.ndarray | None, spans) -> None:
    """Append the step's new keys and values to the layer's caches.

    k: float32 [T, NKV, D]; v: float32 [T, NKV, Dv], or None when ``vc is kc`` (latent
    cache: the value is the key's first Dv dims). Raises ValueError when v is missing for a
    separate value cache.
    """
    if v is None and vc is not kc:
        raise ValueError("attention.store: v is None but the value cache is separate from the key cache")
    k = np.ascontiguousarray(k, dtype=np.float32)
    for seq, a, e, n0 in spans:
        _store_span(k, kc, seq, n0, a, e)
        if vc is not kc:
            _store_span(np.ascontiguousarray(v, dtype=np.float32), vc, seq, n0, a, e)


def attend(ops, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, spans, scale: float, out: np.ndarray, *,
           window: int = 0, sinks: np.ndarray | None = None) -> None:
    """Causal attention of every span's new queries over its sequence's cache (already
    holding the new keys), written to ``out``.

    ops: the CPU kernel backend (moe_service.engine.ops.CpuOps; its worker pool may run the
    work); q: float32 [T, NH, D]; out: float32 [T, NH, Dv]; NH a multiple of NKV (query head
    h reads KV head h // (NH / NKV)); scale: float (usually 1/sqrt(D)); window: 0 for full
    causal attention, else the sliding window in tokens; sinks: float32 [NH] or None.
    Raises ValueError for inconsistent shapes (never reads outside the caches).
    """
    nh, d = q.shape[1], q.shape[2]
    nkv = kc.shape[2]
    if nkv == 0 or nh % nkv or kc.shape[3] != d or vc.shape[2] != nkv or out.shape[2] > vc.shape[3] or out.shape[1] != nh:
        raise ValueError(f"attention: q {q.shape}, k cache {kc.shape}, v cache {vc.shape}, out {out.shape} do not agree")
    if sinks is not None and sinks.shape[0] != nh:
        raise ValueError(f"attention: {sinks.shape[0]} sinks for {nh} heads")
    s = np.ascontiguousarray(sinks, dtype=np.float32) if sinks is not None else _NO_SINKS
    for seq, a, e, n0 in spans:
        if n0 + (e - a) > kc.shape[1]:
            raise ValueError(f"attention: sequence {seq} needs {n0 + (e - a)} cache rows of {kc.shape[1]}")
        _attend_span(q, kc, vc, seq, a, e, n0, np.float32(scale), int(window), s, sinks is not None, out)
