"""Q6_K's multi-item matmul over unpacked rows (AVX2, AVX-512 VNNI) in row x item blocks: the Q6_K
counterpart of tiles_iq_blocked.py (the grid i-quants), for the column counts where it
measures faster than table._mmq / table._mmq_blocked (``takes_q6_unpacked``).

A row block (tiles_iq_blocked._UNPACKED_ROW_BLOCK_BYTES of unpacked rows) is unpacked once:
per super-block the 256 unsigned 6-bit values (0..63, the low 4 bits of ql and the 2 of qh
as ggml's dequantize_row_q6_K / ggml_vec_dot_q6_K_q8_K pair them), the 4 x 32 int16 pair-lane
scales, Q6_K's -32 offset times the 16 scales (int16) and d, as tiles_k._q6_k_pieces makes
them (tiles_k.KPieces). Then each item block passes over the block's rows in tiles of 2 rows x
4 items (a read of an item's Q8_K values serves two rows; the last odd row in 1 x 8 tiles).
Each (row, item) keeps the int32 lanes of tiles_k's Q6_K tile (-32 x (scales . Q8_K 16-sums),
plus the scale-weighted vpmaddubsw pair sums of the unsigned values x the int8 activations)
and its float steps (per super-block fma of the lanes by d_w x d_x, the same lane tree): the
same results bit for bit as the tiles over the GGUF blocks
(tests/moe_service/engine/quant/test_q6_unpacked.py).

Scratch layout per super-block (tiles_k.UNPACKED_BLOCK_BYTES = 640 bytes, 64-byte aligned):
256 uint8 values in element order | 4 x 32 int16 pair-lane scales | 16 int16 offsets (-32 x
scale) | 32 bytes unused | 2 float32 [d, unused] | 56 bytes unused.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from moe_service.engine.quant.ir import (
    _F32,
    _I8,
    _I16,
    _I32,
    _JIT,
    _JIT_INLINE,
    _VI,
    _VNNI,
    _call,
    _cat,
    _ci,
    _concat,
    _data,
    _dot_scaled512,
    _i64,
    _ldv,
    _madd,
    _maddubs,
    _shuf,
    _store_rows,
    _tile_args,
    _tree8_many,
    _vt,
)
from moe_service.engine.quant.tiles_iq_blocked import _UNPACKED_ROW_BLOCK_BYTES, item_block, row_item_blocks
from moe_service.engine.quant.tiles_k import UNPACKED_BLOCK_BYTES, _align64, _kq_pieces, _opaque, _stv
from moe_service.formats import BY_NAME, FORMATS, QK_K

Q6_K = BY_NAME["Q6_K"].type_id
"""GGML type id of Q6_K."""

Q6_UNPACKED = frozenset((Q6_K,))
"""Formats with this module's path: Q6_K (AVX-512 VNNI: the dot in 512-bit steps, ir._dot_scaled512)."""

_U_W, _U_SC, _U_OFF, _U_D2 = 0, 256, 512, 576
"""Byte offsets in an unpacked super-block (module docstring)."""

Q6_UNPACKED_NB = (6, 16, 64)
"""Super-blocks per row (256 columns each) that takes_q6_unpacked routes here: 1,536, 4,096
and 16,384 columns (DeepSeek-V3's attn_q_b and attn_output are 1,536 and 16,384)."""

Q6_UNPACKED_ITEMS = (64, 128)
"""Item counts [lo, hi] that takes_q6_unpacked routes here (a prefill step's 128 tokens,
bench.layer_parts' default --ubatch, and its shorter last step down to 64)."""


Q6_UNPACKED_VNNI_MIN_ITEMS = 96
"""AVX-512 (VNNI): takes_q6_unpacked routes every row length here from this many items (a
128-token prefill step). Measured (Sapphire Rapids-class Xeon, 2 MiB L2, one thread, CPU time,
4-row tiles -> unpacked, ns per 32 weights per item, ROWS:COLS:ITEMS, digests equal,
bench/q6k_unpacked_ab.py): 512:1536:128 0.412 -> 0.355, 512:2048:128 0.404 -> 0.349,
512:7168:128 0.414 -> 0.384, 512:16384:128 0.422 -> 0.364, 512:18432:128 0.440 -> 0.418,
512:512:128 0.439 -> 0.409, 512:7168:64 0.399 -> 0.357; not faster: 512:16384:64 0.407 ->
0.424, 512:7168:32 0.411 -> 0.440, 512:1536:32 0.408 -> 0.406, 512:7168:16 0.395 -> 0.470."""


