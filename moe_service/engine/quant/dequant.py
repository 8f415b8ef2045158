"""Dequantization: rows of a GGUF tensor to float32, bit-exact with gguf.quants.dequantize
(the same float32 operations in the same order). Used for embedding lookups and as the
kernels' test oracle.

A format's piece here is one *block* function (arena uint8 [*], o, out float32 [*], oo):
the block at byte ``o`` -> out[oo : oo + block_elems], registered with ``@_dequantizes``;
its byte offsets come from the format declarations (formats.py) as compile-time constants.
The row loop is generated once per format by ``_make_rows`` (format id, block bytes and
elements are closure constants, so each format caches separately), which picks the block
function at compile time through ``_block``. ``DEQUANT_ROWS``: type id -> row function,
compiled on first use, (arena, w_off, n_cols, row_bytes_, rows int64 [R], out float32
[R * n_cols]): out[i * n_cols : (i + 1) * n_cols] = row rows[i] of the tensor whose row 0
starts at byte ``w_off``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from moe_service.engine.quant import codebooks
from moe_service.engine.quant.ir import (
    _JIT,
    _JIT_INLINE,
    bits_f32,
    ld,
    ld_bf16,
    ld_f16,
    ld_f32,
    ld_i8,
    ld_u8,
    ld_u32,
    st,
)
from moe_service.errors import ModelFileError
from moe_service.formats import (
    BY_NAME,
    FORMATS,
    IQ4NL_KVALUES,
    QK,
    block_format,
    row_bytes,
)

_BLOCKS: dict = {}
"""GGML type id -> its block function (inlined; see the module docstring)."""


def _dequantizes(*names: str, params=lambda f: ()):
    """Register a block function (arena, o, out, oo, p) for formats ``names``; p is
    ``params(declaration)``, a tuple of ints the function reads as constants."""
    def register(fn):
        jitted = njit(**_JIT_INLINE)(fn)
        for n in names:
            _BLOCKS[BY_NAME[n].type_id] = (jitted, params(BY_NAME[n]))
        return jitted

    return register


def _offsets(name: str, *fields: str) -> tuple[int, ...]:
    """The byte offsets of the named fields of format ``name``."""
    return tuple(BY_NAME[name].off(n) for n in fields)


def _block(fmt, arena, o, out, oo):
    """Dequantize one block of format ``fmt`` (a literal): compiled as that format's block function."""


@overload(_block, inline="always")
def _block_impl(fmt, arena, o, out, oo):
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    block, p = _BLOCKS[fmt.literal_value]

    def impl(fmt, arena, o, out, oo):
        block(arena, o, out, oo, p)

    return impl


@njit(**_JIT_INLINE)
def _e8m0_half(e):
    """2^(e-128) as float32 for an E8M0 byte ``e``: ggml's GGML_E8M0_TO_FP32_HALF."""
    if e < 2:
        return bits_f32(np.uint32(0x00200000) << np.uint32(e))
    return bits_f32(np.uint32(e - 1) << np.uint32(23))


@njit(**_JIT_INLINE)
def _mxfp4_value(c):
    """Doubled E2M1 value of a 4-bit code: {0,1,2,3,4,6,8,12}, bit 3 the sign (kvalues_mxfp4)."""
    m = c & 7
    mag = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    return mag - ((c >> 3) & 1) * 2 * mag


@njit(**_JIT_INLINE)
def _k4_scale(arena, so, j):
    """6-bit scale j (0..7) of the 12 packed Q4_K/Q5_K scale bytes at byte offset ``so``."""
    if j < 4:
        return ld_u8(arena, so + j) & 63
    return (ld_u8(arena, so + j + 4) & 15) | ((ld_u8(arena, so + j - 4) >> 6) << 4)


@njit(**_JIT_INLINE)
def _k4_min(arena, so, j):
    """6-bit min j (0..7) of the 12 packed Q4_K/Q5_K scale bytes at byte offset ``so``."""
    if j < 4:
        return ld_u8(arena, so + j + 4) & 63
    return (ld_u8(arena, so + j + 4) >> 4) | ((ld_u8(arena, so + j) >> 6) << 4)


@_dequantizes("F32")
def _f32(arena, o, out, oo, p):
    st(out, oo, ld_f32(arena, o))


@_dequantizes("F16")
def _f16(arena, o, out, oo, p):
    st(out, oo, ld_f16(arena, o))


