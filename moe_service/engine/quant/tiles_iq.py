"""The AVX2 multi-item matmul of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S): each weight row unpacked once into a scratch buffer, then dotted with the
items in tiles of 8, 4, 2, 1 (ladder.tile_ladder; see tiles_k.py's "Unpacked rows" section). The
results equal those of the tiles over the GGUF blocks bit for bit (the same int32 lanes, the same float
steps); table.py's kernels take this path from tiles_k.UNPACKED_MIN_ITEMS items on."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from moe_service.engine.quant.ir import _JIT, _JIT_INLINE, _VNNI
from moe_service.engine.quant.ladder import tile_ladder
from moe_service.engine.quant.tiles_k import (
    UNPACKED_BLOCK_BYTES,
    UNPACKED_MIN_ITEMS,
    _tilek_codegen,
    _unpack_row_codegen,
)
from moe_service.formats import BY_NAME

_Q2_K = BY_NAME["Q2_K"].type_id

Q2_K_UNPACKED_MIN_ITEMS = 48
"""AVX-512 (VNNI): Q2_K (in tiles_k.UNPACKED there) unpacks its rows from this many items.
Measured (Sapphire Rapids-class Xeon, one thread, 256 x 2048 hot, ns per 32 weights per
token, 4-row tiles over the blocks -> unpacked rows): T=64 0.466 -> 0.424, T=128 0.469 ->
0.407; not faster: T=16 0.469 -> 0.480, T=8 0.468 -> 0.566, T=3 0.761 -> 0.928."""


@njit(**_JIT_INLINE)
def takes_unpacked(fmt, n_items):
    """Whether a matmul of UNPACKED format ``fmt`` over n_items items unpacks its rows first: from
    UNPACKED_MIN_ITEMS items on, except 4 and 8, which the tiles over the blocks cover in one
    tile (one unpacking per row either way; measured there, Zen 3, one thread, ns per 32
    weights per token main -> unpacked: IQ2_S T=4 1.47 -> 1.70, IQ3_S T=8 1.31 -> 1.40, IQ1_S
    T=8 1.30 -> 1.19: the old tiles, mostly). 3, 5-7 and 9 or more items take two tiles or
    more, and there the unpacked path wins (IQ2_XS T=3 2.38 -> 1.59, T=16 1.13 -> 0.88)."""
    if _VNNI:  # 512-bit unpacked tiles: 8 items unpacked too (module docstring of tiles_iq_blocked)
        if fmt == _Q2_K:
            return n_items >= Q2_K_UNPACKED_MIN_ITEMS
        return n_items >= UNPACKED_MIN_ITEMS and n_items != 4
    return n_items >= UNPACKED_MIN_ITEMS and n_items != 4 and n_items != 8


@intrinsic
def opaque_int(typingctx, x):
    """The int64 ``x``, through an empty asm: LLVM cannot see its value. table.py's kernels of
    the UNPACKED formats pass their item count to the tiles over the blocks through it: else
    LLVM knows n_items < UNPACKED_MIN_ITEMS there, drops the larger tiles and schedules the
    one-item loop anew (measured ~8% slower at T = 1 on IQ2_XXS, Zen 3); through it, that
    path compiles as the other formats' kernels do."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.int64)
        return builder.asm(ir.FunctionType(ir.IntType(64), [ir.IntType(64)]), "", "=r,0", [v], False)

    return types.int64(x), codegen


@intrinsic
def _unpack_row(typingctx, fmt, arena, wo, rb, nb, buf):
    """buf (uint8 [>= nb x UNPACKED_BLOCK_BYTES + 64]) = the nb super-blocks of the row at byte
    ``wo`` of ``arena`` unpacked (literal ``fmt``; rb: the row stride, for the prefetch)."""
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    return types.void(fmt, arena, wo, rb, nb, buf), _unpack_row_codegen(fmt.literal_value)


@intrinsic
def _tile_unpacked(typingctx, fmt, n_w, n_a, buf, wo, rb, nb, xq, xd, xbs, a_rows, i0, o_rows, out, out_stride,
                   ocol):
    """table._tile over an unpacked row: out[o_rows[i0+t] * out_stride + ocol] = row . act[a_rows[i0+t]]
    for t < n_a (literal fmt, n_w = 1, n_a; buf as _unpack_row left it, wo = rb = 0)."""
    for v in (fmt, n_w, n_a):
        if not isinstance(v, types.IntegerLiteral):
            return None
    sig = types.void(fmt, n_w, n_a, buf, wo, rb, nb, xq, xd, xbs, a_rows, i0, o_rows, out, out_stride, ocol)
    return sig, _tilek_codegen(fmt.literal_value, n_w.literal_value, n_a.literal_value, unpacked=True)


@njit(**_JIT)
def mmq_unpacked(fmt, arena, w_off, row_bytes_, nb, row_lo, row_hi, xq, xd, xbs, a_rows, o_rows, n_items, out,
                 out_stride, out_col):
    """table._mmq for an UNPACKED format (literal ``fmt``): rows [row_lo, row_hi) of nb
    super-blocks at byte ``w_off + r * row_bytes_`` of ``arena``, each unpacked once, x the
    n_items items (Q8_K values xq, scales xd, 16-sums xbs; a_rows / o_rows as matmul_rows)."""
    buf = np.empty(nb * UNPACKED_BLOCK_BYTES + 64, np.uint8)
    for r in range(row_lo, row_hi):
        _unpack_row(fmt, arena, w_off + r * row_bytes_, row_bytes_, nb, buf)
        tile_ladder(_tile_unpacked, True, fmt, 1, buf, 0, 0, nb, xq, xd, xbs, a_rows, o_rows, n_items, out,
                    out_stride, out_col + r)