@njit(**_JIT_INLINE)
def takes_q6_unpacked(nb, n_items):
    """Whether table.py's Q6_K kernel takes mmq_q6_unpacked for n_items items x rows of nb
    super-blocks: AVX-512, from Q6_UNPACKED_VNNI_MIN_ITEMS items; AVX2, nb in Q6_UNPACKED_NB
    and n_items in Q6_UNPACKED_ITEMS, where it measured
    faster; everything else keeps table._mmq / _mmq_blocked. Measured (AMD EPYC Zen 3, one
    thread, CPU time, host shared with a test run, load 4-5, table._mmq -> mmq_q6_unpacked,
    ns per 32 weights per item, best of 5, ROWS:COLS:ITEMS, digests equal;
    bench/q6k_unpacked_ab.py): 512:1536:128 0.755 -> 0.690, 512:16384:128 0.982 -> 0.844 (0.917 -> 0.791 in another run), 512:16384:64 0.959 -> 0.897, 512:4096:64 0.931 ->
    0.828; not faster: 512:1536:32 0.775 -> 0.769, 512:1536:16 0.850 -> 0.919, 512:16384:16
    0.944 -> 0.932, 512:7168:64 0.758 -> 0.782, 512:7168:128 0.706 -> 0.826, 512:18432:64
    0.810 -> 0.847, 128:16384:512 1.126 -> 1.136, 128:7168:512 0.817 -> 1.084."""
    if _VNNI:
        return n_items >= Q6_UNPACKED_VNNI_MIN_ITEMS
    if n_items < Q6_UNPACKED_ITEMS[0] or n_items > Q6_UNPACKED_ITEMS[1]:
        return False
    for s in Q6_UNPACKED_NB:
        if nb == s:
            return True
    return False


