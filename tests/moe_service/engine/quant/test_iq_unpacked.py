"""The grid i-quants' unpacked multi-item path (tiles_iq; AVX2 and AVX-512, where Q2_K joins them): a T-item matmul equals T
one-item matmuls bit for bit, for T on both sides of tiles_k.UNPACKED_MIN_ITEMS and every tile
size (8, 4, 2, 1 items), over row ranges with activation / output indirection and repeated
items; the scratch buffer's layout holds for rows of many super-blocks."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import quant as q
from moe_service.engine.quant.tiles_iq import Q2_K_UNPACKED_MIN_ITEMS
from moe_service.engine.quant.tiles_k import UNPACKED, UNPACKED_MIN_ITEMS

from .test_quant_tiles import det_activations, det_blocks

GRID_IQ = [q.BY_NAME[n].type_id for n in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")]


def test_unpacked_formats_are_the_grid_iquants():
    assert UNPACKED == frozenset(GRID_IQ) | ({q.BY_NAME["Q2_K"].type_id} if q._VNNI else frozenset())


@pytest.mark.parametrize("tid", GRID_IQ, ids=[q.FORMATS[t].name for t in GRID_IQ])
def test_many_items_equal_one_item_matmuls(tid):
    n_rows, n_cols = 6, 5 * q.QK_K
    raw = det_blocks(tid, n_rows, n_cols, seed=tid + 7)
    n_tok = 23  # two 8-item tiles, then 4, 2 and 1
    x = det_activations(n_tok, n_cols, seed=70 + tid)
    x[5] *= 1e4  # a large row: its Q8_K values reach +-127 (the offset's bound)
    x[6] = -np.abs(x[6])
    single = np.stack([q.matmul(raw, 0, tid, n_rows, n_cols, x[t:t + 1])[0] for t in range(n_tok)])
    for t in sorted({UNPACKED_MIN_ITEMS - 1, UNPACKED_MIN_ITEMS, 4, 5, 7, 8, 9, 15, n_tok}):  # see takes_unpacked
        got = q.matmul(raw, 0, tid, n_rows, n_cols, x[:t])
        assert np.array_equal(got.view(np.uint32), single[:t].view(np.uint32)), t
    pa = q.quantize_activations(x, q.FORMATS[tid].partner)
    rb = q.row_bytes(tid, n_cols)
    a = np.array([3, 1, 1, 20, 0, 7, 2, 5, 6, 9, 22, 4, 4], np.int64)
    o = np.arange(len(a), dtype=np.int64)[::-1].copy()
    y = np.full((len(a), n_rows), np.nan, np.float32)
    q.matmul_rows(raw, 0, tid, n_cols, rb, 1, 5, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, a, o, y.reshape(-1), n_rows, 0,
                  q.ensure_kernels([tid]))
    for ai, oi in zip(a, o, strict=True):
        assert np.array_equal(y[oi, 1:5].view(np.uint32), single[ai, 1:5].view(np.uint32))
        assert np.isnan(y[oi, 0]) and np.isnan(y[oi, 5])


@pytest.mark.skipif(not q._VNNI, reason="Q2_K unpacks its rows on AVX-512 (VNNI) only")
def test_q2_k_unpacked_rows_equal_one_item_matmuls():
    tid = q.BY_NAME["Q2_K"].type_id
    n_rows, n_cols = 7, 9 * q.QK_K
    raw = det_blocks(tid, n_rows, n_cols, seed=41)
    n_tok = Q2_K_UNPACKED_MIN_ITEMS + 13  # ragged 2 x 4 tiles past the threshold
    x = det_activations(n_tok, n_cols, seed=42)
    x[5] *= 1e4  # Q8_K values at +-127
    x[6] = -np.abs(x[6])
    single = np.stack([q.matmul(raw, 0, tid, n_rows, n_cols, x[t:t + 1])[0] for t in range(n_tok)])
    for t in (Q2_K_UNPACKED_MIN_ITEMS - 1, Q2_K_UNPACKED_MIN_ITEMS, n_tok):  # the tiles over the blocks, then unpacked
        got = q.matmul(raw, 0, tid, n_rows, n_cols, x[:t])
        assert np.array_equal(got.view(np.uint32), single[:t].view(np.uint32)), t
