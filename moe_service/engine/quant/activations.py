"""Activation quantizers: an activation row in its weight format's partner format (ggml's
``vec_dot_type``), as llama.cpp computes it on x86 (quantize_row_q8_0 / q8_1 / q8_K, and the
float16 / bfloat16 roundings), plus the Python-facing encodings (PartnerArrays, Activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from moe_service.engine.quant.ir import (
    _F32,
    _I8,
    _I16,
    _I32,
    _JIT,
    _JIT_INLINE,
    _call,
    _cvec,
    _elem_ptr,
    _shuf,
    _splat_f32,
    _vt,
    bits_f32,
    f16_round,
    f32_bits,
    ld,
    st,
)
from moe_service.formats import PARTNER_BLOCK, QK, QK_K, Partner


@njit(**_JIT_INLINE)
def _bf16_round(x):
    """float32 -> bfloat16 -> float32, as ggml_compute_fp32_to_bf16 (nearest even, NaN quieted)."""
    u = np.int64(f32_bits(x))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        h = (u >> 16) | 64
    else:
        h = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return bits_f32((h & 0xFFFF) << 16)


# ---------------------------------------------------------------------------------------
# Activation quantization (ggml-quants.c reference rows), one row at x[xo : xo + n]
# ---------------------------------------------------------------------------------------


def _load_abs(context, builder, signature, args, count):
    """(x[base : base + count], its magnitudes) as <count x float> for an intrinsic whose first
    two arguments are (x, base)."""
    vty = _vt(_F32, count)
    p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
    v = builder.load(builder.bitcast(p, vty.as_pointer()))
    v.align = 4
    return v, _call(builder, f"llvm.fabs.v{count}f32", vty, [v])


@intrinsic
def _absmax(typingctx, x, base, n):
    """max |x[base : base + n]| (n a literal 32 or 256) as numba's running ``max(amax, abs(v))``
    from 0.0 computes it (NaN elements ignored: maxnum), as one vector reduction: the running
    scalar max is a loop-carried chain the vectorizer cannot break without fast-math."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    sig = types.float32(x, base, n)
    count = n.literal_value

    def codegen(context, builder, signature, args):
        _, a = _load_abs(context, builder, signature, args, count)
        m = _call(builder, f"llvm.vector.reduce.fmax.v{count}f32", _F32, [a])
        return _call(builder, "llvm.maxnum.f32", _F32, [m, ir.Constant(_F32, 0.0)])

    return sig, codegen


@intrinsic
def _first_absmax(typingctx, x, base, amax):
    """The first of x[base : base + 256] whose magnitude equals ``amax`` (> 0, one of them):
    the element quantize_row_q8_k's strict ``abs(v) > amax`` scan keeps, found with one
    vector compare and a count of trailing zeros."""
    sig = types.float32(x, base, types.float32)

    def codegen(context, builder, signature, args):
        v, a = _load_abs(context, builder, signature, args, QK_K)
        hit = builder.fcmp_ordered("==", a, _splat_f32(builder, args[2], QK_K))
        bits = builder.bitcast(hit, ir.IntType(QK_K))
        tz = _call(builder, f"llvm.cttz.i{QK_K}", ir.IntType(QK_K), [bits, ir.Constant(ir.IntType(1), 0)])
        return builder.extract_element(v, builder.trunc(tz, _I32))

    return sig, codegen


@intrinsic
def _quant_block(typingctx, x, base, scale, qs, qo, n, clamp):
    """qs[qo + j] = int8(q_j), q_j = rint(x[base + j] * scale) (round half to even; clamped to
    <= 127 when the literal ``clamp`` is 1) for j < n (literal 32 or 256), as one vector
    pass; returns sum(q_j) as int32 (exact). Element for element what the scalar
    ``np.int8(rintf(x * scale))`` loop stores."""
    if not (isinstance(n, types.IntegerLiteral) and isinstance(clamp, types.IntegerLiteral)):
        return None
    sig = types.int32(x, base, types.float32, qs, qo, n, clamp)
    count, do_clamp = n.literal_value, clamp.literal_value

    def codegen(context, builder, signature, args):
        vf = _vt(_F32, count)
        vi = _vt(_I32, count)
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = builder.load(builder.bitcast(p, vf.as_pointer()))
        v.align = 4
        r = _call(builder, f"llvm.rint.v{count}f32", vf, [builder.fmul(v, _splat_f32(builder, args[2], count))])
        q = builder.fptosi(r, vi)
        if do_clamp:
            q = _call(builder, f"llvm.smin.v{count}i32", vi, [q, _cvec(_I32, [127] * count)])
        out = _elem_ptr(context, builder, signature.args[3], args[3], args[4], signature.args[4])
        st_ = builder.store(builder.trunc(q, _vt(_I8, count)), builder.bitcast(out, _vt(_I8, count).as_pointer()))
        st_.align = 1
        return _call(builder, f"llvm.vector.reduce.add.v{count}i32", _I32, [q])

    return sig, codegen