@njit(**_JIT_INLINE)
def row_block(nb):
    """Rows per row block of mmq_q6_unpacked at nb super-blocks a row: the most whose unpacked
    rows fit _UNPACKED_ROW_BLOCK_BYTES, at least 1 (as tiles_iq_blocked). Rounding it to an
    even count (no row of a block left to 1 x 8 tiles) measured within the noise at 7,168 and
    18,432 columns (shared host)."""
    return max(1, _UNPACKED_ROW_BLOCK_BYTES // (nb * UNPACKED_BLOCK_BYTES))


def _unpack_q6_codegen(context, builder, sig, args):
    """Codegen of _unpack_q6: (fmt, arena, wo, rb, nb, buf); fmt and rb unused."""
    ty = sig.args
    wo, nb = _i64(context, builder, args[2], ty[2]), _i64(context, builder, args[4], ty[4])
    base = builder.bitcast(_data(context, builder, ty[1], args[1]), _I8.as_pointer())
    row = builder.gep(base, [wo])
    out = _align64(builder, builder.bitcast(_data(context, builder, ty[5], args[5]), _I8.as_pointer()))
    bbytes = FORMATS[Q6_K].block_bytes
    with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        wk = _kq_pieces(builder, Q6_K, builder.gep(row, [builder.mul(b, _ci(bbytes))]))
        dst = builder.gep(out, [builder.mul(b, _ci(UNPACKED_BLOCK_BYTES))])
        for g in range(4):
            _stv(builder, dst, _U_W + 64 * g, wk.pieces[g])
            _stv(builder, dst, _U_SC + 64 * g, wk.scales[g])
        _stv(builder, dst, _U_OFF, wk.offset)
        _stv(builder, dst, _U_D2, wk.d2)
    return context.get_dummy_value()


@intrinsic
def _unpack_q6(typingctx, fmt, arena, wo, rb, nb, buf):
    """buf (uint8 [>= nb x UNPACKED_BLOCK_BYTES + 64], written from its first 64-byte aligned
    byte) = the nb Q6_K super-blocks of the row at byte ``wo`` of ``arena``, unpacked
    (tiles_iq._unpack_row's arguments, for tiles_iq_blocked.row_item_blocks: fmt is Q6_K, the
    row stride rb is not used)."""
    return types.void(fmt, arena, wo, rb, nb, buf), _unpack_q6_codegen


def _tile_q6_codegen(n_w, n_a):
    """Codegen of the _tile_q6 tile of n_w unpacked rows (ub bytes apart) x n_a items."""
    n_pk = (n_a + 1) // 2  # accumulators per row: items packed two per <16 x float>

    def codegen(context, builder, sig, args):
        ub, nb, i0, ostride, ocol, xq8, xd32, x3, orow, outp, wrow, arows = _tile_args(
            context, builder, sig, args, n_w, n_a
        )
        xbs8 = builder.bitcast(x3, _I8.as_pointer())
        wrow = [_align64(builder, w) for w in wrow]
        xq_t = [builder.gep(xq8, [builder.mul(a, builder.mul(nb, _ci(QK_K)))]) for a in arows]
        xd_t = [builder.gep(xd32, [builder.mul(a, nb)]) for a in arows]
        xbs_t = [builder.gep(xbs8, [builder.mul(a, builder.mul(nb, _ci(32)))]) for a in arows]
        acc_ty = [_vt(_F32, 16 if 2 * p + 1 < n_a else 8) for p in range(n_pk)]
        accs = [[cgutils.alloca_once(builder, acc_ty[p]) for p in range(n_pk)] for _ in range(n_w)]
        for acc in accs:
            for p in range(n_pk):
                builder.store(ir.Constant(acc_ty[p], [0.0] * acc_ty[p].count), acc[p])
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            aoff = builder.mul(b, _ci(QK_K))
            yd = (
                _cat(
                    builder,
                    [
                        builder.insert_element(
                            ir.Constant(_vt(_F32, 1), None),
                            builder.load(builder.gep(xd_t[t], [b])),
                            ir.Constant(_I32, 0),
                        )
                        for t in range(n_a)
                    ],
                )
                if n_a > 1
                else builder.insert_element(
                    ir.Constant(_vt(_F32, 1), None),
                    builder.load(builder.gep(xd_t[0], [b])),
                    ir.Constant(_I32, 0),
                )
            )
            bs = [_ldv(builder, xbs_t[t], builder.mul(b, _ci(32)), _vt(_I16, 16)) for t in range(n_a)]
            wbs = [builder.gep(wrow[k], [builder.mul(b, _ci(UNPACKED_BLOCK_BYTES))]) for k in range(n_w)]
            # lanes start from -32 x (scales . Q8_K 16-sums), as tiles_k's Q6_K tile
            iaccs = [
                [_madd(builder, _ldv(builder, wbs[k], _U_OFF, _vt(_I16, 16)), bs[t]) for t in range(n_a)]
                for k in range(n_w)
            ]
            if _VNNI:  # 16 lanes (lane j: elements 4 j .. + 3), folded below as tiles_k._kq_dot's VNNI form
                iaccs = [[_concat(builder, v, ir.Constant(_VI, [0] * 8)) for v in row] for row in iaccs]
            for t in range(n_a):  # item-major, the rows' values and scales as memory operands
                ots = [_opaque(builder, wb) for wb in wbs]  # fresh pointers per item: LLVM reloads them
                for g in range(4):
                    a64 = _ldv(builder, xq_t[t], builder.add(aoff, _ci(64 * g)), _vt(_I8, 64))
                    for k in range(n_w):
                        w64 = _ldv(builder, ots[k], _U_W + 64 * g, _vt(_I8, 64))
                        sc = _ldv(builder, ots[k], _U_SC + 64 * g, _vt(_I16, 32))
                        if _VNNI:
                            iaccs[k][t] = _dot_scaled512(builder, w64, a64, sc, iaccs[k][t])
                            continue
                        halves = []
                        for h in range(2):  # tiles_k._kq_dot's AVX2 lanes: unsigned w x signed a
                            w = _shuf(builder, w64, range(32 * h, 32 * h + 32))
                            a = _shuf(builder, a64, range(32 * h, 32 * h + 32))
                            halves.append(
                                _madd(
                                    builder,
                                    _maddubs(builder, w, a),
                                    _shuf(builder, sc, range(16 * h, 16 * h + 16)),
                                )
                            )
                        iaccs[k][t] = builder.add(iaccs[k][t], builder.add(halves[0], halves[1]))
            if _VNNI:
                iaccs = [[builder.add(_shuf(builder, v, range(8)), _shuf(builder, v, range(8, 16))) for v in row]
                         for row in iaccs]
            for k in range(n_w):
                d2 = _ldv(builder, wbs[k], _U_D2, _vt(_F32, 2))
                dsc = builder.fmul(_shuf(builder, d2, [0] * n_a), yd)  # d_w * d_x per item
                for p in range(n_pk):
                    two = 2 * p + 1 < n_a
                    li = _concat(builder, iaccs[k][2 * p], iaccs[k][2 * p + 1]) if two else iaccs[k][2 * p]
                    s = _shuf(builder, dsc, [2 * p] * 8 + ([2 * p + 1] * 8 if two else []))
                    fl = builder.sitofp(li, acc_ty[p])
                    old = builder.load(accs[k][p])
                    name = "llvm.fma.v16f32" if two else "llvm.fma.v8f32"
                    builder.store(_call(builder, name, acc_ty[p], [fl, s, old]), accs[k][p])
        vecs, ids = [], []
        for k in range(n_w):
            for p in range(n_pk):
                vecs.append(builder.load(accs[k][p]))
                ids.append(((k, 2 * p), (k, 2 * p + 1)) if 2 * p + 1 < n_a else ((k, 2 * p),))
        sums, lane = _tree8_many(builder, vecs, ids)
        res = _shuf(builder, sums, [lane[(k, t)] for t in range(n_a) for k in range(n_w)])
        _store_rows(builder, outp, orow, i0, ostride, ocol, res, n_w, n_a)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _tile_q6(
    typingctx, fmt, n_w, n_a, buf, wo, ub, nb, xq, xd, xbs, a_rows, i0, o_rows, out, out_stride, ocol
):
    """out[o_rows[i0+t] * out_stride + ocol + k] = row k . act[a_rows[i0+t]] for k < n_w, t < n_a
    (literals; fmt Q6_K), row k the unpacked row at byte wo + k * ub of buf (_unpack_q6's
    layout, each slot aligned up to 64 bytes as _unpack_q6 aligned it): ladder's tile contract."""
    for v in (fmt, n_w, n_a):
        if not isinstance(v, types.IntegerLiteral):
            return None
    if fmt.literal_value != Q6_K or n_w.literal_value > 2:
        return None
    sig = types.void(fmt, n_w, n_a, buf, wo, ub, nb, xq, xd, xbs, a_rows, i0, o_rows, out, out_stride, ocol)
    return sig, _tile_q6_codegen(n_w.literal_value, n_a.literal_value)


@njit(**_JIT)
def mmq_q6_unpacked(
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
    """table._mmq for Q6_K through unpacked rows: rows [row_lo, row_hi) of nb super-blocks at
    byte ``w_off + r * row_bytes_`` of ``arena`` (uint8) x the n_items items (Q8_K values xq
    int8, scales xd float32, 16-sums xbs int16; a_rows / o_rows int64 as table.matmul_rows),
    out (float32) [o_rows[i] * out_stride + out_col + r]. Row blocks of
    _UNPACKED_ROW_BLOCK_BYTES unpacked once, x item blocks of item_block(nb) items (a multiple
    of 8), 2 rows x 4 items per tile (module docstring). Scratch: one row block (<= 160 KiB)."""
    q6_blocked(
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
        row_block(nb),
        item_block(nb),
    )


@njit(**_JIT_INLINE)
def q6_blocked(
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
    """mmq_q6_unpacked's blocks of ``rblk`` rows x ``ib`` items (a multiple of 8; bench/unpacked_ab.py
    tries other sizes through it)."""
    row_item_blocks(
        _unpack_q6,
        _tile_q6,
        Q6_K,
        2,
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
