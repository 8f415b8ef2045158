"""Tile kernels of the 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, IQ4_NL x Q8_0 /
Q8_1): LLVM IR for R weight rows x A activation rows per pass (see the section comment).
A format of this family declares its tile parameters in formats.py (``kind``, ``bias``,
``signed``, ``has_min`` and the ``qs`` / ``qh`` offsets)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from moe_service.engine.quant.ir import (
    _F32,
    _I8,
    _I16,
    _I32,
    _I64,
    _ONES16,
    _PF_MIN_32,
    _VF,
    _VI,
    _VNNI,
    _abs8,
    _call,
    _cat,
    _ci,
    _concat,
    _cvec,
    _ldv,
    _madd,
    _maddubs,
    _pf_distance,
    _prefetch,
    _shuf,
    _sign8,
    _store_rows,
    _tile_args,
    _tree8_many,
    _vt,
)
from moe_service.formats import BY_NAME, FORMATS, IQ4NL_KVALUES, MXFP4_KVALUES, QK

# ---------------------------------------------------------------------------------------
# Tile kernels of the 32-element formats: R weight rows x A activation rows per pass
# ---------------------------------------------------------------------------------------
# One call of a tile intrinsic computes R x A dot products (R consecutive weight rows, A
# activation rows picked through a_rows) in one pass over the rows' blocks, taking blocks
# two at a time (a *pair*). Per pair it unpacks each weight row's two blocks once (64 int8,
# the float16 scales widened) and loads each activation row's two blocks once; the R x A
# products then cost four vector instructions each on AVX-512 VNNI: vpdpbusd (64 byte
# products -> 16 int32, four adjacent products per lane), vcvtdq2ps, vmulps (d_w * d_x,
# both pre-expanded to the 16 lanes), vfmadd. The R x A accumulators stay in registers.
#
# Numerics are exactly the per-row order of the one-row dot: each row's accumulator is
# 8 lanes for even blocks and 8 for odd blocks (on AVX-512 the two halves of one zmm);
# lane k of block b gets fma(float(sum of the 4 products 4k..4k+3), d_w(b) * d_x(b), acc);
# at the end each half is summed by the same pairwise tree, even + odd, then (Q4_1/Q5_1)
# + (m_even + m_odd) where m_par accumulates m_w(b) * s_x(b) (multiply, then add) over the
# blocks of its parity. The int32 lane sums are exact whatever instructions compute them,
# so the result of a row never depends on R, A, the tile a row lands in, or the ISA.
#
# Signed weights (Q8_0, Q4_0, Q5_0, MXFP4) with vpdpbusd (unsigned x signed bytes): the
# activation goes in as unsigned a + 128 (a xor 0x80) and every lane starts from
# -128 * (sum of its 4 weights), computed once per weight pair: sum w*(a+128) - 128 sum w =
# sum w*a exactly (vpdpbusd does not saturate). Without VNNI (the AVX2 path) a block is one
# ymm and the products go through vpmaddubsw + vpmaddwd (signed weights: ggml's sign trick,
# |w| x sign(a, w)); no int16 pair sum can saturate (|w| <= 128, |a| <= 127).



def _unpack32(builder, f, ptrs, offset=0):
    """The int8 values of the blocks at i8* ptrs (1 or 2 consecutive blocks of one row) as
    one <32*len(ptrs) x i8> (signed values for signed formats, else 0..31); ``offset`` (see
    OFFSET): the signed values plus offset, as unsigned bytes."""
    n = len(ptrs)
    if f.kind == "q8":
        return _cat(builder, [_ldv(builder, p, _ci(f.qs), _vt(_I8, 32)) for p in ptrs])
    v = _cat(builder, [_ldv(builder, p, _ci(f.qs), _vt(_I8, 16)) for p in ptrs])  # <16n x i8>
    # block j: its 16 low nibbles (elements 0..15), then its 16 high nibbles (16..31): each
    # block's 16 bytes twice, the second copy shifted right by 4 (as 16-bit lanes), & 15
    dup = _shuf(builder, v, [16 * j + i for j in range(n) for _ in range(2) for i in range(16)])
    w16 = builder.lshr(builder.bitcast(dup, _vt(_I16, 16 * n)), _cvec(_I16, ([0] * 8 + [4] * 8) * n))
    q = builder.and_(builder.bitcast(w16, _vt(_I8, 32 * n)), _cvec(_I8, [15] * 32 * n))
    if f.kind in ("mxfp4", "iq4nl"):
        values = MXFP4_KVALUES if f.kind == "mxfp4" else IQ4NL_KVALUES
        table = _cvec(_I8, [(v_ + offset) & 0xFF for v_ in values] * (2 * n))
        name = "llvm.x86.avx512.pshuf.b.512" if n == 2 else "llvm.x86.avx2.pshuf.b"
        return _call(builder, name, _vt(_I8, 32 * n), [table, q])
    if f.qh >= 0:
        bits = [builder.zext(_ldv(builder, p, _ci(f.qh), _I32), _I64) for p in ptrs]
        m = bits[0] if n == 1 else builder.or_(bits[0], builder.shl(bits[1], _ci(32)))
        mask = builder.bitcast(builder.trunc(m, _I32) if n == 1 else m, _vt(ir.IntType(1), 32 * n))
        q = builder.or_(q, builder.select(mask, _cvec(_I8, [16] * 32 * n), _cvec(_I8, [0] * 32 * n)))
    if f.bias and offset != f.bias:
        q = builder.sub(q, _cvec(_I8, [f.bias - offset] * 32 * n))
    return q


def _e8m0_half(e: int) -> float:
    """float32 of ggml's E8M0 half conversion: bits 0x00200000 << e for e < 2, else (e - 1) << 23."""
    import struct

    bits = (0x00200000 << e) if e < 2 else ((e - 1) << 23)
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


