"""Tile kernels of the K-quants (super-blocks of 256 x Q8_K): LLVM IR for R weight rows x A
activation rows per pass (see the section comment). A format of this family is its
declaration in formats.py plus its weight side, a ``@_weight_side`` function
(the super-block's values, scales, mins or offset, and d, as ``KPieces``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba.core import cgutils

from moe_service.engine.quant import codebooks
from moe_service.engine.quant.ir import (
    _F32,
    _I8,
    _I16,
    _I32,
    _I64,
    _PF_MIN_K,
    _VI,
    _VNNI,
    _abs8,
    _call,
    _cat,
    _ci,
    _concat,
    _cvec,
    _data,
    _dot_scaled512,
    _i64,
    _ldv,
    _madd,
    _maddubs,
    _pf_distance,
    _prefetch,
    _shuf,
    _sign8,
    _slot_fields,
    _store_rows,
    _tile_args,
    _tree8_many,
    _vt,
)
from moe_service.formats import BY_NAME, FORMATS, IQ4NL_KVALUES, QK_K

# ---------------------------------------------------------------------------------------
# Tile kernels of the K-quants (Q2_K .. Q6_K, IQ4_XS, the i-quants x Q8_K): R weight rows x A items per pass
# ---------------------------------------------------------------------------------------
# Per super-block (256 elements) and (row, item): an int32 accumulator of 16 lanes takes
# four 64-element pieces, each vpmaddubsw (unsigned weights x activation -> int16 pairs)
# then vpdpwssd / vpmaddwd+vpaddd with the int16 sub-block scales; lanes k and k + 8 are
# then folded (exact), so lane k holds the same integer as ggml's AVX2 kernel's lane k.
# Q6_K's -32 offset (Q3_K's -4) enters as -32 * (16 scales . 16 Q8_K sums) in lanes 0..7,
# and Q4_K / Q5_K's mins as sum_j min_j * (bsums[2j] + bsums[2j+1]) (Q2_K: one min per 16
# elements, sum_j min_j * bsums[j]) (exact int32 dots). IQ4_XS's values are signed: they go
# through the sign trick (_kq_dot).
# Float part, in the one-row order: acc = fma(float(lanes), d_w * d_x, acc) per
# super-block (8 lanes; on AVX-512 two items share one zmm), mins = mins + ((dmin_w * d_x) *
# float(min dot)), result = tree sum of acc - mins.


_PIECES: dict = {}
"""K-quant format id -> its weight-side function (builder, f, o) -> KPieces."""


class KPieces(NamedTuple):
    """Weight side of one super-block: ``pieces`` 4 x <64 x i8> (elements 64g..64g+63:
    unsigned values, or signed ones when the format is ``signed``), ``scales`` 4 x <32 x
    i16> (the sub-block scale of each int16 pair lane), ``mins`` <16 x i16> (the min of each
    16 elements, formats with ``has_min``) or None, ``offset`` <16 x i16> (a constant offset
    of the values times the scale of each 16 elements, dotted with the Q8_K sums) or None,
    ``d2`` <2 x float> [d, dmin]; ``neg`` None, or 4 x <64 x i1>: the elements whose
    (unsigned) value is negated, applied to the activation instead (ggml's sign of q8, the
    IQ2 / IQ3 grids)."""

    pieces: list
    scales: list
    mins: object
    offset: object
    d2: object
    neg: list | None = None


def _weight_side(*names: str):
    def register(fn):
        for n in names:
            _PIECES[BY_NAME[n].type_id] = fn
        return fn

    return register


_INDICES: dict = {}
"""i-quant format id -> (its grid indices (builder, f, o) -> <lanes x i16>, lanes): the
formats whose weight side reads computed indices back through _spilled, or takes them as
``idx`` (tiles_k._IndicesAhead)."""


def _indices(name: str, lanes: int = 32):
    def register(fn):
        _INDICES[BY_NAME[name].type_id] = (fn, lanes)
        return fn

    return register


def _kq_pieces(builder, fmt, o):
    """The KPieces of the super-block at i8* o of K-quant ``fmt``."""
    return _PIECES[fmt](builder, FORMATS[fmt], o)


def _f16_pair(builder, o, off):
    """<2 x float>: the two float16 at byte offsets off and off + 2, widened exactly (one u32
    load: a lone 16-bit load becomes a vpinsrw into a live register, see ld_f16x2)."""
    return builder.fpext(builder.bitcast(_ldv(builder, o, off, _I32), _vt(ir.HalfType(), 2)), _vt(_F32, 2))


@_weight_side("Q6_K")
def _q6_k_pieces(builder, f, o):
    pieces, scl = [], []
    sc = builder.sext(_ldv(builder, o, f.off("scales"), _vt(_I8, 16)), _vt(_I16, 16))
    for g in range(4):  # groups 2g, 2g+1: ql half n = g // 2, shift by 4 * (g % 2)
        n, hi4 = g // 2, g % 2
        qh = _ldv(builder, o, f.off("qh") + 32 * n, _vt(_I8, 32))
        parts = []
        for delta in range(2):
            ql = _ldv(builder, o, f.off("ql") + 64 * n + 32 * delta, _vt(_I8, 32))
            k = 2 * hi4 + delta  # group index within its 128-element half
            lo = builder.and_(builder.lshr(ql, _cvec(_I8, [4 * hi4] * 32)), _cvec(_I8, [15] * 32))
            h2 = builder.and_(builder.lshr(qh, _cvec(_I8, [2 * k] * 32)), _cvec(_I8, [3] * 32))
            parts.append(builder.or_(lo, builder.shl(h2, _cvec(_I8, [4] * 32))))
        pieces.append(_concat(builder, parts[0], parts[1]))
        scl.append(_shuf(builder, sc, [4 * g + m // 8 for m in range(32)]))
    neg = builder.mul(sc, _cvec(_I16, [-32] * 16))
    # d: the f16 after the scales, read with the scales' last two bytes, moved to lane 0
    d2 = _f16_pair(builder, o, f.off("d") - 2)
    return KPieces(pieces, scl, None, neg, _shuf(builder, d2, [1, 0]))


@_weight_side("Q4_K", "Q5_K")
def _q45_k_pieces(builder, f, o):
    pieces, scl = [], []
    q5 = f.qh >= 0
    u = [builder.zext(_ldv(builder, o, f.off("scales") + 4 * i, _I32), _I64) for i in range(3)]
    c = lambda v: ir.Constant(_I64, v)  # noqa: E731
    sc_lo = builder.and_(u[0], c(0x3F3F3F3F))
    sc_hi = builder.or_(builder.and_(u[2], c(0x0F0F0F0F)),
                        builder.shl(builder.and_(builder.lshr(u[0], c(6)), c(0x03030303)), c(4)))
    m_lo = builder.and_(u[1], c(0x3F3F3F3F))
    m_hi = builder.or_(builder.and_(builder.lshr(u[2], c(4)), c(0x0F0F0F0F)),
                       builder.shl(builder.and_(builder.lshr(u[1], c(6)), c(0x03030303)), c(4)))
    sc8 = builder.bitcast(builder.or_(sc_lo, builder.shl(sc_hi, c(32))), _vt(_I8, 8))
    m8 = builder.bitcast(builder.or_(m_lo, builder.shl(m_hi, c(32))), _vt(_I8, 8))
    sc16 = builder.zext(sc8, _vt(_I16, 8))
    mins = builder.zext(_shuf(builder, m8, [j // 2 for j in range(16)]), _vt(_I16, 16))
    qs_off = f.qs
    qh = _ldv(builder, o, f.qh, _vt(_I8, 32)) if q5 else None
    for g in range(4):
        qs = _ldv(builder, o, qs_off + 32 * g, _vt(_I8, 32))
        if not q5:  # low nibbles | high nibbles: qs in both halves, the high half shifted by 4
            q2 = builder.bitcast(_concat(builder, qs, qs), _vt(_I16, 32))
            q2 = builder.lshr(q2, _cvec(_I16, [0] * 16 + [4] * 16))
            pieces.append(builder.and_(builder.bitcast(q2, _vt(_I8, 64)), _cvec(_I8, [15] * 64)))
            scl.append(_shuf(builder, sc16, [2 * g + m // 16 for m in range(32)]))
            continue
        lo = builder.and_(qs, _cvec(_I8, [15] * 32))
        hi = builder.lshr(qs, _cvec(_I8, [4] * 32))
        if q5:
            one = _cvec(_I8, [1] * 32)
            lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(qh, _cvec(_I8, [2 * g] * 32)), one),
                                             _cvec(_I8, [4] * 32)))
            hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(qh, _cvec(_I8, [2 * g + 1] * 32)), one),
                                             _cvec(_I8, [4] * 32)))
        pieces.append(_concat(builder, lo, hi))
        scl.append(_shuf(builder, sc16, [2 * g + m // 16 for m in range(32)]))
    return KPieces(pieces, scl, mins, None, _f16_pair(builder, o, f.off("d")))


def _split_bits(builder, v, shifts, mask):
    """<n x i8> v lshr'd by each of ``shifts`` and masked: one vector per shift."""
    n = v.type.count
    return [builder.and_(builder.lshr(v, _cvec(_I8, [sh] * n)), _cvec(_I8, [mask] * n)) for sh in shifts]


