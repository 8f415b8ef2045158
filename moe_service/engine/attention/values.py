"""P.V: the probabilities times the value rows, accumulated into float32 rows in key order.
:func:`_pv_exact` is the one-row kernel (the default mode); :func:`_pv_heads_f16` gives its
sums bit for bit with each value row read once for up to four rows of a KV head's group;
:func:`_pv` and :func:`_scale_row` serve the online mode (a widened tile, rescaled as the
running maximum rises).
"""

from __future__ import annotations

from numba import njit

from moe_service.engine import quant as _q
from moe_service.engine.attention.intrinsics import _ld_f32, _pv_heads16
from moe_service.engine.attention.layout import _JIT_INLINE, _JIT_VEC


@njit(**_JIT_INLINE)
def _pv_heads_f16(acc, ao, gh, p, po, L, vb, vo, vstride, ja, jb, dv, six=False):
    """:func:`_pv_exact` for the ``gh`` rows of one KV head (acc rows ao + r * dv, probabilities
    at p[po + r * L + j]) over a float16 cache read in place (uint16) or a widened float32
    tile, Dv a multiple of 16: the same sums, each value row loaded once per four rows (``six``:
    per six rows while six remain, 16 dims of each in registers: 12 accumulators on AVX2; a
    prefill's widened tile. Latent V3 shapes, 128 heads, Dv 512, one thread: P.V ~15 -> ~14 ns
    per (row, key), a shared host)."""
    h0 = 0
    while h0 < gh:
        hn = min(4, gh - h0)
        a, q = ao + h0 * dv, po + h0 * L
        if six and gh - h0 >= 6:
            _pv_heads16(acc, a, dv, 6, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
            hn = 6
        elif hn == 4:
            _pv_heads16(acc, a, dv, 4, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
        elif hn == 3:
            _pv_heads16(acc, a, dv, 3, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
        elif hn == 2:
            if dv % 32 == 0:
                _pv_heads16(acc, a, dv, 2, p, q, L, vb, vo, vstride, ja, jb, dv, 4)
            else:
                _pv_heads16(acc, a, dv, 2, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
        else:  # one row: the row-at-a-time kernel is as fast
            _pv_exact(acc, a, p, q, vb, vo, vstride, ja, jb, dv)
        h0 += hn


@njit(**_JIT_VEC)
def _pv(acc, ao, s, vt, ja, jb, dv):
    """acc[ao:ao+dv] += sum_j s[j] * vt[j*dv:(j+1)*dv] for j in ja..jb-1 (four keys per pass
    over the accumulator)."""
    j = ja
    while j + 4 <= jb:
        p0 = _q.ld(s, j)
        p1 = _q.ld(s, j + 1)
        p2 = _q.ld(s, j + 2)
        p3 = _q.ld(s, j + 3)
        v0 = j * dv
        for i in range(dv):
            _q.st(acc, ao + i, _q.ld(acc, ao + i) + (p0 * _q.ld(vt, v0 + i) + p1 * _q.ld(vt, v0 + dv + i)
                                                     + p2 * _q.ld(vt, v0 + 2 * dv + i)
                                                     + p3 * _q.ld(vt, v0 + 3 * dv + i)))
        j += 4
    while j < jb:
        pj = _q.ld(s, j)
        vo = j * dv
        for i in range(dv):
            _q.st(acc, ao + i, _q.ld(acc, ao + i) + pj * _q.ld(vt, vo + i))
        j += 1


@njit(**_JIT_VEC)
def _scale_row(acc, ao, f, n):
    for i in range(n):
        _q.st(acc, ao + i, _q.ld(acc, ao + i) * f)


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def _pv_exact(acc, ao, p, po, vb, vo, vstride, ja, jb, dv):
    """acc[ao:ao+dv] += p[po + j] * v_j for j in ja..jb-1 in key order, v_j the Dv values at
    vb[vo + j * vstride] (a float16 cache read in place as uint16, or a float32 tile), in
    vector lanes over the value dims. Fused multiply-adds allowed: p and a float16 cache's v
    are float16 values, whose product is exact in float32, so the rounding is the scalar
    reference's (measured: P.V 10.6 -> 4.3 ns per (row, key) at Dv = 128)."""
    j = ja
    while j + 4 <= jb:  # four keys per pass over the accumulator, the additions still in key order
        p0 = _q.ld(p, po + j)
        p1 = _q.ld(p, po + j + 1)
        p2 = _q.ld(p, po + j + 2)
        p3 = _q.ld(p, po + j + 3)
        v0 = vo + j * vstride
        for i in range(dv):
            a = _q.ld(acc, ao + i) + p0 * _ld_f32(vb, v0 + i)
            a = a + p1 * _ld_f32(vb, v0 + vstride + i)
            a = a + p2 * _ld_f32(vb, v0 + 2 * vstride + i)
            _q.st(acc, ao + i, a + p3 * _ld_f32(vb, v0 + 3 * vstride + i))
        j += 4
    while j < jb:
        pj = _q.ld(p, po + j)
        v0 = vo + j * vstride
        for i in range(dv):
            _q.st(acc, ao + i, _q.ld(acc, ao + i) + pj * _ld_f32(vb, v0 + i))
        j += 1
