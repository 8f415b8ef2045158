"""The grid i-quants' unpacked multi-item matmul in row x item blocks
(quant/tiles_iq_blocked.py; AVX2 and AVX-512 tiles): more items than one item block, over a row range off the
row-block grid, with activation / output indirection and repeated items, equals one-item
matmuls bit for bit; so does the row-by-row path below one item block."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import quant as q
from moe_service.engine.quant import tiles_iq_blocked as blk
from moe_service.engine.quant.tiles_k import UNPACKED_BLOCK_BYTES

from .test_quant_tiles import det_activations, det_blocks

GRID_IQ = [q.BY_NAME[n].type_id for n in ("IQ2_XXS", "IQ1_S", "IQ3_S")]


def _nb_with_8_item_blocks() -> int:
    """The fewest super-blocks per row (>= 29) at which this host's item block is one 8-item
    tile (the blocks are sized from the L2: tiles_iq_blocked._L2_BYTES)."""
    nb = 29
    while blk.item_block.py_func(nb) != 8:
        nb += 1
    return nb


def test_blocks_fit_the_cache_sizes_they_claim():
    assert blk._ITEM_BLOCK_BYTES == blk._L2_BYTES // 4 and blk._UNPACKED_ROW_BLOCK_BYTES == blk._L2_BYTES * 5 // 16
    assert 256 << 10 <= blk._L2_BYTES <= 2 << 20
    nb = 28  # DeepSeek-V3's 7,168 columns: 16 x 8,176 bytes of Q8_K <= 128 KiB on a 512 KiB L2
    ib = blk.item_block.py_func(nb)
    assert ib % 8 == 0 and ib * nb * 292 <= blk._ITEM_BLOCK_BYTES < (ib + 8) * nb * 292
    assert blk.item_block.py_func(10_000) == 8  # at least one 8-item tile
    assert blk._UNPACKED_ROW_BLOCK_BYTES // (nb * UNPACKED_BLOCK_BYTES) >= 8


@pytest.mark.parametrize("tid", GRID_IQ, ids=[q.FORMATS[t].name for t in GRID_IQ])
def test_row_and_item_blocks_give_the_one_item_results(tid):
    f = q.FORMATS[tid]
    nb = _nb_with_8_item_blocks()  # item blocks of 8 items, row blocks of 8-9 rows (29 x 640 bytes in 160 KiB)
    n_rows, n_cols, n_tok = 27, nb * f.block_elems, 21
    assert 2 <= blk._UNPACKED_ROW_BLOCK_BYTES // (nb * UNPACKED_BLOCK_BYTES) <= 10
    raw = det_blocks(tid, n_rows, n_cols, seed=11 + tid)
    x = det_activations(n_tok, n_cols, seed=90 + tid)
    x[5] *= 1e4  # Q8_K values at +-127
    single = np.stack([q.matmul(raw, 0, tid, n_rows, n_cols, x[t : t + 1])[0] for t in range(n_tok)])
    for t in (7, 9, 17, n_tok):  # one item block (row by row), then 2 and 3 blocks with a ragged last
        got = q.matmul(raw, 0, tid, n_rows, n_cols, x[:t])
        assert np.array_equal(got.view(np.uint32), single[:t].view(np.uint32)), t
    pa = q.quantize_activations(x, f.partner)
    a = np.array([(5 * i + 2) % n_tok for i in range(29)], np.int64)
    o = np.arange(len(a), dtype=np.int64)[::-1].copy()
    y = np.full((len(a), n_rows), np.nan, np.float32)
    lo, hi = 3, 24  # row blocks from 3 (8 rows: 3..10, 11..18, 19..23: two 2-row tiles and a row)
    q.matmul_rows(
        raw,
        0,
        tid,
        n_cols,
        q.row_bytes(tid, n_cols),
        lo,
        hi,
        pa.xf,
        pa.xq,
        pa.xd,
        pa.xs,
        pa.xbs,
        a,
        o,
        y.reshape(-1),
        n_rows,
        0,
        q.ensure_kernels([tid]),
    )
    for i, (ai, oi) in enumerate(zip(a, o, strict=True)):
        assert np.array_equal(y[oi, lo:hi].view(np.uint32), single[ai, lo:hi].view(np.uint32)), i
        assert np.isnan(y[oi, :lo]).all() and np.isnan(y[oi, hi:]).all()
