"""The unpacked multi-item matmul of the grid i-quants (tiles_iq.mmq_unpacked) in
row x item blocks, for more items than one item block: the i-quant counterpart of
table._mmq_blocked (the K-quants' blocking, itself ggml's 16 x 16 blocking of its mul_mat,
ggml-cpu.c, in byte-sized blocks).

Row by row, every unpacked row is dotted with all the items, so all their Q8_K activations
(292 bytes per 256 elements: 8,176 bytes a row at DeepSeek-V3's 7,168 columns) pass through
L2 once per weight row. A V3-shaped prefill step routes ~64 tokens to an expert (128 tokens x
8 of 16 experts), 523 KB of gate/up activations against a 512 KiB L2, so every weight row
read them from L3. In blocks: a block of rows is unpacked (_UNPACKED_ROW_BLOCK_BYTES of
unpacked rows, tiles_k.UNPACKED_BLOCK_BYTES per super-block), then each item block
(_ITEM_BLOCK_BYTES of activations) passes over all of the block's rows while it stays in L2.

Inside a row block the tiles are 2 unpacked rows x 4 items (_TILE_ROWS, 4 x 4 on AVX-512;
tiles_k's unpacked tile takes up to UNPACKED_ROWS_MAX rows): one read of an item's
activations serves two (four) rows.
Every row is still unpacked once, and every (row, item) keeps its int32 lanes and float
steps whatever its tile: the same results bit for bit as row by row
(tests/moe_service/engine/quant/test_iq_blocked.py).

Measured (AMD EPYC Zen 3, one thread, CPU time, IQ2_XXS, 512 rows, ns per 32 weights per
item, row by row -> blocked 1 x 8 -> blocked 2 x 4; docs/v3-prefill-notes.md, round 3):
7168 columns x 64 items 0.758 -> 0.711 -> 0.663, x 128 0.862 -> 0.772 -> 0.697, 2048 x 64
0.703 -> 0.693 -> 0.641. DeepSeek-V3-shaped prefill at 512 tokens (bench.layer_parts, one
thread, CPU clock): the experts -9.5%.

On AVX-512 (VNNI) every unpacked matmul takes the blocks, one item block included: its
512-bit 2 x 4 tiles beat the 1 x 8 row by row there (Sapphire Rapids-class Xeon, one thread,
IQ1_S 256 x 2048 hot, ns per 32 weights per token: T=16 0.683 -> 0.531, T=32 0.651 -> 0.478).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine.quant.ir import _JIT, _JIT_INLINE, _VNNI
from moe_service.engine.quant.ladder import tile_ladder_range
from moe_service.engine.quant.tiles_iq import _tile_unpacked, _unpack_row, mmq_unpacked
from moe_service.engine.quant.tiles_k import UNPACKED_BLOCK_BYTES
from moe_service.numa import l2_cache_bytes

_L2_BYTES = min(max(l2_cache_bytes(), 256 << 10), 2 << 20)
"""This host's L2 (numa.l2_cache_bytes, clamped to 256 KiB..2 MiB), which the blocks below are
sized from: a quarter of it for the item block, 5/16 for the row block, which on a 512 KiB L2
(AMD Zen 3: where they were measured first) are 128 and 160 KiB. On a 2 MiB L2
(Sapphire Rapids-class Xeon, one thread, hot, ns per 32 weights per item, 128 / 160 KiB ->
512 / 640 KiB blocks): IQ2_XXS 7,168 columns x 64 items 0.379 -> 0.353; Q6_K's unpacked rows
(tiles_q6_unpacked) 16,384 x 128 0.447 -> 0.364, 7,168 x 128 0.395 -> 0.384. A compile-time
constant of the kernels: the engine's kernel cache folder is keyed by it (engine/__init__.py)."""

_ITEM_BLOCK_BYTES = _L2_BYTES // 4
"""Activation bytes (Q8_K: 292 per 256 elements) of one item block."""

_UNPACKED_ROW_BLOCK_BYTES = _L2_BYTES * 5 // 16
"""Unpacked-row bytes (UNPACKED_BLOCK_BYTES per super-block) of one row block."""

_TILE_ROWS = 4 if _VNNI else 2
"""Unpacked rows per tile in a row block: 2 (x 4 items: each read of an item's activations
serves two rows) or 1 (x 8 items, as row by row); AVX-512, 4 x 4 (32 zmm registers hold the
16 accumulators; Sapphire Rapids-class Xeon, one thread, hot, ns per 32 weights per token,
2 x 4 -> 4 x 4: IQ2_XXS 7,168 columns T=64 0.410 -> 0.334, T=16 0.501 -> 0.428; IQ1_S 7,168
T=64 0.456 -> 0.396; Q2_K 7,168 T=64 0.456 -> 0.391; 2,048 columns T=64 IQ2_XXS 0.332 ->
0.337, IQ1_S 0.431 -> 0.391)."""

_Q8K_BLOCK_BYTES = 292
"""Bytes of one Q8_K block (256 int8 values, a float32 scale, 16 int16 sums)."""