_E8M0_HALF = ir.Constant(ir.ArrayType(_F32, 256), [_e8m0_half(e) for e in range(256)])


OFFSET = {} if _VNNI else {BY_NAME["MXFP4"].type_id: 12, BY_NAME["Q4_0"].type_id: 8, BY_NAME["Q5_0"].type_id: 16}
"""AVX2, one item: signed formats whose values w lie in [-OFFSET, OFFSET] take w + OFFSET
(0..24 / 0..15 / 0..31, unsigned) straight into vpmaddubsw, and each int32 lane (four
products) then subtracts OFFSET x the sum of its four activation values, computed once per
matmul call (table._mmq): the same integer as |w| x sign(a, w), without the vpabsb / vpsignb
per block (no int16 pair sum saturates: 2 x 31 x 127 < 32767). Several items keep the sign
trick: their sums would be needed per (item, block)."""


SCALE_CHUNK = 64
"""AVX2 tiles of several items, formats without a min (Q8_0, Q4_0, Q5_0, MXFP4): blocks per
chunk whose scale products d_w(b) x d_x(b) are computed before the chunk's dot products,
eight blocks per vmulps, into a stack buffer of rows x items x SCALE_CHUNK floats; the (row,
item, block) step then takes its product with a broadcast load instead of a vmulps per block
(the multiplies shared the two FMA pipes with the fused multiply-adds). The same IEEE
products, so the same results bit for bit. Even, so a chunk starts on an even block and the
pair steps keep their parity. Measured on AMD EPYC Zen 3, one thread, T = 8 and 128, ns per
32 weights per token (python bench/kernels.py --formats Q4_0,MXFP4,Q5_0,Q8_0 --tokens 8,128
--threads 1 --cols C): at 768 columns Q4_0 1.26-1.32 -> 1.07-1.12, MXFP4 1.39-1.50 ->
1.08-1.15, Q5_0 1.50-1.61 -> 1.25-1.28, Q8_0 1.16-1.22 -> 0.96-1.02; at 2880 columns Q4_0,
MXFP4 and Q5_0 14-22% faster. Q4_1 / Q5_1 keep a vmulps per block: they widen each block's
scales for their min term anyway, and the table made them 2-7% slower."""

SCALE_T1_NOTE = """A single item in the offset form (AVX2, T = 1: Q4_0 and Q5_0) also takes its
scale products from the chunk table, computed before the chunk's blocks (their float16 scales
widen eight at a time), instead of a vmulss and a register broadcast per block; the same IEEE
products, so the same results bit for bit. Measured on the shared 2-core AMD EPYC (Zen 3),
one thread, 128 rows x 4096 columns hot in L2, ns per 32 weights at T = 1, best of 600 calls,
main and this form alternated 3 rounds: Q4_0 1.39-1.42 -> 1.26-1.31, Q5_0 1.89-1.92 ->
1.82-1.84. MXFP4 keeps the per-block multiply: its scales are E8M0 table loads, eight of
which per vector step (a vinsertps each) made it slower, 1.35-1.39 -> 1.48-1.57. Other forms
of MXFP4's T = 1 scale (two broadcast loads and one vmulps per block, 9 ALU ops per block
instead of 10.5), two weight rows per tile, and four blocks per loop iteration were all
within 1% of today (docs/v4-bw-notes.md)."""

