"""The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and IQ4_NL beyond the
per-format tests every declaration gets (test_quant.py, test_quant_tiles.py): the codebooks
are gguf-py's, dequantization stays bit-exact at edge scales, the kernels' integer sums equal
ggml's sum formula (integer dot per sub-block, odd scales, the IQ1 delta through the Q8_K
sums) in float64, and a GGUF tensor whose row is not whole blocks is refused naming it."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import quants as gq

from moe_service.engine import quant as q
from moe_service.engine.quant import codebooks

IQ_NAMES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL")
IQ_TYPES = [q.BY_NAME[n].type_id for n in IQ_NAMES]

# float16 scales at the edges: zero, both signs, the largest finite, the smallest normal and
# subnormal, one
EDGE_D = np.array([0.0, -0.0, 65504.0, -65504.0, 6.103515625e-05, 5.960464477539063e-08, 1.0, -1.0], np.float16)


def test_codebooks_are_gguf_py_tables():
    for name, cls in codebooks.GRID_CLASSES.items():
        cls.init_grid()
        assert np.array_equal(codebooks.grid(name).astype(np.float32), np.asarray(cls.grid).reshape(cls.grid_shape))
    assert codebooks.ksigns().tobytes() == gq.IQ2_XXS.ksigns
    # ksigns: 7 sign bits and the parity bit that makes the count of minus signs even
    assert all(bin(int(v)).count("1") % 2 == 0 for v in codebooks.ksigns())
    assert codebooks.grid_words("IQ2_XXS")[1] == 0x080808080808082B  # ggml's iq2xxs_grid[1]


def _with_d(raw: np.ndarray, tid: int, d: np.ndarray) -> np.ndarray:
    """raw (uint8, whole blocks) with every block's f16 d replaced by d (cycled)."""
    f = q.FORMATS[tid]
    b = raw.reshape(-1, f.block_bytes).copy()
    dd = np.resize(d, b.shape[0]).astype(np.float16)
    if f.name == "IQ1_M":
        q.set_iq1m_d(b, dd)
    else:
        b[:, f.off("d"):f.off("d") + 2] = dd.view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


@pytest.mark.parametrize("tid", IQ_TYPES, ids=IQ_NAMES)
def test_dequantize_bit_exact_at_edge_scales(tid):
    rng = np.random.default_rng(tid)
    n_rows, n_cols = 4, 1024
    raw = _with_d(q.random_blocks(rng, tid, n_rows, n_cols), tid, EDGE_D)
    mine = q.dequantize(raw, tid, n_rows, n_cols)
    ref = np.asarray(gq.dequantize(raw.reshape(n_rows, -1), G(tid)), dtype=np.float32).reshape(n_rows, n_cols)
    assert np.array_equal(mine.view(np.uint32), ref.view(np.uint32))
    assert np.isfinite(mine).all()


def test_iq1m_scale_round_trip():
    rng = np.random.default_rng(3)
    raw = q.random_blocks(rng, q.GGML_IQ1_M, 2, 512).reshape(-1, 56)
    before = raw.copy()
    q.set_iq1m_d(raw, EDGE_D[:4])
    words = raw[:, 48:56].copy().view(np.uint16)
    bits = sum(((words[:, k] >> 12).astype(np.uint16) << (4 * k)) for k in range(4)).astype(np.uint16)
    assert np.array_equal(bits, EDGE_D[:4].view(np.uint16))
    assert np.array_equal(raw[:, 48:56].view(np.uint16) & 0x0FFF, before[:, 48:56].view(np.uint16) & 0x0FFF)
    assert np.array_equal(raw[:, :48], before[:, :48])


def _f32_fma(a: float, b: float, c: float) -> np.float32:
    """float32 fma(a, b, c) of float32 inputs: the exact a * b + c, rounded once to float32
    (nearest even), as vfmadd231ps."""
    from fractions import Fraction

    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if x == 0:
        return np.float32(0.0)
    sign, x = (-1, -x) if x < 0 else (1, x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    e = max(e, -126)  # subnormals share the smallest exponent
    q = x / Fraction(2) ** (e - 23)  # 24 significant bits before the point
    n = q.numerator // q.denominator
    rem = q - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2):
        n += 1
    return np.float32(sign * float(Fraction(n) * Fraction(2) ** (e - 23)))


def _hsum_float_8(v: np.ndarray) -> np.float32:
    """ggml's hsum_float_8 (x86 quants.c): (v0+v4, v1+v5, v2+v6, v3+v7), then (+ v2', v3'), then 0 + 1."""
    a = [np.float32(v[i]) + np.float32(v[i + 4]) for i in range(4)]
    b = [a[0] + a[2], a[1] + a[3]]
    return np.float32(b[0] + b[1])


# format: (the factor ggml applies after the sum, the exact float32 unit of the integer values)
GGML_ORDER = {"IQ2_XXS": 0.125, "IQ2_XS": 0.125, "IQ2_S": 0.125, "IQ3_XXS": 0.25, "IQ3_S": 1.0}


@pytest.mark.parametrize("name", list(GGML_ORDER))
def test_one_token_sum_is_ggml_avx2_order_bit_for_bit(name):
    """The one-token kernel's float32 result equals ggml's AVX2 ggml_vec_dot_iq*_q8_K order
    emulated exactly: per super-block eight int32 lanes (lane k: the scaled products of
    elements 4k..4k+3 of every 32-element sub-block), acc = fma(float(lane), d_w * d_x, acc),
    then factor * hsum_float_8(acc). The integer values (2s + 1) * grid * sign are read back
    from gguf-py's dequantization, which is exact for these formats (d * scale * grid fits a
    float32 mantissa)."""
    tid = q.BY_NAME[name].type_id
    f = q.FORMATS[tid]
    rng = np.random.default_rng(7)
    n_rows, n_cols = 3, 4 * 256
    raw = q.random_blocks(rng, tid, n_rows, n_cols).reshape(n_rows, -1, f.block_bytes)
    x = rng.standard_normal((1, n_cols)).astype(np.float32)
    y = q.matmul(raw.reshape(-1), 0, tid, n_rows, n_cols, x)[0]
    pa = q.quantize_activations(x, q.Partner.Q8_K)
    xq = pa.xq.reshape(-1, 256).astype(np.int64)
    xd = pa.xd.reshape(-1)
    factor = GGML_ORDER[name]
    w = np.asarray(gq.dequantize(raw.reshape(n_rows, -1), G(tid)), dtype=np.float64).reshape(n_rows, -1, 256)
    d = raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
    for r in range(n_rows):
        acc = [np.float32(0.0)] * 8
        for b in range(n_cols // 256):
            unit = float(d[r, b]) * factor
            wi = np.rint(w[r, b] / unit).astype(np.int64)
            assert np.array_equal(wi * unit, w[r, b])  # exact integers
            lanes = (wi * xq[b]).reshape(8, 8, 4).sum(axis=(0, 2))  # [sub-block, lane, 4] -> lane
            dd = np.float32(np.float32(d[r, b]) * np.float32(xd[b]))
            acc = [_f32_fma(np.float32(lanes[k]), dd, acc[k]) for k in range(8)]
        want = np.float32(np.float32(factor) * _hsum_float_8(np.array(acc, np.float32)))
        assert y[r].view(np.uint32) == want.view(np.uint32), (r, y[r], want)
