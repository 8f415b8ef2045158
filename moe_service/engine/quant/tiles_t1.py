"""One-token (T = 1) weight sides of the AVX2 one-item tile over the GGUF blocks
(:data:`T1_SIDES`, which table.py hands to tiles_k._tilek_codegen): other steps to the same integer lanes as tiles_k's weight sides, for the
decode step's matvecs only (the multi-item and unpacked tiles keep tiles_k's sides, whose
code this leaves as it was).

Q2_K (the down experts of the UD-IQ2_XXS files): the pair-lane scales by in-lane shuffles
(tiles_k._scales16: each 16-lane half one vpshufb of the scales duplicated to both 128-bit
lanes, where the plain shuffle took a vpshufb and a vpermq per half); the same values, so
the same results bit for bit. Measured on Zen 3, one thread, T = 1, 128 rows x 2048 hot in
L2, CPU time, best of 200 calls x 5, main and this alternated twice: 1.485 -> 1.405 ns per 32
weights (-5%). The same for Q6_K measured 1.52 -> 1.49 / 1.57 (no gain, not taken).

Tried for IQ2_XXS (the gate/up experts, the larger part of a UD-IQ2_XXS MoE layer's decode
step) and dropped, both bit for bit right but slower (Zen 3, one thread, 32 rows x 7168 hot,
main 2.99-3.16 ns per 32 weights): one 256 KiB table of every grid entry under every sign
pattern, indexed by one BMI2 pext of the sub-block's word (grid byte | ksigns index << 8),
the signed values through vpsignb + vpabsb: 3.36 ns (the table lives in L2, ~29 L1 misses a
super-block), 5.14 with the index by shifts; the signs applied to the grid words in general
registers, (g ^ m) + (m & 0x01..01) with m from a 1 KiB table of byte masks: 4.2-5.3 ns
(docs/v3-decode-notes.md).
"""

from __future__ import annotations

from llvmlite import ir

from moe_service.engine.quant.ir import _I8, _I16, _ldv, _vt
from moe_service.engine.quant.tiles_k import _q2_k_pieces, _scales16_in_lane
from moe_service.formats import BY_NAME


def _q2_k_t1(builder, f, o):
    """Q2_K at T = 1: tiles_k's Q2_K side with the pair-lane scales (lane m of piece g: scale
    4 g + m // 8 of the 16 low nibbles) by in-lane shuffles; LLVM drops the side's own
    shuffles, which nothing reads."""
    wk = _q2_k_pieces(builder, f, o)
    sb = _ldv(builder, o, f.off("scales"), _vt(_I8, 16))
    sc16 = builder.zext(builder.and_(sb, ir.Constant(_vt(_I8, 16), [15] * 16)), _vt(_I16, 16))
    return wk._replace(scales=_scales16_in_lane(builder, sc16))


T1_SIDES = {BY_NAME["Q2_K"].type_id: _q2_k_t1}
"""Format id -> its one-token weight side (builder, f, o) -> tiles_k.KPieces."""