SCALE_MIN_BLOCKS = 16
"""Rows of fewer blocks keep a vmulps per (row, item, block): the table's pass costs more
than it saves there (Q8_0 at 192 columns, 6 blocks, 18% slower with the table)."""


def _scales32(builder, f, ptrs):
    """<2n x float>: [d, m] of each block (m only meaningful for Q4_1 / Q5_1), widened
    exactly from float16 (MXFP4: [2^(e-128), 0])."""
    n = len(ptrs)
    if f.kind == "mxfp4":
        # one load per block from a 256-entry float table (the exact values the shifts below
        # would build: ggml's E8M0 "half" conversion, 2^(e-128))
        table = cgutils.global_constant(builder, "_e8m0_half_f32", _E8M0_HALF)
        d = ir.Constant(_vt(_F32, 2 * n), [0.0] * 2 * n)
        for j, p in enumerate(ptrs):
            v = builder.load(builder.gep(table, [_ci(0), builder.zext(builder.load(p), _I64)]))
            d = builder.insert_element(d, v, ir.Constant(_I32, 2 * j))
        return d
    w = ir.Constant(_vt(_I32, n), None)
    for j, p in enumerate(ptrs):
        w = builder.insert_element(w, _ldv(builder, p, _ci(0), _I32), ir.Constant(_I32, j))
    return builder.fpext(builder.bitcast(w, _vt(ir.HalfType(), 2 * n)), _vt(_F32, 2 * n))


def _bcast_opaque(builder, v):
    """<8 x float> of the scalar v, by inline ``vbroadcastss``: LLVM cannot see it is a splat,
    so ``fmul(dw, splat(dx))`` stays one vmulps with dx broadcast from memory, instead of being
    folded into a scalar multiply plus a register broadcast per (row, item, block): two ALU
    ops where one will do (AVX2 tiles of 2 or more items; a single item keeps the scalar
    multiply). The product is the same float (IEEE multiply, lane by lane). Measured on AMD
    EPYC Zen 3, one thread, T = 4 and 16: Q8_0, Q4_0, Q5_0 and MXFP4 7-12% faster
    (python bench/kernels.py --formats MXFP4,Q8_0,Q4_0,Q5_0 --tokens 1,4,16 --threads 1)."""
    return builder.asm(ir.FunctionType(_VF, [_F32]), "vbroadcastss $1, $0", "=x,x", [v], False)


