"""Q6_K's multi-item matmul over unpacked rows (quant/tiles_q6_unpacked.py, AVX2 and AVX-512): at the
shapes table.py routes there (takes_q6_unpacked) and off them (ragged items, odd rows per row
block, a row range off the block grid, activation / output indirection, repeated items), the
results equal one-item matmuls bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from moe_service.engine import quant as q
from moe_service.engine.quant import tiles_q6_unpacked as q6

from .test_quant_tiles import det_activations, det_blocks

Q6K = q.BY_NAME["Q6_K"].type_id

def _nb_with_rows_per_block(rows: int) -> int:
    """The fewest super-blocks per row (>= 29) at which this host's row block holds ``rows``
    rows (the blocks are sized from the L2: tiles_iq_blocked._L2_BYTES)."""
    nb = 29
    while q6.row_block.py_func(nb) > rows:
        nb += 1
    return nb


def _single(raw, n_rows, n_cols, x):
    """float32 [n_tok, n_rows]: every item through its own one-item matmul."""
    return np.stack([q.matmul(raw, 0, Q6K, n_rows, n_cols, x[t : t + 1])[0] for t in range(len(x))])


def test_the_rule_routes_the_measured_shapes_only():
    take = q6.takes_q6_unpacked.py_func
    if q._VNNI:  # AVX-512: every row length from a 128-token step's item count
        assert take(28, 128) and take(64, 96) and take(2, 512)
        assert not take(64, 64) and not take(28, 32)
    else:
        assert take(6, 128) and take(64, 64) and take(16, 100)  # 1,536 / 16,384 / 4,096 columns
        assert not take(28, 128) and not take(72, 64)  # 7,168 and 18,432 columns: not faster
        assert not take(6, 32) and not take(64, 512)  # outside the measured item counts
    rows_28 = q6.row_block.py_func(28)
    assert rows_28 * 28 * 640 <= q6._UNPACKED_ROW_BLOCK_BYTES < (rows_28 + 1) * 28 * 640
    assert q6.row_block.py_func(10_000) == 1


# shapes takes_q6_unpacked routes to the unpacked rows on this host's ISA
ROUTED = ([(28, 7, 100), (6, 9, 130), (64, 5, 96)] if q._VNNI  # AVX-512: any row length, >= 96 items
          else [(6, 13, 70), (64, 5, 64)])  # AVX2: 1,536 and 16,384 columns, 64-128 items


@pytest.mark.parametrize("nb,n_rows,n_tok", ROUTED, ids=[f"{nb * 256}x{t}" for nb, _, t in ROUTED])
def test_routed_shapes_give_the_one_item_results(nb, n_rows, n_tok):
    n_cols = nb * 256
    assert q6.takes_q6_unpacked.py_func(nb, n_tok)
    raw = det_blocks(Q6K, n_rows, n_cols, seed=31 + nb)
    x = det_activations(n_tok, n_cols, seed=77 + nb)
    x[5] *= 1e4  # Q8_K values at +-127
    got = q.matmul(raw, 0, Q6K, n_rows, n_cols, x)
    assert np.array_equal(got.view(np.uint32), _single(raw, n_rows, n_cols, x).view(np.uint32))


def test_blocks_tails_and_indirection_give_the_one_item_results():
    nb = _nb_with_rows_per_block(8)  # row blocks of <= 8 rows, item blocks of 8 items
    n_rows, n_cols, n_tok = 27, nb * 256, 23
    assert 5 <= q6.row_block.py_func(nb) <= 8 and q6.item_block.py_func(nb) == 8
    raw = det_blocks(Q6K, n_rows, n_cols, seed=5)
    x = det_activations(n_tok, n_cols, seed=6)
    x[7] *= 1e4
    single = _single(raw, n_rows, n_cols, x)
    pa = q.quantize_activations(x, q.FORMATS[Q6K].partner)
    a = np.array([(5 * i + 2) % n_tok for i in range(31)], np.int64)  # 3 item blocks + 7: 4, 2, 1 tails
    o = np.arange(len(a), dtype=np.int64)[::-1].copy()
    y = np.full((len(a), n_rows), np.nan, np.float32)
    lo, hi = 3, 24  # row blocks of 5-8 rows from 3 (8: 3..10, 11..18, 19..23: two 2-row tiles and a row)
    q6.mmq_q6_unpacked(
        raw,
        0,
        q.row_bytes(Q6K, n_cols),
        nb,
        lo,
        hi,
        pa.xq,
        pa.xd,
        pa.xbs,
        a,
        o,
        len(a),
        y.reshape(-1),
        n_rows,
        0,
    )
    for i, (ai, oi) in enumerate(zip(a, o, strict=True)):
        assert np.array_equal(y[oi, lo:hi].view(np.uint32), single[ai, lo:hi].view(np.uint32)), i
        assert np.isnan(y[oi, :lo]).all() and np.isnan(y[oi, hi:]).all()
