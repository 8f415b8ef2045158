"""bench/iq1_lut (the one-token IQ1_S lookup-table prototype, not used by the engine): its
table holds the grid halves' exact dots, and its kernel gives the current kernel's results
bit for bit (random blocks at two scales, rows not a multiple of the tile, 2 / 3 / 8
super-blocks a row, row by row and super-block by super-block)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import iq1_lut
from moe_service.engine import quant as q
from moe_service.engine.quant import codebooks


def test_table_entries_are_the_halves_dots():
    rng = np.random.default_rng(1)
    pa = q.quantize_activations(rng.standard_normal((1, 512)).astype(np.float32), q.Partner.Q8_K)
    lut = np.empty(2 * iq1_lut.LUT_PER_BLOCK, np.int32)
    iq1_lut.build_lut(pa.xq, 0, 2, iq1_lut.PLANES, lut)
    g = codebooks.grid("IQ1_S").astype(np.int32)
    x = pa.xq.astype(np.int32).reshape(64, 8)  # 64 slices of 8 columns
    want_lo = g[:, :4] @ x[:, :4].T  # [2048, 64]
    want_hi = g[:, 4:] @ x[:, 4:].T
    got = lut.reshape(64, 2048)
    np.testing.assert_array_equal((got << 16) >> 16, want_lo.T)
    np.testing.assert_array_equal(got >> 16, want_hi.T)


@pytest.mark.parametrize(("n_rows", "n_cols"), [(37, 2048), (33, 768), (5, 512), (1, 256)])
def test_bit_for_bit_with_the_current_kernel(n_rows, n_cols):
    iq1_lut.check(np.random.default_rng(n_rows), n_rows, n_cols)


def test_l1_layout_keeps_scales_and_signs():
    rng = np.random.default_rng(2)
    arena = q.random_blocks(rng, iq1_lut._F.type_id, 3, 512)
    before = arena.reshape(-1, 50)[:, 34:50].copy().view(np.uint16)
    iq1_lut._l1_indices(arena, 6)
    blk = arena.reshape(-1, 50)
    qh = blk[:, 34:50].copy().view(np.uint16)
    np.testing.assert_array_equal(qh >> 12, before >> 12)
    idx = blk[:, 2:34].astype(np.int64) | (
        ((qh[:, np.arange(32) // 4] >> (3 * (np.arange(32) % 4))) & 7) << 8
    )
    np.testing.assert_array_equal(idx, np.broadcast_to(np.arange(32) * 16, idx.shape))