def _splat_load(builder, ptr):
    """<8 x float> of the float at ``ptr`` (the backend emits a vbroadcastss load)."""
    v = builder.load(ptr)
    v.align = 4
    one = builder.insert_element(ir.Constant(_VF, None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, _cvec(_I32, [0] * 8))


def _dot32(builder, f, w, neg, a, a_u):
    """int32 lanes (8 per block) of w . a for one weight value vector w and activation a
    (<32n x i8>); on VNNI ``neg``/``a_u`` carry the signed-weight correction (see above)."""
    n = w.type.count // 32
    vi = _vt(_I32, 8 * n)
    if _VNNI:
        name = "llvm.x86.avx512.vpdpbusd.512" if n == 2 else "llvm.x86.avx512.vpdpbusd.256"
        if f.signed:
            return _call(builder, name, vi, [neg, builder.bitcast(a_u, vi), builder.bitcast(w, vi)])
        return _call(builder, name, vi, [ir.Constant(vi, [0] * 8 * n), builder.bitcast(w, vi), builder.bitcast(a, vi)])
    if f.signed:
        return _madd(builder, _maddubs(builder, _abs8(builder, w), _sign8(builder, a, w)), _ONES16)
    return _madd(builder, _maddubs(builder, w, a), _ONES16)

def _tile32_codegen(fmt, n_w, n_a):
    f = FORMATS[fmt]
    # accumulator layout: VNNI: one <16 x float> per (row, item) = [even blocks | odd blocks];
    # AVX2: two <8 x float> (even, odd).
    n_par_parts = 1 if _VNNI else 2

    def codegen(context, builder, sig, args):
        rb, nb, i0, ostride, ocol, xq8, xd32, x3, orow, outp, wrow, arows = _tile_args(context, builder, sig,
                                                                                        args, n_w, n_a)
        xs32 = builder.bitcast(x3, _F32.as_pointer())
        # the offset form (OFFSET) when the caller passes the int32 sums in place of the Q8_1 sums
        aux_ty = sig.args[9]
        # (table._mmq passes them to single-item calls only; the wider tiles it also compiles
        # there never run, and keep the sign trick)
        offset = OFFSET.get(fmt, 0) if (n_a == 1 and isinstance(aux_ty, types.CPointer)
                                        and aux_ty.dtype == types.int32) else 0
        corr32 = builder.bitcast(x3, _I32.as_pointer())
        n_cols = builder.mul(nb, _ci(QK))
        pf_dist = _pf_distance(builder, rb, n_w, _PF_MIN_32)
        xq_t = [builder.gep(xq8, [builder.mul(a, n_cols)]) for a in arows]
        xd_t = [builder.gep(xd32, [builder.mul(a, nb)]) for a in arows]
        xs_t = [builder.gep(xs32, [builder.mul(a, nb)]) for a in arows]
        acc_ty = _vt(_F32, 16) if _VNNI else _VF
        acc = [[[cgutils.alloca_once(builder, acc_ty) for _ in range(n_par_parts)] for _ in range(n_a)]
               for _ in range(n_w)]
        for k in range(n_w):
            for t in range(n_a):
                for p in acc[k][t]:
                    builder.store(ir.Constant(acc_ty, [0.0] * acc_ty.count), p)
        # scale products per chunk (SCALE_CHUNK): tiles of several items, and a single item in
        # the offset form except MXFP4 (SCALE_T1_NOTE)
        hoist = not _VNNI and not f.has_min and (n_a > 1 or (offset != 0 and f.kind != "mxfp4"))
        s_buf = cgutils.alloca_once(builder, _F32, size=_ci(n_w * n_a * SCALE_CHUNK)) if hoist else None
        mvec = []
        if f.has_min:
            mty = _vt(_F32, 2 * n_a)
            mvec = [cgutils.alloca_once(builder, mty) for _ in range(n_w)]
            for p in mvec:
                builder.store(ir.Constant(mty, [0.0] * 2 * n_a), p)

        def s_slot(k, t, rel):
            """float* to the scale product of row k, item t, block c0 + rel in s_buf."""
            return builder.gep(s_buf, [builder.add(_ci((k * n_a + t) * SCALE_CHUNK), rel)])

        def scale_products(c0, cn):
            """s_buf[k, t, 0..cn) = d_w(k, c0 + i) x d_x(t, c0 + i): eight blocks per vmulps,
            then one block at a time for the last cn % 8."""
            n8 = builder.lshr(cn, _ci(3))
            with cgutils.for_range(builder, n8) as g:
                rel = builder.mul(g.index, _ci(8))
                b0 = builder.add(c0, rel)
                for k in range(n_w):
                    ptrs = [builder.gep(wrow[k], [builder.mul(builder.add(b0, _ci(j)), _ci(f.bb))]) for j in range(8)]
                    dw8 = _shuf(builder, _scales32(builder, f, ptrs), list(range(0, 16, 2)))
                    for t in range(n_a):
                        dx8 = _ldv(builder, builder.bitcast(builder.gep(xd_t[t], [b0]), _I8.as_pointer()), 0, _VF, 4)
                        st = builder.store(builder.fmul(dw8, dx8), builder.bitcast(s_slot(k, t, rel), _VF.as_pointer()))
                        st.align = 4
            done = builder.mul(n8, _ci(8))
            with cgutils.for_range(builder, builder.sub(cn, done)) as r:
                rel = builder.add(done, r.index)
                b = builder.add(c0, rel)
                for k in range(n_w):
                    sc1 = _scales32(builder, f, [builder.gep(wrow[k], [builder.mul(b, _ci(f.bb))])])
                    dw1 = builder.extract_element(sc1, ir.Constant(_I32, 0))
                    for t in range(n_a):
                        dx1 = builder.load(builder.gep(xd_t[t], [b]))
                        dx1.align = 4
                        st = builder.store(builder.fmul(dw1, dx1), s_slot(k, t, rel))
                        st.align = 4

        def step(b, n, c0=None):
            """Blocks b .. b+n-1 (n = 1 or 2) of every row and item (b even); when given,
            c0 is the chunk's first block (its scale products are in s_buf)."""
            boff = builder.mul(b, _ci(f.bb))
            wp = [[builder.gep(wrow[k], [builder.add(boff, _ci(j * f.bb))]) for j in range(n)] for k in range(n_w)]
            if n == 2:
                for k in range(n_w):
                    for line in range(0, 2 * f.bb, 64):
                        _prefetch(builder, builder.gep(wp[k][0], [builder.add(pf_dist, _ci(line))]))
            if _VNNI:
                ws = [[_unpack32(builder, f, wp[k])] for k in range(n_w)]  # one vector of n blocks
            else:
                ws = [[_unpack32(builder, f, [wp[k][j]], offset) for j in range(n)] for k in range(n_w)]
            hoisted = c0 is not None
            sc = [] if hoisted else [_scales32(builder, f, wp[k]) for k in range(n_w)]  # (hoist: no min term)
            if hoisted:
                dw = []
            elif _VNNI:
                dw = [[_shuf(builder, sc[k], [0] * 8 + ([2] * 8 if n == 2 else []))] for k in range(n_w)]
            elif n_a == 1:
                dw = [[_shuf(builder, sc[k], [2 * j] * 8) for j in range(n)] for k in range(n_w)]
            else:  # one ymm broadcast per weight block, opaque (see _bcast_opaque), shared by the items
                dw = [[_bcast_opaque(builder, builder.extract_element(sc[k], ir.Constant(_I32, 2 * j)))
                       for j in range(n)] for k in range(n_w)]
            neg = [[None] * len(ws[k]) for k in range(n_w)]
            if _VNNI and f.signed:
                for k in range(n_w):
                    for j, w in enumerate(ws[k]):
                        vi = _vt(_I32, w.type.count // 4)
                        name = "llvm.x86.avx512.vpdpbusd.512" if w.type.count == 64 else "llvm.x86.avx512.vpdpbusd.256"
                        s = _call(builder, name, vi, [ir.Constant(vi, [0] * vi.count),
                                                      builder.bitcast(_cvec(_I8, [0x80] * w.type.count), vi),
                                                      builder.bitcast(w, vi)])
                        neg[k][j] = builder.sub(ir.Constant(vi, [0] * vi.count), s)
            xoff = builder.mul(b, _ci(QK))
            for t in range(n_a):
                if _VNNI:
                    av = [_ldv(builder, xq_t[t], xoff, _vt(_I8, 32 * n))]
                else:
                    av = [_ldv(builder, xq_t[t], builder.add(xoff, _ci(32 * j)), _vt(_I8, 32)) for j in range(n)]
                au = [builder.xor(v, _cvec(_I8, [0x80] * v.type.count)) for v in av] if (_VNNI and f.signed) else av
                if hoisted:
                    dx = []
                elif _VNNI or n_a == 1:
                    dx2 = _ldv(builder, builder.bitcast(builder.gep(xd_t[t], [b]), _I8.as_pointer()), 0,
                               _vt(_F32, n), 4)
                    dx = ([_shuf(builder, dx2, [0] * 8 + ([1] * 8 if n == 2 else []))] if _VNNI else
                          [_shuf(builder, dx2, [j] * 8) for j in range(n)])
                else:  # a broadcast load per block (vbroadcastss m32: no ALU op)
                    dx = [_splat_load(builder, builder.gep(xd_t[t], [builder.add(b, _ci(j))])) for j in range(n)]
                for k in range(n_w):
                    for j in range(len(av)):
                        if offset:
                            cj = builder.bitcast(builder.gep(corr32, [builder.mul(builder.add(b, _ci(j)), _ci(8))]),
                                                 _VI.as_pointer())
                            corr = builder.load(cj)
                            corr.align = 4
                            li = builder.sub(_madd(builder, _maddubs(builder, ws[k][j], av[j]), _ONES16), corr)
                        else:
                            li = _dot32(builder, f, ws[k][j], neg[k][j], av[j], au[j])
                        fl = builder.sitofp(li, _vt(_F32, li.type.count))
                        if hoisted:
                            s = _splat_load(builder, s_slot(k, t, builder.add(builder.sub(b, c0), _ci(j))))
                        else:
                            s = builder.fmul(dw[k][j], dx[j])
                        if _VNNI:
                            p = acc[k][t][0]
                            old = builder.load(p)
                            if n == 2:
                                new = _call(builder, "llvm.fma.v16f32", acc_ty, [fl, s, old])
                            else:  # even block only: the low 8 lanes
                                lo = _call(builder, "llvm.fma.v8f32", _VF, [fl, s, _shuf(builder, old, range(8))])
                                lo16 = _shuf(builder, lo, list(range(8)) + [0] * 8)
                                new = builder.shuffle_vector(lo16, old, _cvec(_I32, list(range(8)) + list(range(24, 32))))
                            builder.store(new, p)
                        else:
                            p = acc[k][t][j]
                            builder.store(_call(builder, "llvm.fma.v8f32", _VF, [fl, s, builder.load(p)]), p)
            if f.has_min:
                # m_par += m_w(b) * s_x(b): lanes [2t + parity], one vector per weight row
                xsv = _cat(builder, [_ldv(builder, builder.bitcast(builder.gep(xs_t[t], [b]), _I8.as_pointer()), 0,
                                          _vt(_F32, n), 4) for t in range(n_a)]) if n_a > 1 else \
                    _ldv(builder, builder.bitcast(builder.gep(xs_t[0], [b]), _I8.as_pointer()), 0, _vt(_F32, n), 4)
                for k in range(n_w):
                    p = mvec[k]
                    old = builder.load(p)
                    if n == 2:
                        mw = _shuf(builder, sc[k], [1, 3] * n_a)
                        builder.store(builder.fadd(old, builder.fmul(mw, xsv)), p)
                    else:
                        prod = builder.fmul(_shuf(builder, sc[k], [1] * n_a), xsv)  # <n_a>
                        prod2 = _shuf(builder, prod, [t // 2 for t in range(2 * n_a)])
                        new = builder.fadd(old, prod2)
                        keep = _cvec(ir.IntType(1), [1 - (ln & 1) for ln in range(2 * n_a)])
                        builder.store(builder.select(keep, new, old), p)

        def chunked():
            n_chunks = builder.udiv(builder.add(nb, _ci(SCALE_CHUNK - 1)), _ci(SCALE_CHUNK))
            with cgutils.for_range(builder, n_chunks) as cl:
                c0 = builder.mul(cl.index, _ci(SCALE_CHUNK))
                left = builder.sub(nb, c0)
                cn = builder.select(builder.icmp_unsigned("<", left, _ci(SCALE_CHUNK)), left, _ci(SCALE_CHUNK))
                scale_products(c0, cn)
                with cgutils.for_range(builder, builder.lshr(cn, _ci(1))) as loop:
                    step(builder.add(c0, builder.mul(loop.index, _ci(2))), 2, c0)
                odd = builder.icmp_unsigned("!=", builder.and_(cn, _ci(1)), _ci(0))
                with builder.if_then(odd, likely=False):
                    step(builder.sub(builder.add(c0, cn), _ci(1)), 1, c0)

        def plain():
            with cgutils.for_range(builder, builder.lshr(nb, _ci(1))) as loop:
                step(builder.mul(loop.index, _ci(2)), 2)
            odd = builder.icmp_unsigned("!=", builder.and_(nb, _ci(1)), _ci(0))
            with builder.if_then(odd, likely=False):
                step(builder.sub(nb, _ci(1)), 1)

        if hoist:  # rows of fewer than SCALE_MIN_BLOCKS blocks: the table would cost more than it saves
            with builder.if_else(builder.icmp_unsigned(">=", nb, _ci(SCALE_MIN_BLOCKS))) as (then, otherwise):
                with then:
                    chunked()
                with otherwise:
                    plain()
        else:
            plain()
        # result (k, t) = (tree(even) + tree(odd)) [+ (m_even + m_odd)], lanes t * n_w + k
        vecs, ids = [], []
        for t in range(n_a):
            for k in range(n_w):
                if _VNNI:
                    vecs.append(builder.load(acc[k][t][0]))
                else:
                    vecs.append(_concat(builder, builder.load(acc[k][t][0]), builder.load(acc[k][t][1])))
                ids.append(((k, t, 0), (k, t, 1)))
        sums, lane = _tree8_many(builder, vecs, ids)
        order = [(k, t) for t in range(n_a) for k in range(n_w)]
        res = builder.fadd(_shuf(builder, sums, [lane[(k, t, 0)] for k, t in order]),
                           _shuf(builder, sums, [lane[(k, t, 1)] for k, t in order]))
        if f.has_min:
            m = _cat(builder, [builder.load(mvec[k]) for k in range(n_w)]) if n_w > 1 else builder.load(mvec[0])
            ms = builder.fadd(_shuf(builder, m, [2 * n_a * k + 2 * t for k, t in order]),
                              _shuf(builder, m, [2 * n_a * k + 2 * t + 1 for k, t in order]))
            res = builder.fadd(res, ms)
        _store_rows(builder, outp, orow, i0, ostride, ocol, res, n_w, n_a)
        return context.get_dummy_value()

    return codegen

