"""The scores: s_j = (q . k_j) * scale for a task's query rows over a range of keys, each
row's running maximum raised as they are written. :func:`_score_keys` is the one-row kernel
(:func:`_dot`: 64 lanes for a one-token step, 16 for a prefill); the others give its scores
bit for bit with each key read once for several rows: :func:`_score_keys4` (a prefill token's
two to four heads), :func:`_score_heads_wide16` (a decode's group heads), :func:`_score_latent`
(a latent cache, D = 576, each key widened once), :func:`_score_keys_wide16` (eight keys per
call for one row).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine import quant as _q
from moe_service.engine.attention.cache_rows import _load_rows
from moe_service.engine.attention.intrinsics import (
    _dot16,
    _dot16_heads_keys,
    _dot16_rows,
    _dot64,
    _dot64_heads_keys8,
    _dot64_keys8,
    _dot64_tile_keys8,
    _ld_f32,
)
from moe_service.engine.attention.layout import _JIT_INLINE, _KEYS_PER_PASS, FMT_F16


@njit(**_JIT_INLINE)
def _scale_max(s, a, b, scale, mx):
    """s[j] = s[j] * scale for j in a..b-1 (raw dot products to scores); returns the largest
    of mx and those scores."""
    for j in range(a, b):
        v = _q.ld(s, j) * scale
        _q.st(s, j, v)
        mx = max(mx, v)
    return mx


@njit(**_JIT_INLINE)
def _finish_rows(qb, qo, nrows, d, kb, k0, kstride, s, so, L, ja, jdone, jb, scale, mrow, r0):
    """After a several-rows kernel left the raw dot products of keys ja..jdone-1 for rows
    r < nrows (query qb[qo + r * d], scores s[so + r * L + j]): scale them, score keys
    jdone..jb-1 one by one (:func:`_score_keys`, 64 lanes), raise mrow[r0 + r] to each row's
    maximum."""
    for r in range(nrows):
        o = so + r * L
        mx = _scale_max(s, o + ja, o + jdone, scale, mrow[r0 + r])
        if jdone < jb:
            mx = max(mx, _score_keys(qb, qo + r * d, kb, k0, kstride, s, o, jdone, jb, d, scale, True))
        mrow[r0 + r] = mx


@njit(**_JIT_INLINE)
def _score_heads_wide16(qb, qo, gh, kb, k0, kstride, s, so, L, ja, jb, d, scale, mrow, r0):
    """:func:`_score_keys_wide16` for the ``gh`` query rows qb[qo + r * d] (r < gh) of one KV
    head, whose scores go to s[so + r * L + j]: the same scores, each key read and widened once
    for up to four rows; mrow[r0 + r] raised to each row's maximum. D = 64 or 128."""
    nb = d // 64
    hb = 4 if nb == 1 else 2  # rows per key read: measured best (D = 64: 3.7 ns per (row, key); 128: 6.0)
    h0 = 0
    while h0 < gh:
        hn = min(hb, gh - h0)
        qh = qo + h0 * d
        sh = so + h0 * L
        j = ja
        while j + 8 <= jb:
            ko = k0 + j * kstride
            if nb == 1:
                if hn == 4:
                    _dot64_heads_keys8(qb, qh, d, 4, kb, ko, kstride, 1, s, sh + j, L)
                elif hn == 3:
                    _dot64_heads_keys8(qb, qh, d, 3, kb, ko, kstride, 1, s, sh + j, L)
                elif hn == 2:
                    _dot64_heads_keys8(qb, qh, d, 2, kb, ko, kstride, 1, s, sh + j, L)
                else:
                    _dot64_heads_keys8(qb, qh, d, 1, kb, ko, kstride, 1, s, sh + j, L)
            else:
                if hn == 4:
                    _dot64_heads_keys8(qb, qh, d, 4, kb, ko, kstride, 2, s, sh + j, L)
                elif hn == 3:
                    _dot64_heads_keys8(qb, qh, d, 3, kb, ko, kstride, 2, s, sh + j, L)
                elif hn == 2:
                    _dot64_heads_keys8(qb, qh, d, 2, kb, ko, kstride, 2, s, sh + j, L)
                else:
                    _dot64_heads_keys8(qb, qh, d, 1, kb, ko, kstride, 2, s, sh + j, L)
            j += 8
        _finish_rows(qb, qh, hn, d, kb, k0, kstride, s, sh, L, ja, j, jb, scale, mrow, r0 + h0)
        h0 += hn


@njit(**_JIT_INLINE)
def _score_latent(qb, qo, gh, kb, k0, kstride, s, so, L, ja, jb, d, scale, mrow, r0, tile):
    """:func:`_score_keys_wide16` for the ``gh`` query rows qb[qo + r * d] of a latent (MLA)
    cache, D = 576 (kv_lora_rank 512 + 64 rope dims): the same scores. Every key is widened
    to float32 once (eight at a time into ``tile``, float32 [>= 8 * D]) for all the rows, instead of
    once per row (one vcvtph2ps per eight dims per row was the bound); then eight keys per
    :func:`_dot64_tile_keys8`. mrow[r0 + r] raised to each row's maximum."""
    n = jb - ja
    n8 = n - n % 8
    for j in range(0, n8, 8):  # eight keys at a time: their float32 tile (18 KiB) stays in L1d for every row
        _load_rows(kb.ctypes.data, FMT_F16, k0 + (ja + j) * kstride, kstride, 8, d, tile)
        for r in range(gh):
            _dot64_tile_keys8(qb, qo + r * d, tile, 0, d, 9, s, so + r * L + ja + j)
    _finish_rows(qb, qo, gh, d, kb, k0, kstride, s, so, L, ja, ja + n8, jb, scale, mrow, r0)


