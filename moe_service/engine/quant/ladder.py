"""The item ladder shared by the tile drivers: one weight row group x every item, in tiles of
8, 4, 2 and 1 items. The tile is a compile-time choice: a numba intrinsic passed as a
first-class function argument (table._tile over the GGUF blocks, tiles_iq._tile_unpacked over
an unpacked row), so both drivers compile the same ladder with their own tile inlined."""

from __future__ import annotations

from numba import njit

from moe_service.engine.quant.ir import _JIT_INLINE


@njit(**_JIT_INLINE)
def tile_ladder(
    tile, a8, fmt, n_w, arena, wo, rb, nb, xq, xd, xaux, a_rows, o_rows, n_items, out, out_stride, ocol
):
    """Rows ``n_w`` (literal) at byte ``wo`` of ``arena`` (stride rb, nb blocks) x the n_items
    items: ``tile(fmt, n_w, n_a, arena, wo, rb, nb, xq, xd, xaux, a_rows, i0, o_rows, out,
    out_stride, ocol)`` for n_a = 8 (while ``a8``, a constant), 4, 2, 1 items from item i0
    (table._tile's contract: out[o_rows[i0 + t] * out_stride + ocol + k] = W[k] . act[a_rows[i0 + t]])."""
    tile_ladder_range(
        tile, a8, fmt, n_w, arena, wo, rb, nb, xq, xd, xaux, a_rows, o_rows, 0, n_items, out, out_stride, ocol
    )


@njit(**_JIT_INLINE)
def tile_ladder_range(
    tile, a8, fmt, n_w, arena, wo, rb, nb, xq, xd, xaux, a_rows, o_rows, i_lo, i_hi, out, out_stride, ocol
):
    """tile_ladder over the items [i_lo, i_hi) only: the same tiles as tile_ladder's for those
    items when i_lo is a multiple of 8 and i_hi one or the item count (table._mmq's item blocks)."""
    i = i_lo
    if a8:
        while i + 8 <= i_hi:
            tile(fmt, n_w, 8, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)
            i += 8
    while i + 4 <= i_hi:
        tile(fmt, n_w, 4, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)
        i += 4
    if i + 2 <= i_hi:
        tile(fmt, n_w, 2, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)
        i += 2
    if i < i_hi:
        tile(fmt, n_w, 1, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)