@njit(**_JIT_INLINE)
def item_block(nb):
    """Items per block at nb super-blocks a row: a multiple of 8, at least 8."""
    return max(8, _ITEM_BLOCK_BYTES // (nb * _Q8K_BLOCK_BYTES) // 8 * 8)


@njit(**_JIT)
def mmq_unpacked_blocked(
    fmt,
    arena,
    w_off,
    row_bytes_,
    nb,
    row_lo,
    row_hi,
    xq,
    xd,
    xbs,
    a_rows,
    o_rows,
    n_items,
    out,
    out_stride,
    out_col,
):
    """tiles_iq.mmq_unpacked (same arguments, literal ``fmt``) in row x item blocks (module
    docstring) when the items outgrow one item block; else row by row as there."""
    ib = item_block(nb)
    if n_items <= ib and not _VNNI:  # AVX-512: 2 x 4 tiles below one item block too (tiles_k's section)
        mmq_unpacked(
            fmt,
            arena,
            w_off,
            row_bytes_,
            nb,
            row_lo,
            row_hi,
            xq,
            xd,
            xbs,
            a_rows,
            o_rows,
            n_items,
            out,
            out_stride,
            out_col,
        )
        return
    blocked(
        fmt,
        _TILE_ROWS,
        arena,
        w_off,
        row_bytes_,
        nb,
        row_lo,
        row_hi,
        xq,
        xd,
        xbs,
        a_rows,
        o_rows,
        n_items,
        out,
        out_stride,
        out_col,
        ib,
    )


@njit(**_JIT)
def blocked(
    fmt,
    tile_rows,
    arena,
    w_off,
    row_bytes_,
    nb,
    row_lo,
    row_hi,
    xq,
    xd,
    xbs,
    a_rows,
    o_rows,
    n_items,
    out,
    out_stride,
    out_col,
    ib,
):
    """mmq_unpacked_blocked's blocks (items in blocks of ``ib``, a multiple of 8), the block's
    rows in tiles of ``tile_rows`` (4 or 2: x 4 items, else 1 x 8) rows."""
    rblk = max(1, _UNPACKED_ROW_BLOCK_BYTES // (nb * UNPACKED_BLOCK_BYTES))
    row_item_blocks(
        _unpack_row,
        _tile_unpacked,
        fmt,
        tile_rows,
        arena,
        w_off,
        row_bytes_,
        nb,
        row_lo,
        row_hi,
        xq,
        xd,
        xbs,
        a_rows,
        o_rows,
        n_items,
        out,
        out_stride,
        out_col,
        rblk,
        ib,
    )


@njit(**_JIT_INLINE)
def row_item_blocks(
    unpack,
    tile,
    fmt,
    tile_rows,
    arena,
    w_off,
    row_bytes_,
    nb,
    row_lo,
    row_hi,
    xq,
    xd,
    xbs,
    a_rows,
    o_rows,
    n_items,
    out,
    out_stride,
    out_col,
    rblk,
    ib,
):
    """The row x item block loop of an unpacked multi-item matmul (module docstring), for any
    unpacked layout: rows [row_lo, row_hi) in blocks of ``rblk`` rows, each row unpacked once by
    ``unpack(fmt, arena, wo, row_bytes_, nb, buf)`` into its slot of one row block's scratch
    (nb * UNPACKED_BLOCK_BYTES bytes a row), then every block of ``ib`` items (a multiple of 8)
    over the block's rows in ladder tiles ``tile`` (literal ``fmt``) of ``tile_rows`` rows (4, AVX-512
    only, or 2: x 4 items, then 2-row and 1 x 8 tiles for the rows left; else 1 x 8). Used by
    tiles_iq's grid i-quants (blocked) and tiles_q6_unpacked's Q6_K."""
    ub = nb * UNPACKED_BLOCK_BYTES  # a multiple of 64: each row's slot keeps the buffer's alignment
    buf = np.empty(min(rblk, max(1, row_hi - row_lo)) * ub + 64, np.uint8)
    for r0 in range(row_lo, row_hi, rblk):
        r1 = min(row_hi, r0 + rblk)
        for r in range(r0, r1):
            unpack(fmt, arena, w_off + r * row_bytes_, row_bytes_, nb, buf[(r - r0) * ub :])
        for i0 in range(0, n_items, ib):
            i1 = min(n_items, i0 + ib)
            r = r0
            if _VNNI and tile_rows == 4:  # _VNNI a constant: numba prunes the 4-row tiles on AVX2
                r = _row_tiles(tile, False, fmt, 4, buf, r, r0, r1, ub, nb, xq, xd, xbs, a_rows, o_rows, i0, i1, out,
                               out_stride, out_col)
            if tile_rows >= 2:
                r = _row_tiles(tile, False, fmt, 2, buf, r, r0, r1, ub, nb, xq, xd, xbs, a_rows, o_rows, i0, i1, out,
                               out_stride, out_col)
            _row_tiles(tile, True, fmt, 1, buf, r, r0, r1, ub, nb, xq, xd, xbs, a_rows, o_rows, i0, i1, out,
                       out_stride, out_col)


@njit(**_JIT_INLINE)
def _row_tiles(tile, a8, fmt, n_w, buf, r, r0, r1, ub, nb, xq, xd, xbs, a_rows, o_rows, i0, i1, out,
               out_stride, out_col):
    """row_item_blocks' tiles of ``n_w`` (literal) unpacked rows from row r of the row block
    [r0, r1) while n_w rows remain, over items [i0, i1) in tile_ladder_range's tiles (``a8``: from
    8 items; one row takes them, several rows from 4); returns the first row left. Rows are ub
    bytes apart; the tile aligns buf + wo up to 64 bytes as the unpack aligned buf[wo:]."""
    while r + n_w <= r1:
        tile_ladder_range(
            tile, a8, fmt, n_w, buf, (r - r0) * ub, ub, nb, xq, xd, xbs, a_rows, o_rows, i0, i1, out, out_stride,
            out_col + r,
        )  # fmt: skip
        r += n_w
    return r