@njit(**_JIT_INLINE)
def _score_keys_wide16(qb, qo, kb, k0, kstride, s, so, ja, jb, d, scale):
    """:func:`_score_keys` of a one-token step over a float16 cache read in place, D a
    multiple of 64: eight keys per :func:`_dot64_keys8` (the same scores; a zero may change
    sign), the rest one by one."""
    mx = np.float32(-np.inf)
    j = ja
    while j + 8 <= jb:
        if d == 64:  # one block (a literal: no block loop)
            _dot64_keys8(qb, qo, kb, k0 + j * kstride, kstride, 1, s, so + j)
        else:
            _dot64_keys8(qb, qo, kb, k0 + j * kstride, kstride, d // 64, s, so + j)
        mx = _scale_max(s, so + j, so + j + 8, scale, mx)
        j += 8
    if j < jb:
        mx = max(mx, _score_keys(qb, qo, kb, k0, kstride, s, so, j, jb, d, scale, True))
    return mx


@njit(**_JIT_INLINE)
def _dot(qb, qo, kb, ko, d, wide):
    """The score dot product q . k of one query row and one key (package docstring: ggml's
    order). wide (a one-token step, as llama.cpp's decode): ggml_vec_dot_f16, 64 lanes over
    the first d - d % 64 dims, the rest added in float64 in order, rounded to float32 once;
    otherwise (prefill, as llama.cpp's tinyBLAS for n_tokens >= 2; d a multiple of 16): 16
    lanes."""
    if wide:
        n = d - d % 64
        acc = np.float64(_dot64(qb, qo, kb, ko, n // 64))
        for i in range(n, d):
            acc += np.float64(_q.ld(qb, qo + i) * _ld_f32(kb, ko + i))
        return np.float32(acc)
    return _dot16(qb, qo, kb, ko, d // 16)


@njit(**_JIT_INLINE)
def _score_keys(qb, qo, kb, k0, kstride, s, so, ja, jb, d, scale, wide):
    """s[so + j] = (q . key j) * scale for keys ja..jb-1, key j at kb[k0 + j * kstride] (the
    float16 cache read in place, or a float32 tile); returns the largest."""
    mx = np.float32(-np.inf)
    for j in range(ja, jb):
        v = _dot(qb, qo, kb, k0 + j * kstride, d, wide) * scale
        _q.st(s, so + j, v)
        mx = max(mx, v)
    return mx


@njit(**_JIT_INLINE)
def _score_keys4(qb, qo, d, kb, k0, kstride, s, so, L, ja, jb, scale, mrow, r0, nr):
    """:func:`_score_keys` (16 lanes, D a multiple of 16) for the ``nr`` (2 to 4) query rows at
    qb[qo], qb[qo + d], ... whose scores go to s[so + j], s[so + L + j], ...: each key read
    once for the rows (D = 64, 128 or 576, a latent MLA cache: 16 keys per
    :func:`_dot16_heads_keys` call, the rest one by one, :func:`_dot16_rows`); mrow[r0 .. r0 +
    nr - 1] raised to the rows' maxima. (D = 576, one thread, V3 shapes, 128 new tokens at
    depth 1024 with Dv = 16: 19.8 -> 19.3 ns per (row, key) for scores and softmax, a shared host.)"""
    j16 = ja
    if d == 128 or d == 64:
        while j16 + 16 <= jb:  # (16 keys per call: 5% faster than 8 at D = 128; 32 slower)
            ko = k0 + j16 * kstride
            if d == 128:
                if nr == 4:
                    _dot16_heads_keys(qb, qo, d, 4, kb, ko, kstride, 8, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                elif nr == 3:
                    _dot16_heads_keys(qb, qo, d, 3, kb, ko, kstride, 8, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                else:
                    _dot16_heads_keys(qb, qo, d, 2, kb, ko, kstride, 8, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            else:
                if nr == 4:
                    _dot16_heads_keys(qb, qo, d, 4, kb, ko, kstride, 4, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                elif nr == 3:
                    _dot16_heads_keys(qb, qo, d, 3, kb, ko, kstride, 4, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                else:
                    _dot16_heads_keys(qb, qo, d, 2, kb, ko, kstride, 4, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            j16 += 16
    elif d == 576:
        while j16 + 16 <= jb:
            ko = k0 + j16 * kstride
            if nr == 6:
                _dot16_heads_keys(qb, qo, d, 6, kb, ko, kstride, 36, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            elif nr == 5:
                _dot16_heads_keys(qb, qo, d, 5, kb, ko, kstride, 36, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            elif nr == 4:
                _dot16_heads_keys(qb, qo, d, 4, kb, ko, kstride, 36, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            elif nr == 3:
                _dot16_heads_keys(qb, qo, d, 3, kb, ko, kstride, 36, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            else:
                _dot16_heads_keys(qb, qo, d, 2, kb, ko, kstride, 36, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            j16 += 16
    for j in range(j16, jb):
        if nr > 4:  # (D = 576: five or six rows, as four then the rest)
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 4)
            if nr == 6:
                _dot16_rows(qb, qo + 4 * d, d, kb, k0 + j * kstride, d // 16, s, so + 4 * L + j, L, 2)
            else:
                _dot16_rows(qb, qo + 4 * d, d, kb, k0 + j * kstride, d // 16, s, so + 4 * L + j, L, 1)
        elif nr == 4:
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 4)
        elif nr == 3:
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 3)
        else:
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 2)
    for r in range(nr):  # (the eight-key kernel scaled its keys and raised mrow itself)
        mrow[r0 + r] = _scale_max(s, so + r * L + j16, so + r * L + jb, scale, mrow[r0 + r])
