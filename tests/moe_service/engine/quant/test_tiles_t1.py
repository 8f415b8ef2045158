"""The one-token weight sides (quant/tiles_t1.py): the same results bit for bit as the tiles
over the blocks that tiles_k's weight sides feed (the rows of a multi-token matmul, which
never take tiles_t1's sides)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import types

from moe_service.engine import quant as q
from moe_service.engine.quant import table, tiles_t1


@pytest.mark.parametrize("n_a", [1, 4])
def test_the_kernel_table_hands_the_one_token_side_to_the_k_quant_tiles(monkeypatch, n_a):
    """table._tile's definition (typing only, nothing compiled) passes Q2_K's side from
    tiles_t1.T1_SIDES to tiles_k._tilek_codegen (whose AVX2 one-item tile takes it), and on
    AVX-512 asks for that tile at one item (ymm)."""
    seen = []
    monkeypatch.setattr(table, "_tilek_codegen", lambda *a, **k: seen.append((a, k)))
    lit = types.IntegerLiteral
    table._tile.__wrapped__(None, lit(q.GGML_Q2_K), lit(1), lit(n_a), *[types.int64] * 13)
    ymm = n_a == 1 and q._VNNI  # AVX-512: Q2_K's one item takes the 256-bit tile (table._T1_YMM)
    assert seen == [((q.GGML_Q2_K, 1, n_a), {"t1_side": tiles_t1.T1_SIDES[q.GGML_Q2_K], "ymm": ymm})]


@pytest.mark.parametrize("nb", [1, 3, 8])
def test_q2_k_one_token_equals_the_multi_item_tiles(nb):
    """Each token alone (the one-item tile: tiles_t1's side) equals its row of a 2-, 4- and
    9-token matmul (tiles_k's side) bit for bit, over rows whose scale bytes take every
    value (every scale and min nibble) and activations that include Q8_K's -128."""
    rng = np.random.default_rng(nb)
    tid, n_rows, n_cols = q.GGML_Q2_K, 64, nb * 256
    f = q.BY_NAME["Q2_K"]
    raw = q.random_blocks(rng, tid, n_rows, n_cols).reshape(n_rows, nb, f.block_bytes)
    so = f.off("scales")
    raw[:, :, so : so + 16] = (np.arange(n_rows * nb * 16) % 256).astype(np.uint8).reshape(n_rows, nb, 16)
    raw = raw.reshape(-1)
    x = rng.standard_normal((9, n_cols)).astype(np.float32)
    x[1, 7] = 40.0  # a row's largest positive value quantizes to -128 in Q8_K
    for n_tok in (2, 4, 9):
        many = q.matmul(raw, 0, tid, n_rows, n_cols, x[:n_tok])
        for t in range(n_tok):
            one = q.matmul(raw, 0, tid, n_rows, n_cols, x[t : t + 1])[0]
            assert np.array_equal(one.view(np.uint32), many[t].view(np.uint32)), (n_tok, t)
