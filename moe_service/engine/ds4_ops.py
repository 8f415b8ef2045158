"""DeepSeek V4 (``deepseek4``) building blocks in numpy, as llama.cpp 0.3.36 computes them
(src/models/deepseek4.cpp, src/llama-kv-cache-dsv4.cpp, ggml-cpu ops.cpp). Float32 in and
out; no quantized activations (llama.cpp quantizes matmul activations to q8 for Q8_0/MXFP4
weights: differences of that order are expected against it).

These are the pieces :mod:`moe_service.engine.arch.deepseek4`'s forward pass is to be
composed of; tests/support/ds4_reference.py runs a whole model through them against
llama.cpp's goldens. Shapes: T tokens, C hyper-connection streams, H hidden, M = (2 + C) C.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm over the last axis (no weight): float32(x / sqrt(mean(float64(x)^2) + eps)),
    the mean as numpy's (its pairwise sum, :func:`_pairwise_sum`), compiled: numpy's seven
    array passes cost ~0.1 ms per call on a decode step's 64 x 512 query heads."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.size == 0 or x.shape[-1] == 0:
        return x.copy()
    out = np.empty_like(x)
    _rms_rows(x.reshape(-1, x.shape[-1]), np.float64(eps), out.reshape(-1, x.shape[-1]))
    return out


@njit(cache=True, nogil=True)
def _pairwise_leaf(a, o, n):
    """numpy's pairwise_sum for n <= 128 terms (see :func:`_pairwise_sum`)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[o + i]
        return res
    r0, r1, r2, r3 = a[o], a[o + 1], a[o + 2], a[o + 3]
    r4, r5, r6, r7 = a[o + 4], a[o + 5], a[o + 6], a[o + 7]
    i = 8
    m = n - n % 8
    while i < m:
        r0 += a[o + i]
        r1 += a[o + i + 1]
        r2 += a[o + i + 2]
        r3 += a[o + i + 3]
        r4 += a[o + i + 4]
        r5 += a[o + i + 5]
        r6 += a[o + i + 6]
        r7 += a[o + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[o + i]
        i += 1
    return res


@njit(cache=True, nogil=True)
def _pairwise_sum(a, o, n, frames, left):
    """numpy's pairwise summation of a[o:o+n] (float64; numpy/_core/src/umath/loops_utils.h:
    fewer than 8 terms left to right from 0; up to 128 in eight interleaved sums added
    ((0+1)+(2+3))+((4+5)+(6+7)), then the rest in order; above, the two halves, split at a
    multiple of 8, summed apart and added), so a sum equals np.add.reduce's bit for bit.
    numpy recurses; this walks the same tree with an explicit stack (numba's on-disk cache
    mislinks a recursive function: it crashed when loaded from the cache). ``frames`` int64
    [64, 3] (offset, count, stage) and ``left`` float64 [64] are that stack's scratch, from
    the caller (a halving depth of 64 covers any n)."""
    if n <= 128:
        return _pairwise_leaf(a, o, n)
    frames[0, 0], frames[0, 1], frames[0, 2] = o, n, 0
    top = 0
    ret = 0.0
    while top >= 0:
        fo, fn, stage = frames[top, 0], frames[top, 1], frames[top, 2]
        if fn <= 128:
            ret = _pairwise_leaf(a, fo, fn)
            top -= 1
            continue
        n2 = fn // 2
        n2 -= n2 % 8
        if stage == 0:  # the left half next
            frames[top, 2] = 1
            top += 1
            frames[top, 0], frames[top, 1], frames[top, 2] = fo, n2, 0
        elif stage == 1:  # the left half's sum is in: the right half next
            left[top] = ret
            frames[top, 2] = 2
            top += 1
            frames[top, 0], frames[top, 1], frames[top, 2] = fo + n2, fn - n2, 0
        else:
            ret = left[top] + ret
            top -= 1
    return ret


@njit(cache=True, nogil=True)
def _rms_rows(x, eps, out):
    """out[r] = float32(x[r] / sqrt(mean(x[r]^2) + eps)) in float64, row by row (x float32 [R, n])."""
    n = x.shape[1]
    sq = np.empty(n, np.float64)
    frames = np.empty((64, 3), np.int64)
    left = np.empty(64, np.float64)
    for r in range(x.shape[0]):
        for i in range(n):
            v = np.float64(x[r, i])
            sq[i] = v * v
        den = np.sqrt(_pairwise_sum(sq, 0, n, frames, left) / n + eps)
        for i in range(n):
            out[r, i] = np.float32(np.float64(x[r, i]) / den)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def sinkhorn(comb: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """comb [T, C(src), C(dst)] -> doubly-normalised mixing (build_hc_sinkhorn): softmax over
    dst, + eps, column-normalise (divide by sum over src + eps), then ``iters - 1`` times
    row-normalise (sum over dst + eps) and column-normalise."""
    c = comb.astype(np.float64)
    c = np.exp(c - c.max(axis=-1, keepdims=True))
    c = c / c.sum(axis=-1, keepdims=True) + eps
    if c.shape[-1] < 8:  # numpy sums fewer than 8 terms left to right: the loops below are exact copies
        _sinkhorn_iters(c, iters, eps)
        return c.astype(np.float32)

    def cols(c):
        return c / (c.sum(axis=-2, keepdims=True) + eps)

    def rows(c):
        return c / (c.sum(axis=-1, keepdims=True) + eps)

    c = cols(c)
    for _ in range(1, iters):
        c = cols(rows(c))
    return c.astype(np.float32)


@njit(cache=True, nogil=True)
def _sinkhorn_iters(c, iters, eps):
    """sinkhorn's normalisations in place on c float64 [T, C, C] (C < 8): column-normalise, then
    ``iters - 1`` times row- and column-normalise. Each sum runs left to right from the first
    term and each element is divided by (sum + eps), as numpy computes them for fewer than 8
    terms (its pairwise summation starts at 8), so the result is numpy's bit for bit; 20
    iterations of numpy calls on a 4 x 4 matrix took ~0.19 ms per call, a decode step makes
    two per layer."""
    T, C = c.shape[0], c.shape[1]
    for it in range(iters):
        for t in range(T):
            if it > 0:
                for a in range(C):
                    s = c[t, a, 0]
                    for b in range(1, C):
                        s += c[t, a, b]
                    s += eps
                    for b in range(C):
                        c[t, a, b] = c[t, a, b] / s
            for b in range(C):
                s = c[t, 0, b]
                for a in range(1, C):
                    s += c[t, a, b]
                s += eps
                for a in range(C):
                    c[t, a, b] = c[t, a, b] / s


def _mix(xn: np.ndarray, fn: np.ndarray) -> np.ndarray:
    """xn [T, K] float32 times fn [M, K] transposed -> [T, M] float32, summed in float64: a row's
    result must not depend on how many rows the step has (float32 sgemm rounds a row by its
    place in the matrix; the 1e-7 changes reach the indexer's top-k and the routing near-ties
    and flip them), and float64's 1e-14 differences vanish in the rounding to float32."""
    return (xn.astype(np.float64) @ fn.astype(np.float64, copy=False).T).astype(np.float32)


def hc_pre(x: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, eps_rms: float, eps_hc: float,
           iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hyper-connection input mix (build_hc_pre). x [T, C, H]; fn [M, C*H] (the GGUF tensor
    {C*H, M} as rows); scale [3]; base [M]. Returns (h [T, H], post [T, C], comb [T, C(src), C(dst)])."""
    T, C, H = x.shape
    mixes = _mix(rms(x.reshape(T, C * H), eps_rms), fn)  # [T, M]
    pre = sigmoid(mixes[:, :C] * scale[0] + base[:C]) + F32(eps_hc)
    post = F32(2.0) * sigmoid(mixes[:, C:2 * C] * scale[1] + base[C:2 * C])
    comb = (mixes[:, 2 * C:2 * C + C * C] * scale[2] + base[2 * C:2 * C + C * C]).reshape(T, C, C)
    comb = sinkhorn(comb, iters, eps_hc)
    h = np.einsum("tc,tch->th", pre, x).astype(np.float32)
    return h, post, comb


def hc_post(y: np.ndarray, x: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Hyper-connection output (build_hc_post): x'[dst] = post[dst] y + sum_src comb[src, dst] x[src].
    y [T, H], x [T, C, H] -> [T, C, H]."""
    return (post[:, :, None] * y[:, None, :] + np.einsum("tsd,tsh->tdh", comb, x)).astype(np.float32)


def hc_head(x: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, eps_rms: float,
            eps_hc: float) -> np.ndarray:
    """The final stream merge (build_hc_head): x [T, C, H], fn [C, C*H], scale [1], base [C] -> [T, H]."""
    T, C, H = x.shape
    mixes = _mix(rms(x.reshape(T, C * H), eps_rms), fn)
    pre = sigmoid(mixes * scale[0] + base) + F32(eps_hc)
    return np.einsum("tc,tch->th", pre, x).astype(np.float32)


def rope_last(x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """ggml NORM rope on the LAST 2*cos.shape[1] dims of each head (rope_set_offset(D - R)):
    adjacent pairs. x [T, heads, D]; cos/sin tables [n_ctx, R/2] (moe_service.engine.arch.rope);
    ``inverse``: ggml_rope_ext_back (rotation by -theta). Compiled (:func:`_rope_last_rows`),
    in numpy's arithmetic: the tables' values in the type numpy would compute in (float32, or
    float64 for float64 tables). ValueError for shapes that do not agree, IndexError for a
    position outside the tables."""
    x = np.asarray(x)
    half = cos.shape[1] if cos.ndim == 2 else 0
    if x.ndim != 3 or sin.shape != cos.shape or not 0 < 2 * half <= x.shape[2]:
        raise ValueError(f"rope_last: x {x.shape} and tables {cos.shape} / {sin.shape} do not agree")
    p = np.ascontiguousarray(pos, dtype=np.int64).reshape(-1)
    if p.shape[0] != x.shape[0]:
        raise ValueError(f"rope_last: {p.shape[0]} positions for {x.shape[0]} rows")
    if p.size and (p.min() < 0 or p.max() >= cos.shape[0]):
        raise IndexError(f"rope_last: positions {p.min()}..{p.max()} outside the tables' {cos.shape[0]} rows")
    dt = np.promote_types(np.float32, np.result_type(cos.dtype, sin.dtype))
    out = np.array(x, dtype=np.float32, order="C")  # a copy
    _rope_last_rows(out, p, np.ascontiguousarray(cos, dtype=dt), np.ascontiguousarray(sin, dtype=dt), bool(inverse))
    return out


@njit(cache=True, nogil=True)
def _rope_last_rows(x, pos, cos, sin, inverse):
    """:func:`rope_last` in place on x float32 [T, heads, D]: the pair (a, b) at dims D - R + 2i,
    + 1 becomes (a c - b s, a s + b c), c and s the tables' entries at (pos[t], i), each
    product and sum rounded as numpy rounds them (float32 tables: in float32; float64: in
    float64, then to float32)."""
    T, NH, D = x.shape
    half = cos.shape[1]
    base = D - 2 * half
    for t in range(T):
        p = pos[t]
        for h in range(NH):
            for i in range(half):
                c = cos[p, i]
                s = -sin[p, i] if inverse else sin[p, i]
                a = x[t, h, base + 2 * i]
                b = x[t, h, base + 2 * i + 1]
                x[t, h, base + 2 * i] = a * c - b * s
                x[t, h, base + 2 * i + 1] = a * s + b * c


def swiglu_clamp(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """ggml_swiglu_clamp: silu(min(g, limit)) * clamp(u, -limit, limit) (off when limit <= 1e-6)."""
    if limit > 1e-6:
        g = np.minimum(g, F32(limit))
        u = np.clip(u, -F32(limit), F32(limit))
    return (g / (1.0 + np.exp(-g.astype(np.float64))) * u).astype(np.float32)


def sqrt_softplus(logits: np.ndarray) -> np.ndarray:
    """expert_gating_func 4: sqrt(softplus(x)) (ggml softplus: log1p(exp(x)), x for x > 20)."""
    x = logits.astype(np.float64)
    sp = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return np.sqrt(sp).astype(np.float32)


def route(probs: np.ndarray, k: int, bias: np.ndarray | None, fixed_ids: np.ndarray | None, norm: bool,
          scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids and weights [T, K] (build_moe_ffn): selection by probs + bias (or the given
    ids: hash layers), weights = probs of the selected, normalised (sum clamped at 2^-14),
    times scale (when != 0 and != 1). Ties go to the lower id."""
    if fixed_ids is not None:
        ids = fixed_ids.astype(np.int64)
    else:
        sel = probs if bias is None else probs + bias
        ids = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=1).astype(np.float32)
    if norm:
        w = (w / np.maximum(w.astype(np.float64).sum(axis=1, keepdims=True), 6.103515625e-5)).astype(np.float32)
    if scale not in (0.0, 1.0):
        w = w * F32(scale)
    return ids.astype(np.int32), w


def top_k_rows(score: np.ndarray, n_valid: np.ndarray, k: int) -> np.ndarray:
    """The indexer's selection as llama.cpp makes it: bool [R, N], per row r the ``k`` largest
    of score[r, :n_valid[r]] (all of them when n_valid[r] <= k); the rest of the row is masked
    (-inf there, never chosen). score float [R, N]; n_valid int [R].

    Ties are broken as ggml's CPU top-k breaks them (ggml-cpu ops.cpp
    ggml_compute_forward_top_k_f32: std::partial_sort of the indices 0..N-1 by score, greater
    first; libstdc++'s __heap_select: a heap of the first k indices, then each later index
    replaces the heap's least element only when its score is strictly greater), not by the
    lower index. Exact ties are common here: a block whose every head has q . k <= 0 scores
    exactly 0 (the ReLU), and with fewer than k positive scores the rest of the top-k is chosen
    among those zeros (models/deepseek4.cpp build_lid_top_k). Measured on a window-2, top-2
    file at 225 tokens: 1 position chose another zero-scored block, which moved the logits' top-5
    log-probs by 0.107 against llama.cpp's own 0.006 noise."""
    score = np.ascontiguousarray(score, dtype=np.float64)
    nv = np.ascontiguousarray(n_valid, dtype=np.int64).reshape(-1)
    if score.ndim != 2 or nv.shape[0] != score.shape[0] or k < 1:
        raise ValueError(f"top_k_rows: score {score.shape}, n_valid {nv.shape}, k {k}")
    out = np.zeros(score.shape, dtype=np.bool_)
    _heap_select_rows(score, np.minimum(nv, score.shape[1]), int(k), out)
    return out


@njit(cache=True, nogil=True)
def _adjust_heap(idx, hole, n, value, s):
    """libstdc++ std::__adjust_heap (then __push_heap) on the index heap idx[:n] ordered by
    comp(a, b) = s[a] > s[b] (the heap's top is the least score)."""
    top = hole
    child = hole
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if s[idx[child]] > s[idx[child - 1]]:
            child -= 1
        idx[hole] = idx[child]
        hole = child
    if (n & 1) == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        idx[hole] = idx[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and s[idx[parent]] > s[value]:
        idx[hole] = idx[parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[hole] = value


@njit(cache=True, nogil=True)
def _heap_select_rows(score, n_valid, k, out):
    """:func:`top_k_rows`' loop: std::__heap_select of the first n_valid[r] indices per row."""
    idx = np.empty(max(k, 1), np.int64)
    for r in range(score.shape[0]):
        n = n_valid[r]
        if n <= k:
            for j in range(n):
                out[r, j] = True
            continue
        s = score[r]
        for j in range(k):
            idx[j] = j
        if k >= 2:  # std::__make_heap
            parent = (k - 2) // 2
            while True:
                _adjust_heap(idx, parent, k, idx[parent], s)
                if parent == 0:
                    break
                parent -= 1
        for i in range(k, n):
            if s[i] > s[idx[0]]:  # std::__pop_heap(first, middle, i): i replaces the least
                _adjust_heap(idx, 0, k, i, s)
        for j in range(k):
            out[r, idx[j]] = True


def compress(kv: np.ndarray, score: np.ndarray, ratio: int, overlap: bool) -> np.ndarray:
    """Compressed rows of every complete block (build_*_compressed_kv_from_state), before the
    norm and rope. kv, score [T, c*D] (score includes ape[pos % ratio]) for positions 0..T-1
    of one sequence; c = 2 with ``overlap`` (ratio 4: first D for the next block's use as its
    previous block, last D for its own block). Returns [T // ratio, D]: per dim, softmax over
    the block's tokens (and with overlap the previous block's, none before block 0) of the
    score weighting kv."""
    T = kv.shape[0]
    nb = T // ratio
    D = kv.shape[1] // (2 if overlap else 1)
    out = np.empty((nb, D), np.float32)
    for b in range(nb):
        cur = slice(b * ratio, (b + 1) * ratio)
        if overlap:
            vals, scs = [kv[cur, D:]], [score[cur, D:]]
            if b > 0:
                prev = slice((b - 1) * ratio, b * ratio)
                vals.insert(0, kv[prev, :D])
                scs.insert(0, score[prev, :D])
            v = np.concatenate(vals).astype(np.float64)
            s = np.concatenate(scs).astype(np.float64)
        else:
            v, s = kv[cur].astype(np.float64), score[cur].astype(np.float64)
        w = np.exp(s - s.max(axis=0, keepdims=True))
        w /= w.sum(axis=0, keepdims=True)
        out[b] = (w * v).sum(axis=0)
    return out


def attend_sinks(q: np.ndarray, k: np.ndarray, mask: np.ndarray, sinks: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention with one shared K = V head and a sink logit per head: q [T, NH, D],
    k [N, D] (also the values), mask bool [T, N] (True = attend) -> [T, NH, D] float32.

    Float64 matmuls (BLAS dgemm): the result rounded to float32 does not depend on how many
    queries a step holds (float32 kernels block differently per shape, and a 1e-6 change
    can flip a later routing near-tie: batched and alone must agree). One query (decode)
    reads only its visible keys (the masked ones weigh exactly 0: 2x less work at a 4k
    depth, where the ratio-4 rows outnumber the indexer's top-k)."""
    T, NH, D = q.shape
    if T == 1:  # one query (decode): only the keys it sees (masked ones add exact zeros)
        cols = np.flatnonzero(mask[0])
        k, mask = k[cols], mask[:, cols]
    k = np.ascontiguousarray(k, dtype=np.float64)
    s = (np.asarray(q, dtype=np.float64).reshape(T * NH, D) @ k.T).reshape(T, NH, -1) * scale
    s = np.where(mask[:, None, :], s, -np.inf)
    sk = sinks.astype(np.float64)[None, :, None]
    m = np.maximum(s.max(axis=-1, keepdims=True), sk)
    e = np.exp(s - m)
    p = (e / (e.sum(axis=-1, keepdims=True) + np.exp(sk - m))).reshape(T * NH, -1)
    return (p @ k).reshape(T, NH, D).astype(np.float32)


_BLAS = None


def blas_one_thread():
    """A context in which numpy's BLAS (OpenBLAS) runs on the calling thread only
    (threadpoolctl). The float64 matmuls here are small (a decode step: 64 heads x a few
    hundred keys); OpenBLAS's own threads then cost more than they give, and they fight the
    engine's worker pool, whose workers spin on the other cores between dispatches: measured
    on 2 cores, attend_sinks at 256 keys took 6.5 ms with 2 BLAS threads and 2.4 ms with 1
    alone, 21 ms per call inside a decode step beside the pool."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")