@_weight_side("Q2_K")
def _q2_k_pieces(builder, f, o):
    """Element e = 128 n + 32 j + l is bits 2j of qs[32 n + l] (0..3); each 16 elements have
    a scale byte: d * (s & 15), dmin * (s >> 4)."""
    sb = _ldv(builder, o, f.off("scales"), _vt(_I8, 16))
    sc16 = builder.zext(builder.and_(sb, _cvec(_I8, [15] * 16)), _vt(_I16, 16))
    mins = builder.zext(builder.lshr(sb, _cvec(_I8, [4] * 16)), _vt(_I16, 16))
    pieces, scl = [], []
    for g in range(4):  # piece g: half n = g // 2, shifts 2j for j = 2 (g % 2) and + 1
        qs = _ldv(builder, o, f.qs + 32 * (g // 2), _vt(_I8, 32))
        lo, hi = _split_bits(builder, qs, (4 * (g % 2), 4 * (g % 2) + 2), 3)
        pieces.append(_concat(builder, lo, hi))
        scl.append(_shuf(builder, sc16, [4 * g + m // 8 for m in range(32)]))
    return KPieces(pieces, scl, mins, None, _f16_pair(builder, o, f.off("d")))


@_weight_side("Q3_K")
def _q3_k_pieces(builder, f, o):
    """Values as unsigned q' = (2-bit low q) + 4 * (hmask bit) in 0..7, x = d * sc * (q' - 4):
    the -4 enters as -4 * (16 scales . 16 Q8_K sums), as Q6_K's -32. Scale s (6 bits, minus
    32): low nibble s // 8 of byte s % 8, high 2 bits 2 (s // 4) of byte 8 + s % 4."""
    so = f.off("scales")
    lo8 = _ldv(builder, o, so, _vt(_I8, 8))
    hi4 = _ldv(builder, o, so + 8, _vt(_I8, 4))
    lo = builder.and_(builder.lshr(_shuf(builder, lo8, list(range(8)) * 2), _cvec(_I8, [0] * 8 + [4] * 8)),
                      _cvec(_I8, [15] * 16))
    hi = builder.and_(builder.lshr(_shuf(builder, hi4, list(range(4)) * 4),
                                   _cvec(_I8, [2 * (s // 4) for s in range(16)])), _cvec(_I8, [3] * 16))
    sc6 = builder.or_(lo, builder.shl(hi, _cvec(_I8, [4] * 16)))
    sc16 = builder.sub(builder.zext(sc6, _vt(_I16, 16)), _cvec(_I16, [32] * 16))
    hm = _ldv(builder, o, f.off("hmask"), _vt(_I8, 32))
    pieces, scl = [], []
    for g in range(4):  # piece g: half n = g // 2, j = 2 (g % 2) + delta; hmask bit 4 n + j
        qs = _ldv(builder, o, f.qs + 32 * (g // 2), _vt(_I8, 32))
        parts = []
        for delta in range(2):
            j = 2 * (g % 2) + delta
            (q,) = _split_bits(builder, qs, (2 * j,), 3)
            (h,) = _split_bits(builder, hm, (4 * (g // 2) + j,), 1)
            parts.append(builder.or_(q, builder.shl(h, _cvec(_I8, [2] * 32))))
        pieces.append(_concat(builder, parts[0], parts[1]))
        scl.append(_shuf(builder, sc16, [4 * g + m // 8 for m in range(32)]))
    offset = builder.mul(sc16, _cvec(_I16, [-4] * 16))
    d2 = _f16_pair(builder, o, f.off("d") - 2)  # the scales' last two bytes and d, as Q6_K
    return KPieces(pieces, scl, None, offset, _shuf(builder, d2, [1, 1]))


def _lut16(builder, table, idx):
    """pshufb: table[idx] for <n x i8> indices 0..15 (n a multiple of 32), 32 bytes at a time."""
    n = idx.type.count
    tv = _cvec(_I8, [v & 0xFF for v in table] * 2)
    parts = [_call(builder, "llvm.x86.avx2.pshuf.b", _vt(_I8, 32), [tv, _shuf(builder, idx, range(h, h + 32))])
             for h in range(0, n, 32)]
    return _cat(builder, parts)


@_weight_side("IQ4_XS")
def _iq4_xs_pieces(builder, f, o):
    """Signed values kvalues_iq4nl[code] (-127..113); sub-block s (32 elements) has scale
    d * (ls - 32), ls = nibble s % 2 of scales_l[s // 2] | bits 2s of the u16 scales_h << 4;
    element j < 16 of a sub-block is the low nibble of its qs byte j, 16 + j the high one."""
    sl = _ldv(builder, o, f.off("scales_l"), _vt(_I8, 4))
    lo = builder.and_(builder.lshr(_shuf(builder, sl, [s // 2 for s in range(8)]), _cvec(_I8, [0, 4] * 4)),
                      _cvec(_I8, [15] * 8))
    sh = _ldv(builder, o, f.off("scales_h"), _I16)
    shv = _shuf(builder, builder.insert_element(ir.Constant(_vt(_I16, 1), None), sh, ir.Constant(_I32, 0)), [0] * 8)
    hi = builder.and_(builder.lshr(shv, _cvec(_I16, [2 * s for s in range(8)])), _cvec(_I16, [3] * 8))
    sc16 = builder.sub(builder.or_(builder.zext(lo, _vt(_I16, 8)), builder.shl(hi, _cvec(_I16, [4] * 8))),
                       _cvec(_I16, [32] * 8))
    pieces, scl = [], []
    for g in range(4):  # piece g: sub-blocks 2g, 2g + 1 (qs bytes 32g..32g+31)
        qs = _ldv(builder, o, f.qs + 32 * g, _vt(_I8, 32))
        dup = _shuf(builder, qs, [16 * b + i for b in range(2) for _ in range(2) for i in range(16)])
        w16 = builder.lshr(builder.bitcast(dup, _vt(_I16, 32)), _cvec(_I16, ([0] * 8 + [4] * 8) * 2))
        codes = builder.and_(builder.bitcast(w16, _vt(_I8, 64)), _cvec(_I8, [15] * 64))
        pieces.append(_lut16(builder, IQ4NL_KVALUES, codes))
        scl.append(_shuf(builder, sc16, [2 * g + m // 16 for m in range(32)]))
    d2 = _f16_pair(builder, o, f.off("d"))
    return KPieces(pieces, scl, None, None, _shuf(builder, d2, [0, 0]))



# ---------------------------------------------------------------------------------------
# The i-quants' weight sides (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
# ---------------------------------------------------------------------------------------
# Each group of 8 (IQ3: 4) elements is one grid word, loaded from a constant table built
# from codebooks.py (gguf-py's grids), and 8 sign bits; the signed values go through the
# tile's sign trick as IQ4_XS's do. Scales are ggml's odd sub-block scales 2 s + 1 (per 32 or
# per 16 elements); the constant factor ggml applies at the end (IQ2: 1/8, IQ3_XXS: 1/4) is
# folded into d: a power of two, so every float step is the same scaled exactly (ggml:
# 0.125f * hsum(acc), here hsum(acc') with acc' = acc / 8 exactly). The integer lanes are
# those of ggml's AVX2 kernels (quants.c ggml_vec_dot_iq*_q8_K, arch/x86): one 32-element
# sub-block per ymm, lane k = the scaled products of elements 4k..4k+3, summed over the
# sub-blocks. IQ1_S's delta (+-1/8 per 32 elements) enters as ggml's sumi1 through the mins
# path: lanes +-(2 s + 1) dotted with the Q8_K 16-sums, times -d/8 (result = acc - mins, so
# + d/8 * sumi1 as ggml's hsum(acc) + IQ1S_DELTA * accum1). IQ1_M's delta is per 8
# elements: its values are taken as 8 g +- 1 (an exact integer identity) with d/8; ggml
# keeps the delta in a second float accumulator, so IQ1_M's sums differ from ggml's by
# float32 rounding only.


def _ksign_bytes(builder, idx7):
    """ksigns_iq2xs[idx7] for a <n x i8> of 7-bit indices: the index with bit 7 set when it
    has an odd number of set bits (even parity; checked against gguf-py's table at import)."""
    n = idx7.type.count
    pop = _call(builder, f"llvm.ctpop.v{n}i8", _vt(_I8, n), [idx7])
    return builder.or_(idx7, builder.shl(builder.and_(pop, _cvec(_I8, [1] * n)), _cvec(_I8, [7] * n)))


if [i | ((bin(i).count("1") & 1) << 7) for i in range(128)] != [int(v) for v in codebooks.ksigns()]:
    raise AssertionError("ksigns_iq2xs is not the even-parity completion of its index (see _ksign_bytes)")


def _grid_global(builder, name, times=1):
    """The grid of i-quant ``name`` (its values times ``times``, exact in int8) as a module
    constant [entries x i64] (8 values per entry) or [entries x i32] (4 values), value j in
    byte j (codebooks.grid_words)."""
    if times == 1:
        words = codebooks.grid_words(name)
    else:
        gv = codebooks.grid(name).astype(np.int32) * times
        if np.abs(gv).max() > 127:
            raise AssertionError(f"{name} grid times {times} does not fit int8")
        dt = np.uint64 if gv.shape[1] == 8 else np.uint32
        words = [int(v) for v in np.ascontiguousarray(gv.astype(np.int8)).view(np.uint8).view(dt).reshape(-1)]
    ty = _I64 if codebooks.grid(name).shape[1] == 8 else _I32
    gname = f"_moe_grid_{name.lower()}" + (f"_x{times}" if times != 1 else "")
    g = builder.module.globals.get(gname)
    if g is None:
        g = cgutils.global_constant(builder, gname, ir.Constant(ir.ArrayType(ty, len(words)), words))
    return g


def _zext16(builder, v):
    """<n x i8> zero-extended to <n x i16>."""
    return builder.zext(v, _vt(_I16, v.type.count))


def _zext32(builder, v):
    """<n x i8 / i16> zero-extended to <n x i32>."""
    return builder.zext(v, _vt(_I32, v.type.count))


def _spread(builder, v, n, per):
    """<n x ...>: lane k = lane k // per of v."""
    return _shuf(builder, v, [k // per for k in range(n)])


def _lshr_and(builder, v, shifts, mask):
    """(v >> shifts[k]) & mask per lane k of a <n x iN> v."""
    ty = v.type.element
    n = v.type.count
    return builder.and_(builder.lshr(v, _cvec(ty, shifts)), _cvec(ty, [mask] * n))


def _grid_values(builder, name, ids, times=1):
    """4 x <64 x i8>: the grid values of the grid indices ``ids`` (a list of i64 scalars, in
    element order: 32 for the 8-wide grids, 64 for the 4-wide IQ3 grids), each entry one
    scalar load from the grid's constant table, 4 (8) of them inserted into a ymm: the form
    of ggml's AVX2 kernels (_mm256_set_epi64x / _mm256_set_epi32 of table words). The AVX2
    hardware gathers (vpgatherdq / vpgatherdd) are microcoded on AMD Zen: measured on Zen 3,
    one thread, T = 1 from L2, IQ2_XXS 6.9 -> 4.0 ns per 32 weights and IQ3_XXS 8.3 -> 5.0
    with the scalar loads."""
    table = _grid_global(builder, name, times)
    wide = table.type.pointee.element == _I64
    step = 4 if wide else 8
    vty = _vt(_I64 if wide else _I32, step)
    words = [builder.load(builder.gep(table, [_ci(0), i])) for i in ids]
    parts = []
    for j in range(0, len(words), step):
        v = ir.Constant(vty, None)
        for m in range(step):
            v = builder.insert_element(v, words[j + m], ir.Constant(_I32, m))
        parts.append(v)
    per = len(parts) // 4
    return [builder.bitcast(_cat(builder, parts[per * g:per * g + per]), _vt(_I8, 64)) for g in range(4)]


def _block_fields(builder, o, word_offs, width, per):
    """i64 scalars: the first ``per`` unsigned ``width``-bit fields of each little-endian
    64-bit word at byte offsets ``word_offs`` of i8* o (grid indices read straight from the
    block): one load per word, the fields split by shifts and masks in general registers (one
    load per index measured slower, the loop being bound by the load ports: see _spilled)."""
    o = _opaque(builder, o)
    mask = _ci((1 << width) - 1)
    out = []
    for off in word_offs:
        w = _ldv(builder, o, off, _I64)
        out += [builder.and_(builder.lshr(w, _ci(width * m)) if m else w, mask) for m in range(per)]
    return out


def _scalar_loads(builder, o, offs, ty):
    """i64 scalars: the unsigned ``ty`` values at byte offsets ``offs`` of i8* o, one load each
    (IQ3_XXS's index bytes, see there)."""
    o = _opaque(builder, o)
    return [builder.zext(_ldv(builder, o, off, ty), _I64) for off in offs]


def _opaque(builder, p):
    """Pointer p through an empty asm: LLVM no longer knows what it points at, so loads through
    it stay scalar loads (else it merges them with a vector load of the same bytes and reads
    them back with lane extracts, vpextrb / vpextrd: 2 uops each on Zen)."""
    return builder.asm(ir.FunctionType(p.type, [p.type]), "", "=r,0", [p], False)


def _spilled(builder, v):
    """i64 scalars: the lanes of the integer vector v (zero-extended), through a stack slot:
    one vector store, then the lanes read back 64 bits at a time and split by shifts and masks
    in general registers (the slot's address through _opaque, so LLVM keeps the store and the
    loads instead of lane extracts). One load per lane, as ggml's IQ3_S kernel reads its computed
    indices, measured slower: with the table loads, the loop is bound by the load ports (Zen 3,
    1 thread, T = 1, L2-hot, ns per 32 weights: IQ1_S 3.42 -> 2.95, IQ3_S 5.04 -> 4.49, IQ2_S
    3.75 -> 3.52, IQ1_M 3.97 -> 3.71 with the 64-bit reads)."""
    slot = cgutils.alloca_once(builder, v.type)
    builder.store(v, slot)
    per = 64 // v.type.element.width  # lanes per 64-bit load, split in general registers
    qp = builder.bitcast(_opaque(builder, slot), _I64.as_pointer())
    mask = _ci((1 << v.type.element.width) - 1)
    out = []
    for j in range(v.type.count // per):
        w = builder.load(builder.gep(qp, [_ci(j)]))
        out += [builder.and_(builder.lshr(w, _ci(v.type.element.width * m)) if m else w, mask) for m in range(per)]
    return out


def _sign_bits(builder, words):
    """<64 x i1> of 64 elements from 2 x <8 x i32> ``words``, each holding the 4 sign bytes of
    32 elements in every lane: element j's sign byte is spread in-lane by vpshufb and tested
    against its bit (vpand + vpcmpeqb)."""
    bit = _cvec(_I8, [1 << (j % 8) for j in range(32)])
    spread = _cvec(_I32, [j // 8 + (16 if j >= 16 else 0) for j in range(32)])  # in-lane: byte j // 8
    halves = []
    for w in words:
        b = builder.bitcast(w, _vt(_I8, 32))
        b = builder.shuffle_vector(b, b, spread)
        halves.append(builder.icmp_unsigned("==", builder.and_(b, bit), bit))
    return _concat(builder, halves[0], halves[1])


def _sign_masks(builder, p, off):
    """4 x <64 x i1>: element 8 i + j of piece g negative where bit j of byte i of the 32 sign
    bytes at byte ``off`` of i8* p is set (KPieces.neg). Each 32 elements' 4 sign bytes are
    one 4-byte broadcast load (vpbroadcastd: a load only), then _sign_bits: one shuffle per 32
    elements, where spreading a vector of the sign bytes took three (vpshufb, vpermq, vpshufd)."""
    p = _opaque(builder, p)
    words = [_shuf(builder, builder.insert_element(ir.Constant(_vt(_I32, 8), None),
                                                   _ldv(builder, p, off + 4 * h, _I32), ir.Constant(_I32, 0)), [0] * 8)
             for h in range(8)]
    return [_sign_bits(builder, words[2 * g:2 * g + 2]) for g in range(4)]


def _sign_masks_of(builder, signs32, in_lane=False):
    """_sign_masks of the computed sign bytes <32 x i8> ``signs32``: each 32 elements' 4 bytes
    broadcast by vpermd (a stack slot and broadcast loads measured slower: IQ3_XXS +20%).
    ``in_lane`` (AVX2): signs32's 16-byte halves duplicated to both lanes once (two vpermq),
    then each 32 elements' sign bytes spread by one in-lane vpshufb (as _scales16), where
    the broadcast and the spread took two or three shuffles; the same masks. Measured at
    T = 1 (Zen 3, one thread, L2-hot, ns per 32 weights, three alternated rounds): IQ3_XXS
    3.77-3.91 -> 3.63-3.71, but IQ2_XXS 2.77-2.81 -> 2.96-3.07 and IQ2_XS 2.65-2.88 ->
    2.79-2.96: only IQ3_XXS takes it."""
    if in_lane and not _VNNI:
        dup = [_shuf(builder, signs32, [16 * q + j for _ in range(2) for j in range(16)]) for q in range(2)]
        bit = _cvec(_I8, [1 << (j % 8) for j in range(32)])
        halves = []
        for h in range(8):
            mask = _cvec(_I8, [4 * (h % 4) + j // 8 for j in range(32)])
            b = _call(builder, "llvm.x86.avx2.pshuf.b", _vt(_I8, 32), [dup[h // 4], mask])
            halves.append(builder.icmp_unsigned("==", builder.and_(b, bit), bit))
        return [_concat(builder, halves[2 * g], halves[2 * g + 1]) for g in range(4)]
    w8 = builder.bitcast(signs32, _vt(_I32, 8))
    words = [_shuf(builder, w8, [h] * 8) for h in range(8)]
    return [_sign_bits(builder, words[2 * g:2 * g + 2]) for g in range(4)]


def _odd16(builder, s16):
    """2 s + 1 for a <16 x i16>."""
    return builder.add(builder.shl(s16, _cvec(_I16, [1] * 16)), _cvec(_I16, [1] * 16))


def _scales16(builder, sc16, in_lane=True):
    """The 4 x <32 x i16> pair-lane scales of the 16 per-16-element scales ``sc16``: lane m
    of piece g is scale 4 g + m // 8.

    AVX2 with ``in_lane``: each 16-lane half (the ymm _kq_dot / _iq_dot multiplies by) holds two scales, one
    per 128-bit lane, so it is one in-lane vpshufb of sc16's words 0-7 or 8-15 duplicated to
    both lanes (two vpermq per super-block); the plain shuffle compiled to vpshufb + vpermq
    per half (16 shuffles per super-block, 10 now). The same values: only the shuffles differ.
    Measured at T = 1 (Zen 3, one thread, L2-hot, ns per 32 weights, plain -> in-lane): IQ1_S
    3.06 -> 2.86, IQ2_XS 2.99 -> 2.68, IQ3_S 4.61 -> 4.39, IQ2_S 3.57 -> 3.43, IQ1_M 3.69 ->
    3.61; but IQ2_XXS 2.74 -> 2.91 and IQ3_XXS 3.85 -> 4.45 (LLVM schedules their loops
    anew): those two keep the plain shuffle (``in_lane=False``)."""
    if _VNNI or not in_lane:
        return [_shuf(builder, sc16, [4 * g + m // 8 for m in range(32)]) for g in range(4)]
    return _scales16_in_lane(builder, sc16)


def _scales16_in_lane(builder, sc16):
    """_scales16's AVX2 in-lane form (any host: the one-item 256-bit tiles take it there too)."""
    b = builder.bitcast(sc16, _vt(_I8, 32))
    dup = [_shuf(builder, b, [16 * q + j for _ in range(2) for j in range(16)]) for q in range(2)]
    out = []
    for g in range(4):
        halves = []
        for h in range(2):
            w0 = 4 * g + 2 * h  # lanes 0-7 of the half: scale w0, lanes 8-15: w0 + 1 (same 8-word half)
            mask = [2 * (w % 8) + j % 2 for w in (w0, w0 + 1) for j in range(16)]
            v = _call(builder, "llvm.x86.avx2.pshuf.b", _vt(_I8, 32), [dup[w0 // 8], _cvec(_I8, mask)])
            halves.append(builder.bitcast(v, _vt(_I16, 16)))
        out.append(_concat(builder, halves[0], halves[1]))
    return out


def _nibble_scales16(builder, o, off):
    """<16 x i16> 2 s + 1 of 8 bytes of 4-bit scales at ``off``: 16 elements j have nibble
    j % 2 of byte j // 2 (IQ2_XS, IQ2_S)."""
    sb = _spread(builder, _ldv(builder, o, off, _vt(_I8, 8)), 16, 2)
    return _odd16(builder, builder.zext(_lshr_and(builder, sb, [0, 4] * 8, 15), _vt(_I16, 16)))


def _d_times(builder, o, off, factors):
    """<2 x float> [d * factors[0], d * factors[1]] for the f16 d at byte ``off`` (exact: powers of 2)."""
    d2 = _f16_pair(builder, o, off)
    return builder.fmul(_shuf(builder, d2, [0, 0]), ir.Constant(_vt(_F32, 2), list(factors)))


def _aux_fields(builder, aux8, by_shift=True):
    """From the 8 sub-block words <8 x i32> of IQ2_XXS / IQ3_XXS: the <32 x i8> ksigns bytes
    (group 4 ib + k: bits 7k of word ib) and the <16 x i16> odd scales 2 (w >> 28) + 1 per 16.
    ``by_shift``: the ksigns indices as (w & 0x7f) | (w << 1 & 0x7f00) | (w << 2 & 0x7f0000) |
    (w << 3 & 0x7f000000) on the 8 words (10 ops), else by spreading each word to 4 lanes and
    a variable shift (~22 ops). Measured on Zen 3 at T = 1, the shifts took IQ2_XXS from 3.3 to
    3.0 ns per 32 weights but IQ3_XXS from 3.6 to 4.2 (its loop of 64 lookups is sensitive to
    the schedule LLVM picks), so IQ3_XXS keeps the spread."""
    if by_shift:
        c = lambda v: _cvec(_I32, [v] * 8)  # noqa: E731
        fields = [builder.and_(builder.shl(aux8, c(k)) if k else aux8, c(0x7F << (8 * k))) for k in range(4)]
        sidx = builder.bitcast(builder.or_(builder.or_(fields[0], fields[1]), builder.or_(fields[2], fields[3])),
                               _vt(_I8, 32))
    else:
        a32 = _spread(builder, aux8, 32, 4)
        sidx = builder.trunc(_lshr_and(builder, a32, [7 * (k % 4) for k in range(32)], 127), _vt(_I8, 32))
    s8 = builder.trunc(builder.lshr(aux8, _cvec(_I32, [28] * 8)), _vt(_I16, 8))
    return _ksign_bytes(builder, sidx), _odd16(builder, _spread(builder, s8, 16, 2))


@_weight_side("IQ2_XXS")
def _iq2_xxs_pieces(builder, f, o):
    """Sub-block ib (32 elements) is 4 grid-index bytes then a u32 aux (four 7-bit ksigns
    indices, bits 7k, and the scale s, bits 28..31); scale 2 s + 1; d / 8."""
    q = _ldv(builder, o, f.qs, _vt(_I32, 16))  # words: index bytes, aux, index bytes, aux, ...
    idx = _block_fields(builder, o, [f.qs + 8 * ib for ib in range(8)], 8, 4)
    signs, sc16 = _aux_fields(builder, _shuf(builder, q, range(1, 16, 2)))
    return KPieces(_grid_values(builder, f.name, idx), _scales16(builder, sc16, in_lane=False), None, None,
                   _d_times(builder, o, 0, (0.125, 0.0)), _sign_masks_of(builder, signs))


@_weight_side("IQ3_XXS")
def _iq3_xxs_pieces(builder, f, o):
    """64 grid-index bytes (4 values each) then 8 u32 aux words as IQ2_XXS's; d / 4."""
    # one load per index byte: 64-bit (or 32-bit) words split in registers measured slower
    # here (Zen 3, T = 1: 3.6 -> 4.4 / 4.1 ns per 32 weights), unlike the other formats
    idx = _scalar_loads(builder, o, [f.qs + k for k in range(64)], _I8)
    signs, sc16 = _aux_fields(builder, _ldv(builder, o, f.off("scales_signs"), _vt(_I32, 8)), by_shift=False)
    return KPieces(_grid_values(builder, f.name, idx), _scales16(builder, sc16, in_lane=False), None, None,
                   _d_times(builder, o, 0, (0.25, 0.0)), _sign_masks_of(builder, signs, in_lane=True))


@_weight_side("IQ2_XS")
def _iq2_xs_pieces(builder, f, o):
    """32 u16 (one per 8 elements): low 9 bits the grid index, high 7 bits the ksigns index;
    4-bit scales per 16 elements (_nibble_scales16); d / 8."""
    q = _ldv(builder, o, f.qs, _vt(_I16, 32))
    idx = [builder.and_(v, _ci(511)) for v in _block_fields(builder, o, [f.qs + 8 * j for j in range(8)], 16, 4)]
    signs = _ksign_bytes(builder, builder.trunc(builder.lshr(q, _cvec(_I16, [9] * 32)), _vt(_I8, 32)))
    sc16 = _nibble_scales16(builder, o, f.off("scales"))
    return KPieces(_grid_values(builder, f.name, idx), _scales16(builder, sc16), None, None,
                   _d_times(builder, o, 0, (0.125, 0.0)), _sign_masks_of(builder, signs))


@_indices("IQ2_S")
def _iq2_s_indices(builder, f, o):
    qh = _zext16(builder, _spread(builder, _ldv(builder, o, f.qh, _vt(_I8, 8)), 32, 4))
    hi = builder.shl(_lshr_and(builder, qh, [2 * (k % 4) for k in range(32)], 3), _cvec(_I16, [8] * 32))
    return builder.or_(_zext16(builder, _ldv(builder, o, f.qs, _vt(_I8, 32))), hi)


@_weight_side("IQ2_S")
def _iq2_s_pieces(builder, f, o, idx=None):
    """Group k of 8 elements: grid index qs[k] | 2 bits 2 (k % 4) of qh[k // 4] << 8, sign byte
    signs[k]; 4-bit scales per 16 elements; d / 8. ``idx``: as _iq1_s_pieces'."""
    if idx is None:
        idx = _spilled(builder, _iq2_s_indices(builder, f, o))
    sc16 = _nibble_scales16(builder, o, f.off("scales"))
    return KPieces(_grid_values(builder, f.name, idx), _scales16(builder, sc16), None, None,
                   _d_times(builder, o, 0, (0.125, 0.0)),
                   _sign_masks(builder, o, f.off("signs")))


@_indices("IQ3_S", 64)
def _iq3_s_indices(builder, f, o):
    qh = _zext16(builder, _spread(builder, _ldv(builder, o, f.qh, _vt(_I8, 8)), 64, 8))
    hi = builder.shl(_lshr_and(builder, qh, [k % 8 for k in range(64)], 1), _cvec(_I16, [8] * 64))
    return builder.or_(_zext16(builder, _ldv(builder, o, f.qs, _vt(_I8, 64))), hi)


@_weight_side("IQ3_S")
def _iq3_s_pieces(builder, f, o, idx=None):
    """Grid index k (4 values) = qs[k] | bit k % 8 of qh[k // 8] << 8; element e's sign is bit
    e % 8 of signs[e // 8]; sub-block ib (32 elements) scale 2 s + 1, s nibble ib % 2 of
    scales[ib // 2]; d. ``idx``: as _iq1_s_pieces'."""
    if idx is None:
        idx = _spilled(builder, _iq3_s_indices(builder, f, o))
    sb = _spread(builder, _ldv(builder, o, f.off("scales"), _vt(_I8, 4)), 16, 4)
    sc16 = _odd16(builder, builder.zext(_lshr_and(builder, sb, [0, 0, 4, 4] * 4, 15), _vt(_I16, 16)))
    return KPieces(_grid_values(builder, f.name, idx), _scales16(builder, sc16), None, None,
                   _d_times(builder, o, 0, (1.0, 0.0)),
                   _sign_masks(builder, o, f.off("signs")))


@_indices("IQ1_S")
def _iq1_s_indices(builder, f, o):
    """<32 x i16>: the 11-bit grid indices of the IQ1_S super-block at i8* o (group k: qs[k]
    | 3 bits 3 (k % 4) of qh[k // 4] << 8)."""
    q8 = _ldv(builder, o, f.qh, _vt(_I16, 8))
    hi = _lshr_and(builder, _spread(builder, q8, 32, 4), [3 * (k % 4) for k in range(32)], 7)
    return builder.or_(_zext16(builder, _ldv(builder, o, f.qs, _vt(_I8, 32))), builder.shl(hi, _cvec(_I16, [8] * 32)))


@_weight_side("IQ1_S")
def _iq1_s_pieces(builder, f, o, idx=None):
    """Sub-block ib: u16 qh (3 high index bits per 8 elements at bits 3k, s at 12..14, the
    delta's sign at 15) and 4 low index bytes; values the grid's -1 / 0 / 1, scale 2 s + 1;
    the delta as mins lanes +-(2 s + 1) with [d, -d / 8] (see the section comment).
    ``idx``: the grid indices (i64 scalars) computed ahead (_IndicesAhead), else _spilled."""
    q8 = _ldv(builder, o, f.qh, _vt(_I16, 8))
    if idx is None:
        idx = _spilled(builder, _iq1_s_indices(builder, f, o))
    pieces = _grid_values(builder, f.name, idx)
    q16 = _spread(builder, q8, 16, 2)
    sc16 = _odd16(builder, _lshr_and(builder, q16, [12] * 16, 7))
    neg = builder.icmp_signed("<", q16, _cvec(_I16, [0] * 16))
    mins = builder.select(neg, builder.sub(_cvec(_I16, [0] * 16), sc16), sc16)
    return KPieces(pieces, _scales16(builder, sc16), mins, None, _d_times(builder, o, 0, (1.0, -0.125)))


@_indices("IQ1_M")
def _iq1_m_indices(builder, f, o):
    nib = _lshr_and(builder, _spread(builder, _ldv(builder, o, f.qh, _vt(_I8, 16)), 32, 2), [0, 4] * 16, 15)
    hi = builder.shl(_zext16(builder, builder.and_(nib, _cvec(_I8, [7] * 32))), _cvec(_I16, [8] * 32))
    return builder.or_(_zext16(builder, _ldv(builder, o, f.qs, _vt(_I8, 32))), hi)


@_weight_side("IQ1_M")
def _iq1_m_pieces(builder, f, o, idx=None):
    """Group k of 8 elements: nibble k % 2 of qh[k // 2] holds 3 high index bits and the
    delta's sign (bit 3); values 8 g +- 1 (g the grid's -1 / 0 / 1, + 1 when the sign bit is
    clear), d / 8; 16 elements m have scale 2 s + 1, s bits 3 (m % 4) of u16 scale word
    m // 4, whose top nibbles are the f16 d."""
    so = f.off("scales")
    nib = _lshr_and(builder, _spread(builder, _ldv(builder, o, f.qh, _vt(_I8, 16)), 32, 2), [0, 4] * 16, 15)
    if idx is None:
        idx = _spilled(builder, _iq1_m_indices(builder, f, o))
    # delta of group k: 1 - 2 (bit 3 of its nibble) = +-1, spread to its 8 elements as the sign
    # bytes are (_sign_masks_of: vpermd broadcast, in-lane vpshufb), added to 8 g from a grid
    # table stored times 8
    d8 = builder.sub(_cvec(_I8, [1] * 32), _lshr_and(builder, nib, [2] * 32, 2))
    w8 = builder.bitcast(d8, _vt(_I32, 8))
    spread = _cvec(_I32, [j // 8 + (16 if j >= 16 else 0) for j in range(32)])
    halves = []
    for h in range(8):
        b = builder.bitcast(_shuf(builder, w8, [h] * 8), _vt(_I8, 32))
        halves.append(builder.shuffle_vector(b, b, spread))
    pieces = [builder.add(v, _concat(builder, halves[2 * g], halves[2 * g + 1]))
              for g, v in enumerate(_grid_values(builder, f.name, idx, times=8))]
    w = _ldv(builder, o, so, _vt(_I16, 4))
    sc16 = _odd16(builder, _lshr_and(builder, _spread(builder, w, 16, 4), [0, 3, 6, 9] * 4, 7))
    top = builder.shl(builder.lshr(w, _cvec(_I16, [12] * 4)), _cvec(_I16, [0, 4, 8, 12]))
    dbits = builder.or_(builder.or_(builder.extract_element(top, ir.Constant(_I32, 0)),
                                    builder.extract_element(top, ir.Constant(_I32, 1))),
                        builder.or_(builder.extract_element(top, ir.Constant(_I32, 2)),
                                    builder.extract_element(top, ir.Constant(_I32, 3))))
    d = builder.fpext(builder.bitcast(dbits, ir.HalfType()), _F32)
    d2 = builder.insert_element(ir.Constant(_vt(_F32, 2), [0.0, 0.0]), builder.fmul(d, ir.Constant(_F32, 0.125)),
                                ir.Constant(_I32, 0))
    return KPieces(pieces, _scales16(builder, sc16), None, None, d2)

# ---------------------------------------------------------------------------------------
# Unpacked rows: the multi-item path of the grid i-quants (AVX2 and AVX-512)
# ---------------------------------------------------------------------------------------
# A tile unpacks its weight row's grid entries, signs and scales once per super-block, but
# on AVX2 a tile holds at most 8 items: at T = 128 each row was unpacked 16 times, and the
# unpacking (32 or 64 table loads per super-block, the sign masks, their spills) cost about
# as much as the 8 items' products (measured in instructions per super-block of the 8-item
# loop, IQ2_XXS: 750, Q4_K: 418). With UNPACKED_MIN_ITEMS items or more, kernel.py's
# driver (tiles_iq.mmq_unpacked) unpacks each row once into a scratch buffer
# (_unpack_row_codegen) and runs the tiles over it (_tilek_codegen(..., unpacked=True)).
# In the buffer the weights are signed int8 (the sign masks applied once per row), so a
# (row, item) pair costs what Q4_K's does plus one vpxor: the activation goes in as
# unsigned a + 128 (a xor 0x80, Q8_K's |a| <= 127) x signed w in vpmaddubsw, and each
# row's lanes start from -128 x (its scaled weight sums), computed once per row: sum w (a +
# 128) - 128 sum w = sum w a per int32 lane, so the lanes, and all that follows, are the
# same bit for bit. No int16 pair sum saturates: 2 x 255 x max|w| <= 32767 for every grid
# (max|w| 62, IQ3_XXS; checked below). Not for IQ4_XS (|w| up to 127). AVX-512 (VNNI): the
# dot in 512-bit steps (ir._dot_scaled512, lanes folded per super-block as _kq_dot's), Q2_K
# too, in tiles_iq_blocked's 2 x 4 tiles (measured: docs/avx512-notes.md).
#
# Buffer layout per super-block (UNPACKED_BLOCK_BYTES, 64-byte aligned): 256 signed int8
# weights in element order | 4 x 32 int16 pair-lane scales (KPieces.scales) | 8 int32 lanes
# -128 x scaled weight sums | 16 int16 mins (IQ1_S) | 2 float32 d2.

_U_W, _U_SC, _U_CORR, _U_MINS, _U_D2 = 0, 256, 512, 544, 576
UNPACKED_BLOCK_BYTES = 640


def _max_abs_value(name: str) -> int:
    """The largest |signed weight| of i-quant ``name`` as its tiles hold them (IQ1_M: 8 g +- 1)."""
    g = int(np.abs(codebooks.grid(name).astype(np.int32)).max())
    return 8 * g + 1 if name == "IQ1_M" else g


_GRID_IQ = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
for _n in _GRID_IQ:
    if 2 * 255 * _max_abs_value(_n) > 32767:
        raise AssertionError(f"{_n}: (a + 128) x w pair sums could saturate vpmaddubsw")

UNPACKED = frozenset(BY_NAME[n].type_id for n in _GRID_IQ + (("Q2_K",) if _VNNI else ()))
"""Formats whose multi-item matmuls unpack each weight row once (section comment; AVX-512: Q2_K too)."""

UNPACKED_ROWS_MAX = 4 if _VNNI else 2
"""Weight rows per unpacked tile at most (1 x 8 items row by row, 2 x 4 items in
tiles_iq_blocked's row blocks, AVX-512 4 x 4: one read of an item's activations serves them)."""

UNPACKED_MIN_ITEMS = 3
"""Items from which a matmul of an UNPACKED format takes the unpacked path (but see
tiles_iq.takes_unpacked: not at 4 and 8 items). In instructions per
super-block (IQ2_XXS, AVX2): unpacking a row 324, the unpacked tiles of 8 / 4 / 2 / 1 items
367 / 170 / 85 / 45, the tiles over the blocks 750 / 504 / 363 / 293. Measured (Zen 3, one
thread, a loaded host, 768 x 2048 rows, ns per 32 weights per token, main -> unpacked):
IQ2_XXS T = 2 2.09 -> 2.31, T = 3 2.57 -> 1.60, T = 4 1.60 -> 1.36, T = 8 1.15 -> 1.01."""


def _align64(builder, p):
    """i8* p rounded up to a multiple of 64 bytes (the scratch buffer is allocated 64 bytes long)."""
    a = builder.ptrtoint(p, _I64)
    a = builder.and_(builder.add(a, _ci(63)), _ci(~63))
    return builder.inttoptr(a, _I8.as_pointer())


def _iq_dot(builder, w64, a64, sc32, iacc):
    """iacc <8 x i32> += the scale-weighted pair sums of (a64 xor 0x80) (u8) x w64 (s8), the
    two 32-element halves folded (lanes as _kq_dot's AVX2 form, offset by 128 x sum w)."""
    out = iacc
    for h in range(2):
        w = _shuf(builder, w64, range(32 * h, 32 * h + 32))
        a = builder.xor(_shuf(builder, a64, range(32 * h, 32 * h + 32)), _cvec(_I8, [0x80] * 32))
        out = builder.add(out, _madd(builder, _maddubs(builder, a, w), _shuf(builder, sc32, range(16 * h, 16 * h + 16))))
    return out


def _unpacked_pieces(builder, o):
    """The KPieces of an unpacked super-block at i8* o (signed pieces, no neg)."""
    pieces = [_ldv(builder, o, _U_W + 64 * g, _vt(_I8, 64)) for g in range(4)]
    scales = [_ldv(builder, o, _U_SC + 64 * g, _vt(_I16, 32)) for g in range(4)]
    mins = _ldv(builder, o, _U_MINS, _vt(_I16, 16))
    return KPieces(pieces, scales, mins, None, _ldv(builder, o, _U_D2, _vt(_F32, 2)))


def _unpack_row_codegen(fmt):
    """Codegen of (fmt, arena, wo, rb, nb, buf): the nb super-blocks of the row at byte wo of
    arena (row stride rb, for the prefetch distance) into buf (uint8, at least nb x
    UNPACKED_BLOCK_BYTES + 64 bytes) in the layout of the section comment."""
    f = FORMATS[fmt]
    if fmt not in UNPACKED:
        raise AssertionError(f"{f.name} has no unpacked form")

    def codegen(context, builder, sig, args):
        ty = sig.args
        wo, rb, nb = (_i64(context, builder, args[i], ty[i]) for i in (2, 3, 4))
        base = builder.bitcast(_data(context, builder, ty[1], args[1]), _I8.as_pointer())
        row = builder.gep(base, [wo])
        out = _align64(builder, builder.bitcast(_data(context, builder, ty[5], args[5]), _I8.as_pointer()))
        pf_dist = _pf_distance(builder, rb, 1, _PF_MIN_K)
        c80 = _cvec(_I8, [0x80] * 32)
        zero = _cvec(_I8, [0] * 64)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            o = builder.gep(row, [builder.mul(b, _ci(f.block_bytes))])
            for line in range(0, f.block_bytes, 64):
                _prefetch(builder, builder.gep(o, [builder.add(pf_dist, _ci(line))]))
            wk = _kq_pieces(builder, fmt, o)
            if wk.offset is not None:
                raise AssertionError(f"{f.name}: an offset has no unpacked form")
            dst = builder.gep(out, [builder.mul(b, _ci(UNPACKED_BLOCK_BYTES))])
            corr = ir.Constant(_VI, [0] * 8)
            for g in range(4):
                w = wk.pieces[g]
                if wk.neg is not None:
                    w = builder.select(wk.neg[g], builder.sub(zero, w), w)
                _stv(builder, dst, _U_W + 64 * g, w)
                _stv(builder, dst, _U_SC + 64 * g, wk.scales[g])
                for h in range(2):
                    wh = _shuf(builder, w, range(32 * h, 32 * h + 32))
                    sh = _shuf(builder, wk.scales[g], range(16 * h, 16 * h + 16))
                    corr = builder.add(corr, _madd(builder, _maddubs(builder, c80, wh), sh))
            _stv(builder, dst, _U_CORR, builder.sub(ir.Constant(_VI, [0] * 8), corr))
            if wk.mins is not None:
                _stv(builder, dst, _U_MINS, wk.mins)
            _stv(builder, dst, _U_D2, wk.d2)
        return context.get_dummy_value()

    return codegen


def _stv(builder, ptr, off, v):
    """Store value v at byte offset ``off`` of i8* ptr (unaligned)."""
    st_ = builder.store(v, builder.bitcast(builder.gep(ptr, [_ci(off)]), v.type.as_pointer()))
    st_.align = 1


def _kq_dot(builder, w64, a64, sc32, iacc, signed=False, vnni=_VNNI):
    """iacc <16 x i32> += scale-weighted int16 pair sums of w64 (u8) x a64 (s8); a ``signed``
    w64 goes in as |w| x (a with w's sign), ggml's sign trick (no int16 pair sum saturates:
    |w|, |a| <= 127)."""
    if signed and vnni:  # AVX-512 has no vpsignb
        zero = _cvec(_I8, [0] * 64)
        a64 = builder.select(builder.icmp_signed("<", w64, zero), builder.sub(zero, a64),
                             builder.select(builder.icmp_signed("==", w64, zero), zero, a64))
        w64 = _call(builder, "llvm.abs.v64i8", _vt(_I8, 64), [w64, ir.Constant(ir.IntType(1), 0)])
    if vnni:
        return _dot_scaled512(builder, w64, a64, sc32, iacc)
    halves = []
    for h in range(2):
        w = _shuf(builder, w64, range(32 * h, 32 * h + 32))
        a = _shuf(builder, a64, range(32 * h, 32 * h + 32))
        if signed:  # vpsignb + vpabsb (LLVM lowered the select form to vpcmpeqb, vpandn, vpsubb, vpblendvb)
            a, w = _sign8(builder, a, w), _abs8(builder, w)
        halves.append(_madd(builder, _maddubs(builder, w, a), _shuf(builder, sc32, range(16 * h, 16 * h + 16))))
    # AVX2: iacc is the 8 folded lanes (lane k + lane k + 8 of the 16-lane form, exact), so
    # one ymm per (row, item) and tiles of 8 items fit in the 16 registers
    return builder.add(iacc, builder.add(halves[0], halves[1]))


class _IndicesAhead:
    """The one-item tile (AVX2) of a format in _INDICES with its grid indices computed one
    super-block ahead: block b + 1's are stored (two slots, by parity; past the row's end
    the last block again, never read) while block b is unpacked from those stored one
    iteration before, so the table loads no longer wait on the slot's store-to-load
    forwarding inside the iteration (the reorder window holds about one super-block). The
    same indices, lanes and float steps. Zen 3, 1 thread, T = 1, ns per 32 weights: IQ1_S
    2.88 -> 2.67, IQ2_S 3.09-3.41 -> 2.83, IQ3_S 4.36 -> 3.67, IQ1_M 3.5-3.6 -> 3.2-3.3
    (docs/iq-decode-notes.md)."""

    def __init__(self, builder, f, row, nb):
        self.f, self.row, self.nb = f, row, nb
        self.ind, lanes = _INDICES[f.type_id]
        self.slots = cgutils.alloca_once(builder, _vt(_I16, lanes), size=2)
        with cgutils.if_likely(builder, builder.icmp_signed(">", nb, _ci(0))):
            builder.store(self.ind(builder, f, row), self.slots)

    def pieces(self, builder, b, o):
        """The KPieces of super-block b (at i8* o), storing super-block b + 1's indices."""
        nxt = builder.add(b, _ci(1))
        nxt = builder.select(builder.icmp_signed("<", nxt, self.nb), nxt, b)
        par = builder.and_(b, _ci(1))
        ahead = self.ind(builder, self.f, builder.gep(self.row, [builder.mul(nxt, _ci(self.f.block_bytes))]))
        builder.store(ahead, builder.gep(self.slots, [builder.xor(par, _ci(1))]))
        return _PIECES[self.f.type_id](builder, self.f, o, _slot_fields(builder, builder.gep(self.slots, [par])))


def _hsum_i32(builder, vs):
    """<len(vs) x i32>: lane t = the (exact) sum of the 8 lanes of vs[t] (len a power of 2).
    One vector: halves folded (vextracti128 / vpshufd + vpaddd, 1 uop each), where the
    even/odd form compiles to vphaddd (3 uops on Zen); several: the even/odd form, which
    sums them side by side. Integer sums: the same result either way."""
    x = _cat(builder, vs) if len(vs) > 1 else vs[0]
    n = x.type.count
    if len(vs) == 1:
        while n > 1:
            x = builder.add(_shuf(builder, x, range(n // 2)), _shuf(builder, x, range(n // 2, n)))
            n //= 2
        return x
    while n > len(vs):
        x = builder.add(_shuf(builder, x, range(0, n, 2)), _shuf(builder, x, range(1, n, 2)))
        n //= 2
    return x


def _tilek_codegen(fmt, n_w, n_a, unpacked=False, t1_side=None, ymm=False):
    """The tile of ``n_w`` weight rows x ``n_a`` items of K-quant ``fmt`` (see the section
    comment). ``unpacked``: the weight row is a row of _unpack_row_codegen's scratch buffer
    instead of the GGUF blocks (up to UNPACKED_ROWS_MAX rows rb bytes apart, formats in
    UNPACKED: see there); the integer lanes and every float step are the same. ``t1_side``: a
    weight side (builder, f, o) -> KPieces that the AVX2 one-item tile over the GGUF blocks
    takes instead of _PIECES' (tiles_t1.T1_SIDES, from table.py; the other tiles ignore it): the
    same integer lanes by other steps. ``ymm``: that AVX2 tile on AVX-512 too (table._T1_YMM)."""
    f = FORMATS[fmt]
    bb, has_min = f.block_bytes, f.has_min
    vnni = _VNNI and not ymm
    if unpacked:  # rows rb bytes apart in the scratch buffer (UNPACKED_ROWS_MAX rows: tiles_iq_blocked)
        if n_w > UNPACKED_ROWS_MAX or fmt not in UNPACKED:
            raise AssertionError(f"no unpacked tile of {n_w} rows of {f.name}")
        bb = UNPACKED_BLOCK_BYTES
    n_pk = (n_a + 1) // 2  # accumulators per row: items packed two per <16 x float>

    def codegen(context, builder, sig, args):
        rb, nb, i0, ostride, ocol, xq8, xd32, x3, orow, outp, wrow, arows = _tile_args(context, builder, sig,
                                                                                        args, n_w, n_a)
        xbs8 = builder.bitcast(x3, _I8.as_pointer())
        if unpacked:
            wrow = [_align64(builder, w) for w in wrow]
        pf_dist = _pf_distance(builder, rb, n_w, _PF_MIN_K)
        xq_t = [builder.gep(xq8, [builder.mul(a, builder.mul(nb, _ci(QK_K)))]) for a in arows]
        xd_t = [builder.gep(xd32, [builder.mul(a, nb)]) for a in arows]
        xbs_t = [builder.gep(xbs8, [builder.mul(a, builder.mul(nb, _ci(32)))]) for a in arows]
        acc_ty = [_vt(_F32, 16 if 2 * p + 1 < n_a else 8) for p in range(n_pk)]
        acc = [[cgutils.alloca_once(builder, acc_ty[p]) for p in range(n_pk)] for _ in range(n_w)]
        for k in range(n_w):
            for p in range(n_pk):
                builder.store(ir.Constant(acc_ty[p], [0.0] * acc_ty[p].count), acc[k][p])
        mty = _vt(_F32, n_a)
        mvec = [cgutils.alloca_once(builder, mty) for _ in range(n_w)] if has_min else []
        for p in mvec:
            builder.store(ir.Constant(mty, [0.0] * n_a), p)
        z16 = ir.Constant(_vt(_I32, 16), [0] * 16)
        ahead = ([_IndicesAhead(builder, f, wrow[k], nb) for k in range(n_w)]
                 if n_a == 1 and not unpacked and not vnni and fmt in _INDICES else None)
        t1 = t1_side if n_a == 1 and not unpacked and not vnni else None

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            boff = builder.mul(b, _ci(bb))
            wb = [builder.gep(wrow[k], [boff]) for k in range(n_w)]
            for k in range(n_w if not unpacked else 0):  # an unpacked row is in L1
                for line in range(0, bb, 64):
                    _prefetch(builder, builder.gep(wb[k], [builder.add(pf_dist, _ci(line))]))
            aoff = builder.mul(b, _ci(QK_K))
            yd = _cat(builder, [builder.insert_element(ir.Constant(_vt(_F32, 1), None),
                                                       builder.load(builder.gep(xd_t[t], [b])), ir.Constant(_I32, 0))
                                for t in range(n_a)]) if n_a > 1 else \
                builder.insert_element(ir.Constant(_vt(_F32, 1), None), builder.load(builder.gep(xd_t[0], [b])),
                                       ir.Constant(_I32, 0))
            bs = [_ldv(builder, xbs_t[t], builder.mul(b, _ci(32)), _vt(_I16, 16)) for t in range(n_a)]
            if ahead is not None:
                wk = [ahead[k].pieces(builder, b, wb[k]) for k in range(n_w)]
            elif t1 is not None:
                wk = [t1(builder, f, wb[k]) for k in range(n_w)]
            else:
                wk = [_kq_pieces(builder, fmt, wb[k]) if not unpacked else _unpacked_pieces(builder, wb[k])
                      for k in range(n_w)]
            # int32 lanes per (row, item); Q6_K / Q3_K start from offset * (scales . bsums) in lanes 0..7
            if unpacked:  # from -128 x (the row's scaled weight sums), see _unpack_row_codegen
                iacc = [[_concat(builder, _ldv(builder, wb[k], _U_CORR, _VI), ir.Constant(_VI, [0] * 8))
                         if _VNNI else _ldv(builder, wb[k], _U_CORR, _VI)] * n_a for k in range(n_w)]
            elif vnni:
                iacc = [[_concat(builder, _madd(builder, wk[k].offset, bs[t]), ir.Constant(_VI, [0] * 8))
                         if wk[k].offset is not None else z16 for t in range(n_a)] for k in range(n_w)]
            else:  # 8 lanes, already folded (see _kq_dot)
                iacc = [[_madd(builder, wk[k].offset, bs[t]) if wk[k].offset is not None else ir.Constant(_VI, [0] * 8)
                         for t in range(n_a)] for k in range(n_w)]
            for t in range(n_a if unpacked else 0):  # item-major, the row's pieces and scales as memory operands
                ot = [_opaque(builder, wb[k]) for k in range(n_w)]  # fresh pointers per item: LLVM reloads
                for g in range(4):  # rather than spills them
                    a64 = _ldv(builder, xq_t[t], builder.add(aoff, _ci(64 * g)), _vt(_I8, 64))
                    if _VNNI:  # 512-bit: lanes j = elements 4 j .. + 3, folded below as _kq_dot's
                        a64 = builder.xor(a64, _cvec(_I8, [0x80] * 64))
                    for k in range(n_w):  # (the rows share the item's a xor 0x80)
                        w, sc = (_ldv(builder, ot[k], o + 64 * g, ty) for o, ty in ((_U_W, _vt(_I8, 64)),
                                                                                    (_U_SC, _vt(_I16, 32))))
                        iacc[k][t] = (_dot_scaled512(builder, a64, w, sc, iacc[k][t]) if _VNNI
                                      else _iq_dot(builder, w, a64, sc, iacc[k][t]))
            for g in range(4 if not unpacked else 0):  # piece-major: one piece of every row live at a time
                for t in range(n_a):
                    a64 = _ldv(builder, xq_t[t], builder.add(aoff, _ci(64 * g)), _vt(_I8, 64))
                    for k in range(n_w):
                        a = a64
                        if wk[k].neg is not None:  # unsigned values, their signs on the activation
                            a = builder.select(wk[k].neg[g], builder.sub(_cvec(_I8, [0] * 64), a64), a64)
                        iacc[k][t] = _kq_dot(builder, wk[k].pieces[g], a, wk[k].scales[g], iacc[k][t],
                                             f.signed and wk[k].neg is None, vnni)
            for k in range(n_w):
                mins, d2 = wk[k].mins, wk[k].d2
                lanes = [builder.add(_shuf(builder, v, range(8)), _shuf(builder, v, range(8, 16))) if vnni else v
                         for v in iacc[k]]
                dsc = builder.fmul(_shuf(builder, d2, [0] * n_a), yd)  # d_w * d_x per item
                for p in range(n_pk):
                    two = 2 * p + 1 < n_a
                    li = _concat(builder, lanes[2 * p], lanes[2 * p + 1]) if two else lanes[2 * p]
                    s = _shuf(builder, dsc, [2 * p] * 8 + ([2 * p + 1] * 8 if two else []))
                    fl = builder.sitofp(li, acc_ty[p])
                    old = builder.load(acc[k][p])
                    name = "llvm.fma.v16f32" if two else "llvm.fma.v8f32"
                    builder.store(_call(builder, name, acc_ty[p], [fl, s, old]), acc[k][p])
                if has_min:
                    md = _hsum_i32(builder, [_madd(builder, mins, bs[t]) for t in range(n_a)])
                    t1 = builder.fmul(_shuf(builder, d2, [1] * n_a), yd)
                    old = builder.load(mvec[k])
                    builder.store(builder.fadd(old, builder.fmul(t1, builder.sitofp(md, mty))), mvec[k])
        # result (k, t) = tree(acc) [- mins], lanes t * n_w + k
        vecs, ids = [], []
        for k in range(n_w):
            for p in range(n_pk):
                vecs.append(builder.load(acc[k][p]))
                ids.append(((k, 2 * p), (k, 2 * p + 1)) if 2 * p + 1 < n_a else ((k, 2 * p),))
        sums, lane = _tree8_many(builder, vecs, ids)
        order = [(k, t) for t in range(n_a) for k in range(n_w)]
        res = _shuf(builder, sums, [lane[kt] for kt in order])
        if has_min:
            m = _cat(builder, [builder.load(mvec[k]) for k in range(n_w)]) if n_w > 1 else builder.load(mvec[0])
            res = builder.fsub(res, _shuf(builder, m, [n_a * k + t for k, t in order]))
        _store_rows(builder, outp, orow, i0, ostride, ocol, res, n_w, n_a)
        return context.get_dummy_value()

    return codegen
