"""Dequantization: rows of a GGUF tensor to float32, bit-exact with gguf.quants.dequantize
(the same float32 operations in the same order). One row function per format, looked up by
GGML type id in ``DEQUANT_ROWS``; each compiles on first use. Used for embedding lookups
and as the kernels' test oracle.

Every row function has the signature (arena uint8 [*], w_off, n_cols, row_bytes_, rows int64
[R], out float32 [R * n_cols]): out[i * n_cols : (i + 1) * n_cols] = row rows[i] of the tensor
whose row 0 starts at byte ``w_off``. Byte offsets come from the format declarations
(formats.py); the block loops read them as compile-time constants.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine.quant.formats import (
    BY_NAME,
    IQ4NL_KVALUES,
    QK,
    QK_K,
    block_format,
    row_bytes,
)
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

DEQUANT_ROWS: dict = {}
"""GGML type id -> its row function (see the module docstring)."""


def _dequantizes(name: str):
    def register(fn):
        DEQUANT_ROWS[BY_NAME[name].type_id] = fn
        return fn

    return register


def _offsets(name: str, *fields: str) -> tuple[int, ...]:
    """(block bytes, offset of each named field) of format ``name``."""
    f = BY_NAME[name]
    return (f.block_bytes, *(f.off(n) for n in fields))


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
@njit(**_JIT)
def _rows_f32(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for j in range(n_cols):
            st(out, oo + j, ld_f32(arena, wo + 4 * j))


@_dequantizes("F16")
@njit(**_JIT)
def _rows_f16(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for j in range(n_cols):
            st(out, oo + j, ld_f16(arena, wo + 2 * j))


@_dequantizes("BF16")
@njit(**_JIT)
def _rows_bf16(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for j in range(n_cols):
            st(out, oo + j, ld_bf16(arena, wo + 2 * j))


Q4_0_BB, Q4_0_QS = _offsets("Q4_0", "qs")


@_dequantizes("Q4_0")
@njit(**_JIT)
def _rows_q4_0(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK):
            o = wo + b * Q4_0_BB
            d = ld_f16(arena, o)
            for j in range(16):
                v = ld_u8(arena, o + Q4_0_QS + j)
                st(out, oo + b * QK + j, d * np.float32((v & 15) - 8))
                st(out, oo + b * QK + 16 + j, d * np.float32((v >> 4) - 8))


Q4_1_BB, Q4_1_M, Q4_1_QS = _offsets("Q4_1", "m", "qs")


@_dequantizes("Q4_1")
@njit(**_JIT)
def _rows_q4_1(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK):
            o = wo + b * Q4_1_BB
            d = ld_f16(arena, o)
            m = ld_f16(arena, o + Q4_1_M)
            for j in range(16):
                v = ld_u8(arena, o + Q4_1_QS + j)
                st(out, oo + b * QK + j, d * np.float32(v & 15) + m)
                st(out, oo + b * QK + 16 + j, d * np.float32(v >> 4) + m)


Q5_0_BB, Q5_0_QH, Q5_0_QS = _offsets("Q5_0", "qh", "qs")


@_dequantizes("Q5_0")
@njit(**_JIT)
def _rows_q5_0(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK):
            o = wo + b * Q5_0_BB
            d = ld_f16(arena, o)
            qh = ld_u32(arena, o + Q5_0_QH)
            for j in range(16):
                v = ld_u8(arena, o + Q5_0_QS + j)
                x0 = ((v & 15) | (((qh >> j) & 1) << 4)) - 16
                x1 = ((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16
                st(out, oo + b * QK + j, d * np.float32(x0))
                st(out, oo + b * QK + 16 + j, d * np.float32(x1))


Q5_1_BB, Q5_1_M, Q5_1_QH, Q5_1_QS = _offsets("Q5_1", "m", "qh", "qs")


@_dequantizes("Q5_1")
@njit(**_JIT)
def _rows_q5_1(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK):
            o = wo + b * Q5_1_BB
            d = ld_f16(arena, o)
            m = ld_f16(arena, o + Q5_1_M)
            qh = ld_u32(arena, o + Q5_1_QH)
            for j in range(16):
                v = ld_u8(arena, o + Q5_1_QS + j)
                x0 = (v & 15) | (((qh >> j) & 1) << 4)
                x1 = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
                st(out, oo + b * QK + j, d * np.float32(x0) + m)
                st(out, oo + b * QK + 16 + j, d * np.float32(x1) + m)


Q8_0_BB, Q8_0_QS = _offsets("Q8_0", "qs")


@_dequantizes("Q8_0")
@njit(**_JIT)
def _rows_q8_0(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK):
            o = wo + b * Q8_0_BB
            d = ld_f16(arena, o)
            for j in range(QK):
                st(out, oo + b * QK + j, np.float32(ld_i8(arena, o + Q8_0_QS + j)) * d)


MXFP4_BB, MXFP4_QS = _offsets("MXFP4", "qs")


@_dequantizes("MXFP4")
@njit(**_JIT)
def _rows_mxfp4(arena, w_off, n_cols, row_bytes_, rows, out):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK):
            o = wo + b * MXFP4_BB
            d = _e8m0_half(ld_u8(arena, o))
            for j in range(16):
                v = ld_u8(arena, o + MXFP4_QS + j)
                st(out, oo + b * QK + j, d * np.float32(_mxfp4_value(v & 15)))
                st(out, oo + b * QK + 16 + j, d * np.float32(_mxfp4_value(v >> 4)))


Q4_K_BB, Q4_K_DMIN, Q4_K_SC, Q4_K_QS = _offsets("Q4_K", "dmin", "scales", "qs")
Q5_K_BB, Q5_K_DMIN, Q5_K_SC, Q5_K_QH, Q5_K_QS = _offsets("Q5_K", "dmin", "scales", "qh", "qs")


@njit(**_JIT_INLINE)
def _rows_q45_k(arena, w_off, n_cols, row_bytes_, rows, out, is_q5, bb, dmo, sco, qho, qso):
    for i in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, i) * row_bytes_, i * n_cols
        for b in range(n_cols // QK_K):
            o = wo + b * bb
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
                        st(out, oo + b * QK_K + 32 * j + k, ds * np.float32(q) - dm)


@_dequantizes("Q4_K")
@njit(**_JIT)
def _rows_q4_k(arena, w_off, n_cols, row_bytes_, rows, out):
    _rows_q45_k(arena, w_off, n_cols, row_bytes_, rows, out, False, Q4_K_BB, Q4_K_DMIN, Q4_K_SC, -1, Q4_K_QS)


@_dequantizes("Q5_K")
@njit(**_JIT)
def _rows_q5_k(arena, w_off, n_cols, row_bytes_, rows, out):
    _rows_q45_k(arena, w_off, n_cols, row_bytes_, rows, out, True, Q5_K_BB, Q5_K_DMIN, Q5_K_SC, Q5_K_QH, Q5_K_QS)


Q6_K_BB, Q6_K_QH, Q6_K_SC, Q6_K_D = _offsets("Q6_K", "qh", "scales", "d")


@_dequantizes("Q6_K")
@njit(**_JIT)
def _rows_q6_k(arena, w_off, n_cols, row_bytes_, rows, out):
    for r in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, r) * row_bytes_, r * n_cols
        for b in range(n_cols // QK_K):
            o = wo + b * Q6_K_BB
            d = ld_f16(arena, o + Q6_K_D)
            for i in range(8):
                n = i // 4
                k = i % 4
                for el in range(32):
                    lo = (ld_u8(arena, o + 64 * n + 32 * (k % 2) + el) >> (4 * (k // 2))) & 15
                    hi = (ld_u8(arena, o + Q6_K_QH + 32 * n + el) >> (2 * k)) & 3
                    q = (lo | (hi << 4)) - 32
                    sc = d * np.float32(ld_i8(arena, o + Q6_K_SC + 2 * i + el // 16))
                    st(out, oo + b * QK_K + 32 * i + el, sc * np.float32(q))


Q2_K_BB, Q2_K_QS, Q2_K_D, Q2_K_DMIN = _offsets("Q2_K", "qs", "d", "dmin")


@_dequantizes("Q2_K")
@njit(**_JIT)
def _rows_q2_k(arena, w_off, n_cols, row_bytes_, rows, out):
    """ggml's dequantize_row_q2_K: element e = 128 n + 32 j + l of a super-block is bits 2j of
    qs[32 n + l]; sub-block e // 16 has scale byte (d * (s & 15), dmin * (s >> 4))."""
    for r in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, r) * row_bytes_, r * n_cols
        for b in range(n_cols // QK_K):
            o = wo + b * Q2_K_BB
            d = ld_f16(arena, o + Q2_K_D)
            dmin = ld_f16(arena, o + Q2_K_DMIN)
            for s in range(16):
                sc = ld_u8(arena, o + s)
                dl = d * np.float32(sc & 15)
                ml = dmin * np.float32(sc >> 4)
                for el in range(16):
                    e = 16 * s + el
                    q = (ld_u8(arena, o + Q2_K_QS + 32 * (e // 128) + e % 32) >> (2 * ((e // 32) % 4))) & 3
                    st(out, oo + b * QK_K + e, dl * np.float32(q) - ml)


Q3_K_BB, Q3_K_QS, Q3_K_SC, Q3_K_D = _offsets("Q3_K", "qs", "scales", "d")


@njit(**_JIT_INLINE)
def _k3_scale(arena, so, s):
    """6-bit scale s (0..15) of the 12 packed Q3_K scale bytes at byte offset ``so``, minus 32:
    low 4 bits from byte s % 8 (nibble s // 8), high 2 bits from byte 8 + s % 4 (bits 2 (s // 4))."""
    lo = (ld_u8(arena, so + s % 8) >> (4 * (s // 8))) & 15
    hi = (ld_u8(arena, so + 8 + s % 4) >> (2 * (s // 4))) & 3
    return (lo | (hi << 4)) - 32


@_dequantizes("Q3_K")
@njit(**_JIT)
def _rows_q3_k(arena, w_off, n_cols, row_bytes_, rows, out):
    """ggml's dequantize_row_q3_K: 2-bit low q as Q2_K, minus 4 where the element's hmask bit
    (bit e // 32 of hmask[e % 32]) is clear; sub-block e // 16 has scale d * (6-bit scale - 32)."""
    for r in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, r) * row_bytes_, r * n_cols
        for b in range(n_cols // QK_K):
            o = wo + b * Q3_K_BB
            d = ld_f16(arena, o + Q3_K_D)
            for s in range(16):
                dl = d * np.float32(_k3_scale(arena, o + Q3_K_SC, s))
                for el in range(16):
                    e = 16 * s + el
                    q = (ld_u8(arena, o + Q3_K_QS + 32 * (e // 128) + e % 32) >> (2 * ((e // 32) % 4))) & 3
                    h = (ld_u8(arena, o + e % 32) >> (e // 32)) & 1
                    st(out, oo + b * QK_K + e, dl * np.float32(q - 4 * (1 - h)))


IQ4_XS_BB, IQ4_XS_SH, IQ4_XS_SL, IQ4_XS_QS = _offsets("IQ4_XS", "scales_h", "scales_l", "qs")
_IQ4NL = np.array(IQ4NL_KVALUES, dtype=np.int8)


@_dequantizes("IQ4_XS")
@njit(**_JIT)
def _rows_iq4_xs(arena, w_off, n_cols, row_bytes_, rows, out):
    """ggml's dequantize_row_iq4_xs: sub-block s (32 elements) has scale d * (6-bit scale - 32)
    (low 4 bits: nibble s % 2 of scales_l[s // 2]; high 2 bits: bits 2s of the u16 scales_h),
    element j < 16 is kvalues_iq4nl[low nibble of qs[16 s + j]], element 16 + j the high one."""
    for r in range(rows.shape[0]):
        wo, oo = w_off + ld(rows, r) * row_bytes_, r * n_cols
        for b in range(n_cols // QK_K):
            o = wo + b * IQ4_XS_BB
            d = ld_f16(arena, o)
            sh = ld_u8(arena, o + IQ4_XS_SH) | (ld_u8(arena, o + IQ4_XS_SH + 1) << 8)
            for s in range(8):
                ls = ((ld_u8(arena, o + IQ4_XS_SL + s // 2) >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)
                dl = d * np.float32(ls - 32)
                for j in range(16):
                    v = ld_u8(arena, o + IQ4_XS_QS + 16 * s + j)
                    st(out, oo + b * QK_K + 32 * s + j, dl * np.float32(_IQ4NL[v & 15]))
                    st(out, oo + b * QK_K + 32 * s + 16 + j, dl * np.float32(_IQ4NL[v >> 4]))


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