@intrinsic
def _sums16(typingctx, qs, qo, bsums, bo):
    """bsums[bo + j] = int16(sum of qs[qo + 16j : qo + 16j + 16]) for j < 16 (Q8_K's sums)."""
    sig = types.void(qs, qo, bsums, bo)

    def codegen(context, builder, signature, args):
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = builder.load(builder.bitcast(p, _vt(_I8, QK_K).as_pointer()))
        v.align = 1
        w = builder.sext(v, _vt(_I32, QK_K))
        sums = ir.Constant(_vt(_I16, 16), None)
        for j in range(16):
            g = _shuf(builder, w, range(16 * j, 16 * j + 16))
            t = _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [g])
            sums = builder.insert_element(sums, builder.trunc(t, _I16), ir.Constant(_I32, j))
        out = _elem_ptr(context, builder, signature.args[2], args[2], args[3], signature.args[3])
        st_ = builder.store(sums, builder.bitcast(out, _vt(_I16, 16).as_pointer()))
        st_.align = 2
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT_INLINE)
def _q8_32(x, base, qs, qo, d_out, di):
    """One 32-element block of the x86 Q8_0 rule (see quantize_row_q8_0): writes qs[qo:qo+32]
    and d_out[di] = f16(d); returns (d unrounded, sum(q) as int32)."""
    amax = _absmax(x, base, 32)
    d = amax / np.float32(127.0)
    idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    st(d_out, di, f16_round(d))
    return d, _quant_block(x, base, idd, qs, qo, 32, 0)


