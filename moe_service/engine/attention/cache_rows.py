"""Rows of the KV cache in its two element formats (float16 bits, ggml Q8_0 blocks; the
package docstring gives the shapes): :func:`store` writes the step's float32 keys and values
into the cache, :func:`_load_rows` widens stored rows back to float32 (a key or value tile),
:func:`cache_format` and :func:`cache_head_dim` read a cache array's format and row width.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine import quant as _q
from moe_service.engine.attention.layout import (
    _JIT,
    _JIT_VEC,
    FMT_F16,
    FMT_Q8_0,
    Q8_0_BLOCK,
    Q8_0_BYTES,
    _view_u16,
)
from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits


@njit(**_JIT)
def _store_span(k, kc, seq, n0, a, e):
    """kc[seq, n0 + t - a] = float16(k[t]) for t in a..e-1 (k float32 [T, NKV, D'])."""
    for t in range(a, e):
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                kc[seq, n0 + t - a, h, i] = _f32_to_f16_bits(k[t, h, i])


@njit(**_JIT)
def quantize_row_q8_0(x, dst, off):
    """ggml's quantize_row_q8_0_ref: per block of 32, amax = max|x|, d = amax / 127,
    q = roundf(x / d) (as x * (1/d)), stored as float16(d) then 32 int8 at dst[off...].
    x: float32 [n] (n a multiple of 32); dst: uint8 [*]."""
    nb = x.shape[0] // Q8_0_BLOCK
    for b in range(nb):
        amax = np.float32(0.0)
        for i in range(Q8_0_BLOCK):
            v = abs(x[b * Q8_0_BLOCK + i])
            if v > amax:
                amax = v
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        hb = _f32_to_f16_bits(d)
        o = off + b * Q8_0_BYTES
        dst[o] = np.uint8(hb & 0xFF)
        dst[o + 1] = np.uint8(hb >> 8)
        for i in range(Q8_0_BLOCK):
            v = x[b * Q8_0_BLOCK + i] * inv
            r = np.float32(np.floor(abs(v) + np.float32(0.5)))  # roundf: half away from zero
            qv = np.int64(r) if v >= 0 else -np.int64(r)
            dst[o + 2 + i] = np.uint8(qv & 0xFF)


@njit(**_JIT)
def _store_span_q8_0(k, kc, seq, n0, a, e):
    """Q8_0 rows: kc uint8 [S, C, NKV, D/32*34] <- k float32 [T, NKV, D]."""
    flat = kc.reshape(-1)
    nkv, rb = kc.shape[2], kc.shape[3]
    row = np.empty(k.shape[2], np.float32)
    for t in range(a, e):
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                row[i] = k[t, h, i]
            base = ((seq * kc.shape[1] + n0 + t - a) * nkv + h) * rb
            quantize_row_q8_0(row, flat, base)


def cache_format(c: np.ndarray) -> int:
    """FMT_F16 for a uint16 cache, FMT_Q8_0 for a uint8 one; ValueError otherwise."""
    if c.dtype == np.uint16:
        return FMT_F16
    if c.dtype == np.uint8:
        return FMT_Q8_0
    raise ValueError(f"attention: cache dtype {c.dtype} is neither float16 bits (uint16) nor q8_0 bytes (uint8)")


def cache_head_dim(c: np.ndarray) -> int:
    """Values per head row of a cache of either format."""
    return c.shape[3] if c.dtype == np.uint16 else c.shape[3] // Q8_0_BYTES * Q8_0_BLOCK


def store(kc: np.ndarray, vc: np.ndarray, k: np.ndarray, v: np.ndarray | None, spans) -> None:
    """Append the step's new keys and values to the layer's caches (in their format).

    k: float32 [T, NKV, D]; v: float32 [T, NKV, Dv], or None when ``vc is kc`` (latent
    cache: the value is the key's first Dv dims). Raises ValueError when v is missing for a
    separate value cache, or a span would write past the cache.
    """
    if v is None and vc is not kc:
        raise ValueError("attention.store: v is None but the value cache is separate from the key cache")
    k = np.ascontiguousarray(k, dtype=np.float32)
    vv = None if vc is kc else np.ascontiguousarray(v, dtype=np.float32)
    for seq, a, e, n0 in spans:
        if n0 + (e - a) > kc.shape[1] or not 0 <= seq < kc.shape[0]:
            raise ValueError(f"attention.store: sequence {seq} rows {n0}..{n0 + e - a} outside the cache {kc.shape}")
        for src, c in ((k, kc),) if vv is None else ((k, kc), (vv, vc)):
            if c.dtype == np.uint16:
                _store_span(src, c, seq, n0, a, e)
            else:
                _store_span_q8_0(src, c, seq, n0, a, e)


@njit(**_JIT_VEC)
def _load_rows(addr, fmt, base, stride, n_rows, n_dim, dst):
    """dst[r * n_dim + i] = float32 of element i of the cache row at ``base + r * stride``
    (r < n_rows). f16: elements are uint16; q8_0: elements are bytes, a row is n_dim/32
    blocks. dst: float32 [>= n_rows * n_dim] (flat)."""
    if fmt == FMT_F16:
        src = _view_u16(addr, 1)
        for r in range(n_rows):
            o = base + r * stride
            od = r * n_dim
            for i in range(n_dim):
                _q.st(dst, od + i, _f16_bits_to_f32(_q.ld(src, o + i)))
    else:
        src8 = _q.view_u8(addr, 1)
        srci = _q.view_i8(addr, 1)
        for r in range(n_rows):
            o = base + r * stride
            for b in range(n_dim // Q8_0_BLOCK):
                ob = o + b * Q8_0_BYTES
                d = _f16_bits_to_f32(np.uint16(_q.ld(src8, ob)) | (np.uint16(_q.ld(src8, ob + 1)) << np.uint16(8)))
                od = r * n_dim + b * Q8_0_BLOCK
                for i in range(Q8_0_BLOCK):
                    _q.st(dst, od + i, d * np.float32(_q.ld(srci, ob + 2 + i)))
