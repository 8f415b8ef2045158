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