@_dequantizes("BF16")
def _bf16(arena, o, out, oo, p):
    st(out, oo, ld_bf16(arena, o))


@_dequantizes("Q4_0", "Q4_1", "Q5_0", "Q5_1", params=lambda f: (f.bias, f.off("m"), f.off("qh"), f.qs))
def _nib32(arena, o, out, oo, p):
    """A 32-element nibble block (Q4_0, Q4_1, Q5_0, Q5_1): element j < 16 is the low nibble of
    qs[j], 16 + j the high one, plus bit j (16 + j) of the u32 qh << 4 when qho >= 0;
    x = d * (q - bias), or d * q + m when mo >= 0. p: (bias, mo, qho, qso) from the declaration."""
    bias, mo, qho, qso = p
    d = ld_f16(arena, o)
    m = ld_f16(arena, o + mo) if mo >= 0 else np.float32(0.0)
    qh = ld_u32(arena, o + qho) if qho >= 0 else np.int64(0)
    for j in range(16):
        v = ld_u8(arena, o + qso + j)
        x0 = ((v & 15) | (((qh >> j) & 1) << 4)) - bias
        x1 = ((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias
        if mo >= 0:
            st(out, oo + j, d * np.float32(x0) + m)
            st(out, oo + 16 + j, d * np.float32(x1) + m)
        else:
            st(out, oo + j, d * np.float32(x0))
            st(out, oo + 16 + j, d * np.float32(x1))


(Q8_0_QS,) = _offsets("Q8_0", "qs")


@_dequantizes("Q8_0")
def _q8_0(arena, o, out, oo, p):
    d = ld_f16(arena, o)
    for j in range(QK):
        st(out, oo + j, np.float32(ld_i8(arena, o + Q8_0_QS + j)) * d)


(MXFP4_QS,) = _offsets("MXFP4", "qs")


@_dequantizes("MXFP4")
def _mxfp4(arena, o, out, oo, p):
    d = _e8m0_half(ld_u8(arena, o))
    for j in range(16):
        v = ld_u8(arena, o + MXFP4_QS + j)
        st(out, oo + j, d * np.float32(_mxfp4_value(v & 15)))
        st(out, oo + 16 + j, d * np.float32(_mxfp4_value(v >> 4)))


@_dequantizes("Q4_K", "Q5_K", params=lambda f: (f.qh >= 0, f.off("dmin"), f.off("scales"), f.qh, f.qs))
def _k45(arena, o, out, oo, p):
    """A Q4_K or Q5_K (a qh field: the 5th bits) super-block; p: (is_q5, dmin, scales, qh, qs
    offsets) from the declaration."""
    is_q5, dmo, sco, qho, qso = p
    d = ld_f16(arena, o)
    dmin = ld_f16(arena, o + dmo)
    for g in range(4):
        for h in range(2):
            j = 2 * g + h
            ds = d * np.float32(_k4_scale(arena, o + sco, j))
            dm = dmin * np.float32(_k4_min(arena, o + sco, j))
            for k in range(32):
                q = (ld_u8(arena, o + qso + 32 * g + k) >> (4 * h)) & 15
                if is_q5:
                    q |= ((ld_u8(arena, o + qho + k) >> j) & 1) << 4
                st(out, oo + 32 * j + k, ds * np.float32(q) - dm)


Q6_K_QH, Q6_K_SC, Q6_K_D = _offsets("Q6_K", "qh", "scales", "d")


@_dequantizes("Q6_K")
def _q6_k(arena, o, out, oo, p):
    d = ld_f16(arena, o + Q6_K_D)
    for i in range(8):
        n = i // 4
        k = i % 4
        for el in range(32):
            lo = (ld_u8(arena, o + 64 * n + 32 * (k % 2) + el) >> (4 * (k // 2))) & 15
            hi = (ld_u8(arena, o + Q6_K_QH + 32 * n + el) >> (2 * k)) & 3
            q = (lo | (hi << 4)) - 32
            sc = d * np.float32(ld_i8(arena, o + Q6_K_SC + 2 * i + el // 16))
            st(out, oo + 32 * i + el, sc * np.float32(q))


Q2_K_QS, Q2_K_D, Q2_K_DMIN = _offsets("Q2_K", "qs", "d", "dmin")


@_dequantizes("Q2_K")
def _q2_k(arena, o, out, oo, p):
    """ggml's dequantize_row_q2_K: element e = 128 n + 32 j + l of a super-block is bits 2j of
    qs[32 n + l]; sub-block e // 16 has scale byte s: d * (s & 15), dmin * (s >> 4)."""
    d = ld_f16(arena, o + Q2_K_D)
    dmin = ld_f16(arena, o + Q2_K_DMIN)
    for s in range(16):
        sc = ld_u8(arena, o + s)
        dl = d * np.float32(sc & 15)
        ml = dmin * np.float32(sc >> 4)
        for el in range(16):
            e = 16 * s + el
            q = (ld_u8(arena, o + Q2_K_QS + 32 * (e // 128) + e % 32) >> (2 * ((e // 32) % 4))) & 3
            st(out, oo + e, dl * np.float32(q) - ml)


Q3_K_QS, Q3_K_SC, Q3_K_D = _offsets("Q3_K", "qs", "scales", "d")


@njit(**_JIT_INLINE)
def _k3_scale(arena, so, s):
    """6-bit scale s (0..15) of the 12 packed Q3_K scale bytes at byte offset ``so``, minus 32:
    low 4 bits from byte s % 8 (nibble s // 8), high 2 bits from byte 8 + s % 4 (bits 2 (s // 4))."""
    lo = (ld_u8(arena, so + s % 8) >> (4 * (s // 8))) & 15
    hi = (ld_u8(arena, so + 8 + s % 4) >> (2 * (s // 4))) & 3
    return (lo | (hi << 4)) - 32


@_dequantizes("Q3_K")
def _q3_k(arena, o, out, oo, p):
    """ggml's dequantize_row_q3_K: 2-bit low q as Q2_K, minus 4 where the element's hmask bit
    (bit e // 32 of hmask[e % 32]) is clear; sub-block e // 16 has scale d * (6-bit scale - 32)."""
    d = ld_f16(arena, o + Q3_K_D)
    for s in range(16):
        dl = d * np.float32(_k3_scale(arena, o + Q3_K_SC, s))
        for el in range(16):
            e = 16 * s + el
            q = (ld_u8(arena, o + Q3_K_QS + 32 * (e // 128) + e % 32) >> (2 * ((e // 32) % 4))) & 3
            h = (ld_u8(arena, o + e % 32) >> (e // 32)) & 1
            st(out, oo + e, dl * np.float32(q - 4 * (1 - h)))


IQ4_XS_SH, IQ4_XS_SL, IQ4_XS_QS = _offsets("IQ4_XS", "scales_h", "scales_l", "qs")
_IQ4NL = np.array(IQ4NL_KVALUES, dtype=np.int8)


@_dequantizes("IQ4_XS")
def _iq4_xs(arena, o, out, oo, p):
    """ggml's dequantize_row_iq4_xs: sub-block s (32 elements) has scale d * (6-bit scale - 32)
    (low 4 bits: nibble s % 2 of scales_l[s // 2]; high 2 bits: bits 2s of the u16 scales_h),
    element j < 16 is kvalues_iq4nl[low nibble of qs[16 s + j]], element 16 + j the high one."""
    d = ld_f16(arena, o)
    sh = ld_u8(arena, o + IQ4_XS_SH) | (ld_u8(arena, o + IQ4_XS_SH + 1) << 8)
    for s in range(8):
        ls = ((ld_u8(arena, o + IQ4_XS_SL + s // 2) >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        for j in range(16):
            v = ld_u8(arena, o + IQ4_XS_QS + 16 * s + j)
            st(out, oo + 32 * s + j, dl * np.float32(_IQ4NL[v & 15]))
            st(out, oo + 32 * s + 16 + j, dl * np.float32(_IQ4NL[v >> 4]))


# ---------------------------------------------------------------------------------------
# The i-quants: grid values (codebooks.py, from gguf-py) times signs times odd sub-block
# scales, in gguf-py's float32 operation order (gguf/quants.py IQ*.dequantize_blocks; the
# semantics are ggml-quants.c's dequantize_row_iq*)
# ---------------------------------------------------------------------------------------

(IQ4_NL_QS,) = _offsets("IQ4_NL", "qs")


@_dequantizes("IQ4_NL")
def _iq4_nl(arena, o, out, oo, p):
    """ggml's dequantize_row_iq4_nl: element j < 16 is kvalues_iq4nl[low nibble of qs[j]],
    16 + j the high one, times d."""
    d = ld_f16(arena, o)
    for j in range(16):
        v = ld_u8(arena, o + IQ4_NL_QS + j)
        st(out, oo + j, d * np.float32(_IQ4NL[v & 15]))
        st(out, oo + 16 + j, d * np.float32(_IQ4NL[v >> 4]))


_GRID_IQ2XXS = codebooks.grid("IQ2_XXS")
_GRID_IQ2XS = codebooks.grid("IQ2_XS")
_GRID_IQ2S = codebooks.grid("IQ2_S")
_GRID_IQ3XXS = codebooks.grid("IQ3_XXS")
_GRID_IQ3S = codebooks.grid("IQ3_S")
_GRID_IQ1S = codebooks.grid("IQ1_S")
_KSIGNS = codebooks.ksigns()
_IQ1_DELTA = np.float32(codebooks.IQ1_DELTA)


@njit(**_JIT_INLINE)
def _put8(out, oo, db, grid, idx, sgn):
    """out[oo + j] = (db * grid[idx, j]) * (-1 if bit j of sgn else 1), j < 8 (gguf-py's
    ``db * grid * signs``)."""
    for j in range(8):
        v = db * np.float32(grid[idx, j])
        st(out, oo + j, -v if (sgn >> j) & 1 else v)


@njit(**_JIT_INLINE)
def _quarter_scale(d, s, f):
    """gguf-py's d * (0.5 + s) * f (IQ2: f = 0.25, IQ3_XXS: 0.5), float32 throughout."""
    return d * (np.float32(0.5) + np.float32(s)) * np.float32(f)


IQ2_XXS_QS = BY_NAME["IQ2_XXS"].qs


@_dequantizes("IQ2_XXS")
def _iq2_xxs(arena, o, out, oo, p):
    """ggml's dequantize_row_iq2_xxs: sub-block ib (32 elements) is 4 grid indices (bytes) and
    a u32 of four 7-bit ksigns indices (one per 8 elements) and the 4-bit scale s (top bits);
    x = d * (0.5 + s) * 0.25 * grid * sign."""
    d = ld_f16(arena, o)
    for ib in range(8):
        b = o + IQ2_XXS_QS + 8 * ib
        aux = ld_u32(arena, b + 4)
        db = _quarter_scale(d, aux >> 28, 0.25)
        for k in range(4):
            _put8(out, oo + 32 * ib + 8 * k, db, _GRID_IQ2XXS, ld_u8(arena, b + k), _KSIGNS[(aux >> (7 * k)) & 127])


IQ2_XS_QS, IQ2_XS_SC = _offsets("IQ2_XS", "qs", "scales")


@_dequantizes("IQ2_XS")
def _iq2_xs(arena, o, out, oo, p):
    """ggml's dequantize_row_iq2_xs: 32 u16 (one per 8 elements: 9-bit grid index, 7-bit ksigns
    index); the 4-bit scale of 16 elements k is nibble k % 2 of scales[k // 2]."""
    d = ld_f16(arena, o)
    for k in range(32):
        q = ld_u8(arena, o + IQ2_XS_QS + 2 * k) | (ld_u8(arena, o + IQ2_XS_QS + 2 * k + 1) << 8)
        s = (ld_u8(arena, o + IQ2_XS_SC + k // 4) >> (4 * ((k // 2) % 2))) & 15
        _put8(out, oo + 8 * k, _quarter_scale(d, s, 0.25), _GRID_IQ2XS, q & 511, _KSIGNS[q >> 9])


IQ2_S_QS, IQ2_S_SG, IQ2_S_QH, IQ2_S_SC = _offsets("IQ2_S", "qs", "signs", "qh", "scales")


@_dequantizes("IQ2_S")
def _iq2_s(arena, o, out, oo, p):
    """ggml's dequantize_row_iq2_s: group k of 8 elements has grid index qs[k] | 2 bits
    (2 (k % 4)) of qh[k // 4] << 8 and sign byte signs[k]; scales as IQ2_XS."""
    d = ld_f16(arena, o)
    for k in range(32):
        idx = ld_u8(arena, o + IQ2_S_QS + k) | (((ld_u8(arena, o + IQ2_S_QH + k // 4) >> (2 * (k % 4))) & 3) << 8)
        s = (ld_u8(arena, o + IQ2_S_SC + k // 4) >> (4 * ((k // 2) % 2))) & 15
        _put8(out, oo + 8 * k, _quarter_scale(d, s, 0.25), _GRID_IQ2S, idx, ld_u8(arena, o + IQ2_S_SG + k))


IQ3_XXS_QS, IQ3_XXS_SS = _offsets("IQ3_XXS", "qs", "scales_signs")


@_dequantizes("IQ3_XXS")
def _iq3_xxs(arena, o, out, oo, p):
    """ggml's dequantize_row_iq3_xxs: grid index k (a byte) gives elements 4k..4k+3; sub-block
    ib's u32 holds four 7-bit ksigns indices (per 8 elements) and the scale s in its top 4
    bits; x = d * (0.5 + s) * 0.5 * grid * sign."""
    d = ld_f16(arena, o)
    for ib in range(8):
        aux = ld_u32(arena, o + IQ3_XXS_SS + 4 * ib)
        db = _quarter_scale(d, aux >> 28, 0.5)
        for k in range(4):
            sgn = _KSIGNS[(aux >> (7 * k)) & 127]
            for h in range(2):
                idx = ld_u8(arena, o + IQ3_XXS_QS + 8 * ib + 2 * k + h)
                for j in range(4):
                    v = db * np.float32(_GRID_IQ3XXS[idx, j])
                    st(out, oo + 32 * ib + 8 * k + 4 * h + j, -v if (sgn >> (4 * h + j)) & 1 else v)


IQ3_S_QS, IQ3_S_QH, IQ3_S_SG, IQ3_S_SC = _offsets("IQ3_S", "qs", "qh", "signs", "scales")


@_dequantizes("IQ3_S")
def _iq3_s(arena, o, out, oo, p):
    """ggml's dequantize_row_iq3_s: grid index k = qs[k] | bit k % 8 of qh[k // 8] << 8 gives
    elements 4k..4k+3; element e's sign is bit e % 8 of signs[e // 8]; sub-block e // 32 has
    scale d * (1 + 2 s), s nibble (e // 32) % 2 of scales[e // 64]."""
    d = ld_f16(arena, o)
    for ib in range(8):
        db = d * np.float32(1 + 2 * ((ld_u8(arena, o + IQ3_S_SC + ib // 2) >> (4 * (ib % 2))) & 15))
        for k in range(8 * ib, 8 * ib + 8):
            idx = ld_u8(arena, o + IQ3_S_QS + k) | (((ld_u8(arena, o + IQ3_S_QH + k // 8) >> (k % 8)) & 1) << 8)
            sgn = ld_u8(arena, o + IQ3_S_SG + k // 2)
            for j in range(4):
                v = db * np.float32(_GRID_IQ3S[idx, j])
                st(out, oo + 4 * k + j, -v if (sgn >> (4 * (k % 2) + j)) & 1 else v)


IQ1_S_QS, IQ1_S_QH = _offsets("IQ1_S", "qs", "qh")


@_dequantizes("IQ1_S")
def _iq1_s(arena, o, out, oo, p):
    """ggml's dequantize_row_iq1_s: sub-block ib's u16 qh holds 3 high index bits per 8
    elements (bits 3k), the scale s (bits 12..14) and the delta's sign (bit 15); x = d * (2 s
    + 1) * (grid + delta), delta = -1/8 when bit 15 is set, else +1/8."""
    d = ld_f16(arena, o)
    for ib in range(8):
        qh = ld_u8(arena, o + IQ1_S_QH + 2 * ib) | (ld_u8(arena, o + IQ1_S_QH + 2 * ib + 1) << 8)
        dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
        delta = -_IQ1_DELTA if qh & 0x8000 else _IQ1_DELTA
        for k in range(4):
            idx = ld_u8(arena, o + IQ1_S_QS + 4 * ib + k) | (((qh >> (3 * k)) & 7) << 8)
            for j in range(8):
                st(out, oo + 32 * ib + 8 * k + j, dl * (np.float32(_GRID_IQ1S[idx, j]) + delta))


IQ1_M_QH, IQ1_M_SC = _offsets("IQ1_M", "qh", "scales")


@intrinsic
def _f16_from_bits(typingctx, x):
    """The float16 whose bits are the low 16 bits of the integer ``x``, widened to float32."""
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint16)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(**_JIT_INLINE)
def _iq1m_d(arena, so):
    """The f16 d of an IQ1_M super-block: the top nibbles of its four u16 scale words at ``so``
    (word k's nibble is bits 4k..4k+3 of d), as ggml's iq1m_scale_t."""
    bits = 0
    for k in range(4):
        bits |= (ld_u8(arena, so + 2 * k + 1) >> 4) << (4 * k)
    return _f16_from_bits(bits)


@_dequantizes("IQ1_M")
def _iq1_m(arena, o, out, oo, p):
    """ggml's dequantize_row_iq1_m: group k of 8 elements has index qs[k] | (nibble k % 2 of
    qh[k // 2]) & 7 << 8 and delta -1/8 when that nibble's bit 3 is set, else +1/8; 16
    elements m have scale d * (2 s + 1), s bits 3 (m % 4) of u16 scale word m // 4."""
    d = _iq1m_d(arena, o + IQ1_M_SC)
    for m in range(16):
        w = ld_u8(arena, o + IQ1_M_SC + 2 * (m // 4)) | (ld_u8(arena, o + IQ1_M_SC + 2 * (m // 4) + 1) << 8)
        dl = d * np.float32(2 * ((w >> (3 * (m % 4))) & 7) + 1)
        for h in range(2):
            k = 2 * m + h
            nib = (ld_u8(arena, o + IQ1_M_QH + k // 2) >> (4 * (k % 2))) & 15
            idx = ld_u8(arena, o + k) | ((nib & 7) << 8)
            delta = -_IQ1_DELTA if nib & 8 else _IQ1_DELTA
            for j in range(8):
                st(out, oo + 8 * k + j, dl * (np.float32(_GRID_IQ1S[idx, j]) + delta))


def _make_rows(f):
    """The row function of format ``f`` (see the module docstring), compiled on first call."""
    fmt, block_bytes, block_elems = f.type_id, f.block_bytes, f.block_elems

    def rows_fn(arena, w_off, n_cols, row_bytes_, rows, out):
        for i in range(rows.shape[0]):
            wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
            for b in range(n_cols // block_elems):
                _block(fmt, arena, wo + b * block_bytes, out, oo + b * block_elems)

    rows_fn.__name__ = rows_fn.__qualname__ = f"_dequant_rows_{f.name.lower()}"
    return njit(**_JIT)(rows_fn)


DEQUANT_ROWS: dict = {t: _make_rows(FORMATS[t]) for t in _BLOCKS}
"""GGML type id -> its row function (see the module docstring)."""


def dequantize_rows(arena, w_off, ggml_type, n_cols, row_bytes_, rows, out) -> None:
    """Dequantize selected rows of a tensor to float32.

    arena: uint8 [*]; w_off: byte offset of row 0; rows: int64 [R] row indices;
    out: float32 [R * n_cols] (row-major). Used for embedding lookups and as a test oracle.
    The caller validates offsets and shapes; ModelFileError for an unsupported type.
    """
    fn = DEQUANT_ROWS.get(int(ggml_type))
    if fn is None:
        block_format(ggml_type)  # raises, naming the type
        raise ModelFileError(f"GGML tensor type {int(ggml_type)} has no dequantizer")
    fn(arena, int(w_off), int(n_cols), int(row_bytes_), rows, out)


def check_tensor(arena: np.ndarray, offset: int, ggml_type: int, n_rows: int, n_cols: int) -> int:
    """Validate a tensor of n_rows x n_cols ``ggml_type`` at byte ``offset`` of ``arena``.

    Returns its row bytes. ValueError when the arena is not a 1-D C-contiguous uint8 array or
    the tensor runs past its end; ModelFileError for an unsupported type.
    """
    if arena.dtype != np.uint8 or arena.ndim != 1 or not arena.flags.c_contiguous:
        raise ValueError(f"arena must be a 1-D C-contiguous uint8 array (got {arena.dtype} {arena.shape})")
    rb = row_bytes(ggml_type, n_cols)
    if offset < 0 or offset + n_rows * rb > arena.size:
        raise ValueError(
            f"tensor of {n_rows} x {n_cols} {block_format(ggml_type).name} at byte {offset} needs "
            f"{n_rows * rb} bytes but the arena ends at {arena.size}"
        )
    return rb


def dequantize(arena: np.ndarray, ggml_type: int, n_rows: int, n_cols: int, offset: int = 0) -> np.ndarray:
    """Dequantize a whole tensor to float32 [n_rows, n_cols] (bit-exact with gguf.quants)."""
    rb = check_tensor(arena, offset, ggml_type, n_rows, n_cols)
    out = np.empty(n_rows * n_cols, np.float32)
    dequantize_rows(arena, int(offset), int(ggml_type), int(n_cols), rb, np.arange(n_rows, dtype=np.int64), out)
    return out.reshape(n_rows, n_cols)