@njit(**_JIT)
def quantize_row_q8_0(x, xo, n, qs, qo, d_out, do_):
    """As ggml-cpu's x86 quantize_row_q8_0 (the AVX2/AVX-512 path llama.cpp runs on these
    hosts): per 32: d = amax/127 stored as f16, id = 127/amax, q = round-half-to-even(x*id)
    (_mm256_round_ps with _MM_ROUND_NEAREST). The portable quantize_row_q8_0_ref differs (id =
    1/d and roundf, half away from zero): a few elements per block land one step apart, which
    moved logits by ~0.5% against llama.cpp.

    x: float32 (row at element ``xo``, ``n`` a multiple of 32); writes qs[qo:qo+n] int8 and
    d_out[do_ : do_ + n/32] float32 (the f16-rounded d the dot products use).
    """
    for b in range(n // QK):
        _q8_32(x, xo + b * QK, qs, qo + b * QK, d_out, do_ + b)


@njit(**_JIT)
def quantize_row_q8_1(x, xo, n, qs, qo, d_out, s_out, do_):
    """As ggml-cpu's x86 quantize_row_q8_1: the Q8_0 rule above (id = 127/amax, half to even)
    plus s = f16(d * sum(q)) per 32-element block."""
    for b in range(n // QK):
        d, total = _q8_32(x, xo + b * QK, qs, qo + b * QK, d_out, do_ + b)
        st(s_out, do_ + b, f16_round(np.float32(total) * d))


@njit(**_JIT)
def quantize_row_q8_k(x, xo, n, qs, qo, d_out, do_, bsums, bo):
    """As ggml's quantize_row_q8_K_ref: per 256: iscale = -127/max (max = the first element of
    largest magnitude), q = min(127, nearest_int(iscale*x)), d = 1/iscale (f32), int16 sums of
    each 16 q into bsums[bo + 16*b : ...]. An all-zero block gets d = 0, q = 0, sums 0.
    """
    for b in range(n // QK_K):
        base = xo + b * QK_K
        amax = _absmax(x, base, 256)
        if amax == 0:
            st(d_out, do_ + b, np.float32(0.0))
            for j in range(QK_K):
                st(qs, qo + b * QK_K + j, np.int8(0))
            for j in range(QK_K // 16):
                st(bsums, bo + b * 16 + j, np.int16(0))
            continue
        iscale = np.float32(-127.0) / _first_absmax(x, base, amax)
        _quant_block(x, base, iscale, qs, qo + b * QK_K, 256, 1)
        _sums16(qs, qo + b * QK_K, bsums, bo + b * 16)
        st(d_out, do_ + b, np.float32(1.0) / iscale)


@njit(**_JIT)
def quantize_partner_row(partner, x, xo, n, xf, xq, xd, xs, xbs, row):
    """Encode activation row x[xo:xo+n] in ``partner`` format into row ``row`` of the partner
    arrays (xf float32 [*, n], xq int8 [*, n], xd/xs float32 [*, n/32|256], xbs int16 [*, n/16]).
    """
    if partner == Partner.F32:
        for j in range(n):
            st(xf, row * n + j, ld(x, xo + j))
    elif partner == Partner.F16:
        for j in range(n):
            st(xf, row * n + j, f16_round(ld(x, xo + j)))
    elif partner == Partner.BF16:
        for j in range(n):
            st(xf, row * n + j, _bf16_round(ld(x, xo + j)))
    elif partner == Partner.Q8_0:
        quantize_row_q8_0(x, xo, n, xq, row * n, xd, row * (n // QK))
    elif partner == Partner.Q8_1:
        quantize_row_q8_1(x, xo, n, xq, row * n, xd, xs, row * (n // QK))
    else:
        quantize_row_q8_k(x, xo, n, xq, row * n, xd, row * (n // QK_K), xbs, row * (n // 16))


@njit(**_JIT)
def quantize_partner_rows(partner, x, n_rows, n, xf, xq, xd, xs, xbs):
    """quantize_partner_row for rows 0..n_rows-1 of x float32 [n_rows * n]."""
    for r in range(n_rows):
        quantize_partner_row(partner, x, r * n, n, xf, xq, xd, xs, xbs, r)


@njit(**_JIT)
def quantize_partner_rows_range(partner, x, row_lo, row_hi, n, xf, xq, xd, xs, xbs):
    """quantize_partner_row for rows row_lo..row_hi-1 of x float32 [*, n] (worker share)."""
    for r in range(row_lo, row_hi):
        quantize_partner_row(partner, x, r * n, n, xf, xq, xd, xs, xbs, r)


@dataclass(frozen=True)
class PartnerArrays:
    """Activations [T, C] encoded in one partner format, as flat C-contiguous arrays.

    xf float32 [T*C] (F32/F16/BF16 partners), xq int8 [T*C] (Q8 partners), xd float32 [T*C/32]
    or [T*C/256] (block scales d), xs float32 [T*C/32] (Q8_1 s), xbs int16 [T*C/16] (Q8_K
    sums). Arrays a partner does not use hold one element.
    """

    partner: Partner
    n_tok: int
    n_cols: int
    xf: np.ndarray
    xq: np.ndarray
    xd: np.ndarray
    xs: np.ndarray
    xbs: np.ndarray


def _alloc_partner(partner: Partner, n_tok: int, n_cols: int) -> PartnerArrays:
    blk = PARTNER_BLOCK[partner]
    if n_cols % max(blk, 16 if partner == Partner.Q8_K else 1):
        raise ValueError(f"activation rows of {n_cols} columns are not whole {partner.name} blocks of {blk}")
    one_f = np.zeros(1, np.float32)
    is_float = blk == 1
    return PartnerArrays(
        partner, n_tok, n_cols,
        xf=np.empty(n_tok * n_cols, np.float32) if is_float else one_f,
        xq=np.empty(n_tok * n_cols, np.int8) if not is_float else np.zeros(1, np.int8),
        xd=np.empty(n_tok * (n_cols // blk), np.float32) if not is_float else one_f,
        xs=np.empty(n_tok * (n_cols // blk), np.float32) if partner == Partner.Q8_1 else one_f,
        xbs=np.empty(n_tok * (n_cols // 16), np.int16) if partner == Partner.Q8_K else np.zeros(1, np.int16),
    )


def quantize_activations(x: np.ndarray, partner: Partner) -> PartnerArrays:
    """Encode activations x float32 [T, C] (or [C]) in ``partner`` format, one pass per row."""
    x2 = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    n_tok, n_cols = x2.shape
    pa = _alloc_partner(Partner(partner), n_tok, n_cols)
    quantize_partner_rows(int(partner), x2.reshape(-1), n_tok, n_cols, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs)
    return pa


class Activations:
    """Activations x float32 [T, C] plus each partner encoding, computed once on first use.

    ``encoded(partner)`` quantizes every token row once; all weight rows (and all tensors of
    the same partner format, e.g. q/k/v) then reuse it.
    """

    def __init__(self, x: np.ndarray):
        self.x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)  # [T, C]
        self.n_tok, self.n_cols = self.x.shape
        self._enc: dict[Partner, PartnerArrays] = {}

    def encoded(self, partner: Partner) -> PartnerArrays:
        pa = self._enc.get(partner)
        if pa is None:
            pa = self._enc[partner] = quantize_activations(self.x, partner)
        return pa

