"""The mask and the softmax: which keys a query row sees (:func:`_row_keys`: causal and the
sliding window), the exponentials and their float64 sum (:func:`_exp_shifted`), the default
mode's float16 probabilities (:func:`_normalise_f16`, per row with the sinks:
:func:`_softmax_rows`), and the online mode's final division (:func:`_finish_row`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine import quant as _q
from moe_service.engine.attention.layout import (
    _JIT_INLINE,
    _JIT_VEC,
    O_GROUP,
    O_HAS_SINKS,
    O_NH,
    O_SINKS,
    O_WINDOW,
)
from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits


@njit(**_JIT_INLINE)
def _row_keys(p, window, j0, j1):
    """Keys j0 <= j < j1 that a query at position p sees: (jlo, jhi) (causal, window)."""
    jlo = j0
    if window > 0 and p - window + 1 > jlo:
        jlo = p - window + 1
    return jlo, min(j1, p + 1)


_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


@njit(**_JIT_VEC)
def _exp_shifted(s, ja, jb, mx):
    """s[j] = exp(s[j] - mx) for j in ja..jb-1 (every s[j] <= mx), returns their sum in float64:
    four partial sums (s[ja + k] into sum k % 4; one float64 chain of additions costs a
    nanosecond per key), added (s0 + s1) + (s2 + s3), then the last jb - ja mod 4 in order.

    Cephes' expf (range reduction by ln2 in two parts, degree-5 polynomial, 2^n from the
    exponent bits; ~1 ulp), written as a plain loop so it runs in vector lanes (libm's expf
    is one call per element). Arguments below -87.3 give exp(-87.3) ~ 1e-38 instead of 0."""
    total = 0.0
    for j in range(ja, jb):
        x = max(_q.ld(s, j) - mx, np.float32(-87.3))
        n = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - n * _LN2_HI - n * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * r * r + r + np.float32(1.0)
        _q.st(s, j, p * _q.bits_f32((np.int32(n) + np.int32(127)) << np.int32(23)))
    t1 = 0.0
    t2 = 0.0
    t3 = 0.0
    j = ja
    while j + 4 <= jb:  # four float64 partial sums (key j into sum j % 4), apart from the loop above
        total += np.float64(_q.ld(s, j))
        t1 += np.float64(_q.ld(s, j + 1))
        t2 += np.float64(_q.ld(s, j + 2))
        t3 += np.float64(_q.ld(s, j + 3))
        j += 4
    total = (total + t1) + (t2 + t3)
    while j < jb:
        total += np.float64(_q.ld(s, j))
        j += 1
    return total


@njit(**_JIT_VEC)
def _normalise_f16(sc, a, b, inv):
    """sc[j] = float16(sc[j] * inv) (as float32) for j in a..b-1."""
    for j in range(a, b):
        _q.st(sc, j, _f16_bits_to_f32(_f32_to_f16_bits(_q.ld(sc, j) * inv)))


@njit(**_JIT_VEC)
def _softmax_rows(op, sc, so, L, j_start, p0, nq, gh, g, h_lo, mrow):
    """Per row r (token tt, head h_lo + hh of group g): the maximum (mrow[r], or the sink when
    larger), exp(score - max) summed in float64 (:func:`_exp_shifted`; plus the sink's term), and the
    probabilities float16(e * float32(1/sum)) in place over the row's keys."""
    nh, group, window = op[O_NH], op[O_GROUP], op[O_WINDOW]
    sinks = _q.view_f32(op[O_SINKS], nh)
    has_sinks = op[O_HAS_SINKS] != 0
    for tt in range(nq):
        p = p0 + tt
        lo, hi = _row_keys(p, window, j_start, p + 1)
        for hh in range(gh):
            r = tt * gh + hh
            mx = mrow[r]
            h = g * group + h_lo + hh
            if has_sinks and sinks[h] > mx:
                mx = sinks[h]
            a = so + r * L + lo - j_start
            b = so + r * L + hi - j_start
            total = _exp_shifted(sc, a, b, mx)
            if has_sinks:
                total += np.float64(np.exp(sinks[h] - mx))
            _normalise_f16(sc, a, b, np.float32(1.0 / total))


@njit(**_JIT_VEC)
def _finish_row(out, o, acc, ao, m, lsum, dv, has_sink, sink):
    """out[o:o+dv] = acc[r] / l, the sink logit joining the maximum and the sum first."""
    f = np.float32(1.0)
    if has_sink:
        mx = max(m, sink)
        f = np.exp(m - mx) if m > -np.inf else np.float32(0.0)
        lsum = lsum * np.float64(f) + np.float64(np.exp(sink - mx))
    inv = np.float32(1.0 / lsum) * f if lsum > 0 else np.float32(0.0)
    for i in range(dv):
        _q.st(out, o + i, _q.ld(acc, ao + i) * inv)
