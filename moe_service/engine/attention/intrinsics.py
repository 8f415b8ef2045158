"""The vector dot products of the score and P.V kernels, written in LLVM vector IR as numba
intrinsics so that every sum runs in vector lanes and still rounds in the contract's order
(the package docstring: ggml's summation order): :func:`_lane_dot` (one query row with one
key, 16 or 64 lanes), :func:`_dot16_rows` and :func:`_dot16_heads_keys` (a prefill's rows x
keys, 16 lanes), :func:`_dot64_keys8`, :func:`_dot64_heads_keys8` and
:func:`_dot64_tile_keys8` (a decode's eight keys at a time, 64 lanes), :func:`_pv_heads16`
(P.V of up to four heads per value row read); with the codegen helpers they share (argument
access, vector loads, the halving folds, prefetches). ``_SCORE_LANES`` (layout) sets how many
float32 lanes one vector holds (16 on AVX-512, else 8); the sums are the same either way.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir as _ir
from numba import types
from numba.core import cgutils as _cg
from numba.extending import intrinsic

from moe_service.engine.attention.layout import _KV_PREFETCH_KEYS, _SCORE_LANES
from moe_service.engine.quant import ir as _qir


def _i64_arg(context, builder, signature, args, k):
    """Codegen: an intrinsic's integer argument ``k`` as an i64 value."""
    return context.cast(builder, args[k], signature.args[k], types.int64)


def _ptr_arg(context, builder, signature, args, a, o):
    """Codegen: the element pointer of an intrinsic's array argument ``a`` at the offset held by
    its integer argument ``o``."""
    return builder.gep(_qir._data(context, builder, signature.args[a], args[a]),
                       [_i64_arg(context, builder, signature, args, o)])


def _c64(n: int):
    return _ir.Constant(_ir.IntType(64), n)


def _load_f32(builder, ptr, off, n: int):
    """<n x float> at float* ``ptr`` + ``off`` (i64 value)."""
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), _ir.VectorType(_ir.FloatType(), n).as_pointer()),
                        align=4)


def _load_half(builder, ptr, off, n: int):
    """<n x float> widened exactly from the n float16 (uint16 bits) at i16* ``ptr`` + ``off``."""
    hv = builder.load(builder.bitcast(builder.gep(ptr, [off]), _ir.VectorType(_ir.IntType(16), n).as_pointer()),
                      align=2)
    return builder.fpext(builder.bitcast(hv, _ir.VectorType(_ir.HalfType(), n)), _ir.VectorType(_ir.FloatType(), n))


def _fold16(builder, x):
    """<8 x float>: lane l + lane l + 8 of the 16-lane vector ``x`` (ggml's 16 -> 8 halving)."""
    return builder.fadd(_qir._shuf(builder, x, range(8)), _qir._shuf(builder, x, range(8, 16)))


def _prefetch_lines(builder, ptr, n_lines: int):
    """Prefetch the ``n_lines`` 64-byte lines from ``ptr`` (any element pointer) on."""
    p8 = builder.bitcast(ptr, _ir.IntType(8).as_pointer())
    for line in range(n_lines):
        _qir._prefetch(builder, builder.gep(p8, [_c64(64 * line)]))


def _lane_dot(lanes: int):
    """An intrinsic ``f(qb, qo, kb, ko, n_blocks) -> float32``: the dot product of
    qb[qo : qo + n_blocks * lanes] (float32) with kb[ko : ...] (float32, or float16 bits as
    uint16 read in place) in ggml's order: ``lanes`` float32 accumulators, element i into
    accumulator i % lanes (a product of two float16 values is exact in float32, so ggml's
    fused multiply-add rounds as this multiply then add), block after block; then a halving
    tree, lane l + h into lane l for h = lanes/2, ..., 1. lanes = 64: ggml_vec_dot_f16 on
    AVX-512 (GGML_F16_STEP 64: four 16-lane accumulators, GGML_F32x16_REDUCE adds the second
    pair into the first, then the first two, then _mm512_reduce_add_ps halves 16 lanes);
    lanes = 16: llamafile's tinyBLAS (one 16-lane accumulator per output, hsum =
    _mm512_reduce_add_ps). Written in LLVM vector IR so the order is exactly this one."""

    @intrinsic
    def dot(typingctx, qarr, qo, karr, ko, n_blocks):
        sig = types.float32(qarr, qo, karr, ko, n_blocks)
        k_half = karr.dtype == types.uint16

        def codegen(context, builder, signature, args):
            i64 = _ir.IntType(64)
            vty = _ir.VectorType(_ir.FloatType(), lanes)
            qp = _ptr_arg(context, builder, signature, args, 0, 1)
            kp = _ptr_arg(context, builder, signature, args, 2, 3)
            nb = _i64_arg(context, builder, signature, args, 4)
            acc_p = _cg.alloca_once_value(builder, _ir.Constant(vty, [0.0] * lanes))
            with _cg.for_range(builder, nb) as loop:
                off = builder.mul(loop.index, _ir.Constant(i64, lanes))
                qv = _load_f32(builder, qp, off, lanes)
                kv = (_load_half if k_half else _load_f32)(builder, kp, off, lanes)
                builder.store(_qir._call(builder, f"llvm.fma.v{lanes}f32", vty, [qv, kv, builder.load(acc_p)]), acc_p)
            acc = builder.load(acc_p)
            h = lanes
            while h > 1:
                h //= 2
                lo = builder.shuffle_vector(acc, acc, _ir.Constant(_ir.VectorType(_ir.IntType(32), h), list(range(h))))
                hi = builder.shuffle_vector(acc, acc, _ir.Constant(_ir.VectorType(_ir.IntType(32), h),
                                                                   list(range(h, 2 * h))))
                acc = builder.fadd(lo, hi)
            return builder.extract_element(acc, _ir.Constant(_ir.IntType(32), 0))

        return sig, codegen

    return dot


_dot16 = _lane_dot(16)
_dot64 = _lane_dot(64)


@intrinsic
def _dot16_rows(typingctx, qarr, qo, qstride, karr, ko, n_blocks, oarr, oo, ostride, n_rows):
    """``n_rows`` (a literal, 1 to 4) :func:`_lane_dot` (lanes = 16) dot products at once, bit
    for bit the same: query rows qb[qo + r * qstride ...] (r < n_rows) with one key kb[ko ...],
    each K vector loaded (and widened from float16) once for the rows; out[oo + r * ostride] =
    the results. Fused multiply-adds (the products of float16 values are exact in float32).
    The rows' halving trees are folded together, two rows per shuffle-and-add (lane l + h
    into lane l of each row, h = 8, 4, 2, 1, exactly as one row alone)."""
    if not isinstance(n_rows, types.IntegerLiteral):
        return None
    nr = n_rows.literal_value
    sig = types.void(qarr, qo, qstride, karr, ko, n_blocks, oarr, oo, ostride, n_rows)
    k_half = karr.dtype == types.uint16

    def codegen(context, builder, signature, args):
        i64 = _ir.IntType(64)
        i32 = _ir.IntType(32)
        v16 = _ir.VectorType(_ir.FloatType(), 16)

        def idx(k):
            return _i64_arg(context, builder, signature, args, k)

        qp = _ptr_arg(context, builder, signature, args, 0, 1)
        kp = _ptr_arg(context, builder, signature, args, 3, 4)
        op_ = _ptr_arg(context, builder, signature, args, 6, 7)
        qs, nb, ostr = idx(2), idx(5), idx(8)
        accs = [_cg.alloca_once_value(builder, _ir.Constant(v16, [0.0] * 16)) for _ in range(nr)]
        with _cg.for_range(builder, nb) as loop:
            off = builder.mul(loop.index, _ir.Constant(i64, 16))
            kv = (_load_half if k_half else _load_f32)(builder, kp, off, 16)
            for r in range(nr):
                qv = _load_f32(builder, qp, builder.add(builder.mul(_ir.Constant(i64, r), qs), off), 16)
                builder.store(_qir._call(builder, "llvm.fma.v16f32", v16, [qv, kv, builder.load(accs[r])]), accs[r])
        vecs: list[tuple[Any, list[int | None], int]] = [(builder.load(a), [r], 16) for r, a in enumerate(accs)]
        while len(vecs) & (len(vecs) - 1):  # a power of two: pad with zero rows (not stored)
            vecs.append((_ir.Constant(v16, [0.0] * 16), [None], 16))
        while vecs[0][2] > 1:
            nxt = []
            for i in range(0, len(vecs), 2):
                x, rx, w = vecs[i]
                y, ry = (vecs[i + 1][0], vecs[i + 1][1]) if i + 1 < len(vecs) else (x, [])
                h = w // 2
                lo = [n * w + ln for n in range(len(rx)) for ln in range(h)]
                lo += [len(rx) * w + n * w + ln for n in range(len(ry)) for ln in range(h)]
                hi = [x_ + h for x_ in lo]
                lo_v = builder.shuffle_vector(x, y, _ir.Constant(_ir.VectorType(i32, len(lo)), lo))
                hi_v = builder.shuffle_vector(x, y, _ir.Constant(_ir.VectorType(i32, len(hi)), hi))
                nxt.append((builder.fadd(lo_v, hi_v), rx + ry, h))
            vecs = nxt
        for v, rows, _w in vecs:
            for n, row in enumerate(rows):
                if row is None:
                    continue
                builder.store(builder.extract_element(v, _ir.Constant(i32, n)),
                              builder.gep(op_, [builder.mul(_ir.Constant(i64, row), ostr)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _dot16_heads_keys(typingctx, qarr, qo, qstride, n_heads, karr, ko, kstride, n_blocks, oarr, oo, ostride,
                      n_keys, keys_per_pass, scale, mrow, r0):
    """The prefill scores of ``n_heads`` query rows (qarr[qo + h * qstride ...], float32 holding
    float16 values) with ``n_keys`` keys at karr[ko + i * kstride] (float16 bits as uint16, or
    float32), n_blocks = D / 16: oarr[oo + h * ostride + i] = (q_h . k_i) * scale, and
    mrow[r0 + h] raised to each row's largest (v > m, as max(m, v)). n_heads, n_blocks, n_keys
    and keys_per_pass (a divisor of n_keys) are literals. The dot products are
    :func:`_dot16_rows`' bit for bit, except that one of exactly zero may carry the other sign
    (the first block starts from its product, not 0 + product): element i into lane i % 16,
    block after block, fused multiply-adds (the products of float16 values are exact in
    float32), the 16 lanes as one vector (_SCORE_LANES = 16) or two 8-lane halves; then lane
    l + 8 into lane l, and the last three halvings of all the keys together
    (quant.ir._tree8_many).

    Why: :func:`_dot16_rows` loads each query part once per key and folds each key's 16 lanes
    alone. Here one pass holds keys_per_pass keys x n_heads rows of 16 lanes (or of one
    8-lane half) in registers (each query part loaded once for those keys, each key part once
    for the rows),
    and every pass is a basic block of its own, unrolled over the blocks (a pass loop over
    the blocks ran 25% slower at D = 128: its short trip count; one block for all the passes
    let LLVM's scheduler hoist the loads and spill)."""
    if not all(isinstance(x, types.IntegerLiteral) for x in (n_heads, n_blocks, n_keys, keys_per_pass)):
        return None
    sig = types.void(qarr, qo, qstride, n_heads, karr, ko, kstride, n_blocks, oarr, oo, ostride, n_keys,
                     keys_per_pass, scale, mrow, r0)
    nh, nb, nk, kpp = (x.literal_value for x in (n_heads, n_blocks, n_keys, keys_per_pass))
    assert nk % kpp == 0
    load_k = _load_half if karr.dtype == types.uint16 else _load_f32

    def codegen(context, builder, signature, args):
        w = _SCORE_LANES  # vector width: 16 (AVX-512, one pass per key group) or 8 (two halves)
        n_half = 16 // w
        vw = _ir.VectorType(_ir.FloatType(), w)
        c = _c64
        qp = _ptr_arg(context, builder, signature, args, 0, 1)
        kp = _ptr_arg(context, builder, signature, args, 4, 5)
        op_ = _ptr_arg(context, builder, signature, args, 8, 9)
        qs, kst, ost, r0v = (_i64_arg(context, builder, signature, args, k) for k in (2, 6, 10, 15))
        sc = context.cast(builder, args[13], signature.args[13], types.float32)
        mrp = _qir._data(context, builder, signature.args[14], args[14])
        xbuf = _cg.alloca_once(builder, vw, size=c(nh * nk * n_half))  # [head][key][half] lane sums
        # the pass count through an empty inline asm: LLVM cannot see it is a constant, so it
        # does not unroll the passes into one block (which, inlined into _tile_pass, spilled
        # most accumulators)
        n_pass = builder.asm(_ir.FunctionType(_ir.IntType(64), [_ir.IntType(64)]), "", "=r,0",
                             [c(n_half * (nk // kpp))], False)
        with _cg.for_range(builder, n_pass) as pl:  # pass = (key group, half)
            i0 = builder.mul(builder.udiv(pl.index, c(n_half)), c(kpp))
            half = builder.urem(pl.index, c(n_half))
            y8 = builder.mul(half, c(8))
            krow = [builder.gep(kp, [builder.add(builder.mul(builder.add(i0, c(i)), kst), y8)]) for i in range(kpp)]
            qrow = [builder.gep(qp, [builder.add(builder.mul(c(h), qs), y8)]) for h in range(nh)]
            acc: dict[tuple[int, int], Any] = {}
            for b in range(nb):
                kv = [load_k(builder, krow[i], c(16 * b), w) for i in range(kpp)]
                for h in range(nh):
                    qv = _load_f32(builder, qrow[h], c(16 * b), w)
                    for i in range(kpp):
                        acc[h, i] = builder.fmul(qv, kv[i]) if b == 0 else \
                            _qir._call(builder, f"llvm.fma.v{w}f32", vw, [qv, kv[i], acc[h, i]])
            for h in range(nh):
                for i in range(kpp):
                    slot = builder.add(builder.mul(builder.add(c(h * nk + i), i0), c(n_half)), half)
                    builder.store(acc[h, i], builder.gep(xbuf, [slot]))
        for h in range(nh):
            if n_half == 2:
                xs = [builder.fadd(builder.load(builder.gep(xbuf, [c((h * nk + i) * 2)])),
                                   builder.load(builder.gep(xbuf, [c((h * nk + i) * 2 + 1)]))) for i in range(nk)]
            else:
                xl = [builder.load(builder.gep(xbuf, [c(h * nk + i)])) for i in range(nk)]
                xs = [_fold16(builder, x) for x in xl]
            sums, lane = _qir._tree8_many(builder, xs, [(i,) for i in range(nk)])
            orow = builder.gep(op_, [builder.mul(c(h), ost)])
            vk = _ir.VectorType(_ir.FloatType(), nk)
            sv = builder.fmul(_qir._shuf(builder, sums, [lane[i] for i in range(nk)]), _qir._splat_f32(builder, sc, nk))
            st = builder.store(sv, builder.bitcast(orow, vk.as_pointer()))
            st.align = 4
            mx = sv  # the row's running maximum: v > m ? v : m, as max(m, v)
            w = nk
            while w > 1:
                h2 = w // 2
                lo, hi = _qir._shuf(builder, mx, range(h2)), _qir._shuf(builder, mx, range(h2, w))
                mx = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
                w = h2
            m_new = builder.extract_element(mx, _ir.Constant(_ir.IntType(32), 0))
            mp = builder.gep(mrp, [builder.add(r0v, c(h))])
            m_old = builder.load(mp)
            builder.store(builder.select(builder.fcmp_ordered(">", m_new, m_old), m_new, m_old), mp)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _dot64_keys8(typingctx, qarr, qo, karr, ko, kstride, n_blocks, oarr, oo):
    """Eight :func:`_lane_dot` (lanes = 64) dot products of one query row qarr[qo ...] (float32
    holding float16 values) with the eight float16 keys at karr[ko + i * kstride] (uint16
    bits, i < 8), written to oarr[oo + i]: the same order (64 lanes, block after block, then
    lane l + h into lane l for h = 32, ..., 1), the same values except that a score of
    exactly zero may carry the other sign: the products of float16 values are exact in
    float32, so a block's fused multiply-add rounds as the multiply then add, and the first
    block starts from its product instead of 0 + product. Each key is widened once; the last
    three halving steps of the eight keys are done together (quant.ir._tree8_many's
    transposed tree, exactly these pairings)."""
    sig = types.void(qarr, qo, karr, ko, kstride, n_blocks, oarr, oo)
    n_blocks_literal = n_blocks.literal_value if isinstance(n_blocks, types.IntegerLiteral) else 0

    def codegen(context, builder, signature, args):
        i64 = _ir.IntType(64)
        v64 = _ir.VectorType(_ir.FloatType(), 64)
        qp = _ptr_arg(context, builder, signature, args, 0, 1)
        kp = _ptr_arg(context, builder, signature, args, 2, 3)
        op_ = _ptr_arg(context, builder, signature, args, 6, 7)
        kst, nb = _i64_arg(context, builder, signature, args, 4), _i64_arg(context, builder, signature, args, 5)

        def block(i, off):
            return (_load_f32(builder, qp, off, 64),
                    _load_half(builder, kp, builder.add(builder.mul(_ir.Constant(i64, i), kst), off), 64))

        eights = []
        for i in range(8):
            q0, k0 = block(i, _ir.Constant(i64, 0))
            acc = builder.fmul(q0, k0)
            if n_blocks_literal != 1:
                acc_p = _cg.alloca_once_value(builder, acc)
                with _cg.for_range(builder, builder.sub(nb, _ir.Constant(i64, 1))) as loop:
                    qv, kv = block(i, builder.mul(builder.add(loop.index, _ir.Constant(i64, 1)),
                                                  _ir.Constant(i64, 64)))
                    builder.store(_qir._call(builder, "llvm.fma.v64f32", v64, [qv, kv, builder.load(acc_p)]), acc_p)
                acc = builder.load(acc_p)
            for h in (32, 16, 8):
                acc = builder.fadd(_qir._shuf(builder, acc, range(h)), _qir._shuf(builder, acc, range(h, 2 * h)))
            eights.append(acc)
        sums, lane = _qir._tree8_many(builder, eights, [(i,) for i in range(8)])
        for i in range(8):
            builder.store(builder.extract_element(sums, _ir.Constant(_ir.IntType(32), lane[i])),
                          builder.gep(op_, [_ir.Constant(i64, i)]))
        return context.get_dummy_value()

    return sig, codegen


def _fold64(builder, t):
    """The 64-lane halving of ggml_vec_dot_f16 on its parts (part y = lanes w*y .. w*y + w-1,
    w = 64 / len(t), eight parts of 8 lanes or four of 16): lane l + 32, then l + 16, then
    l + 8, leaving the 8 lanes that :func:`_qir._tree8_many` then halves three more times
    (8-lane parts, 64 -> 32: part y + part y + 4; 32 -> 16: y + y + 2; 16 -> 8: part 0 +
    part 1; 16-lane parts: y + y + 2, then 0 + 1, then the low eight lanes + the high eight)."""
    if len(t) == 4:
        u = [builder.fadd(t[y], t[y + 2]) for y in range(2)]
        x = builder.fadd(u[0], u[1])
        return _fold16(builder, x)
    u = [builder.fadd(t[y], t[y + 4]) for y in range(4)]
    w = [builder.fadd(u[y], u[y + 2]) for y in range(2)]
    return builder.fadd(w[0], w[1])


@intrinsic
def _dot64_heads_keys8(typingctx, qarr, qo, qstride, n_heads, karr, ko, kstride, n_blocks, oarr, oo, ostride):
    """:func:`_dot64_keys8` for ``n_heads`` query rows at once (both literals: n_heads rows at
    qarr[qo + h * qstride], float32 holding float16 values; n_blocks = D / 64): the scores of
    each row with the eight float16 keys at karr[ko + i * kstride] go to
    oarr[oo + h * ostride + i]. Each key part is loaded and widened once for all the rows (a
    GQA group's heads share their KV head's keys); every score is summed exactly as
    :func:`_dot64_keys8` sums it (64 lanes over the blocks, the first block's product, fused
    multiply-adds after it; then the halving tree). Prefetches the eight rows
    ``_KV_PREFETCH_KEYS`` keys on (a hint: never faults past the cache)."""
    if not (isinstance(n_heads, types.IntegerLiteral) and isinstance(n_blocks, types.IntegerLiteral)):
        return None
    sig = types.void(qarr, qo, qstride, n_heads, karr, ko, kstride, n_blocks, oarr, oo, ostride)
    nh = n_heads.literal_value
    nb = n_blocks.literal_value

    def codegen(context, builder, signature, args):
        w = _SCORE_LANES
        vw = _ir.VectorType(_ir.FloatType(), w)
        c = _c64
        qp = _ptr_arg(context, builder, signature, args, 0, 1)
        kp = _ptr_arg(context, builder, signature, args, 4, 5)
        op_ = _ptr_arg(context, builder, signature, args, 8, 9)
        qs, kst, ost = (_i64_arg(context, builder, signature, args, k) for k in (2, 6, 10))

        def qpart(h, b, y):
            return _load_f32(builder, qp, builder.add(builder.mul(c(h), qs), c(64 * b + w * y)), w)

        if karr.dtype == types.uint16:  # read in place: the rows _KV_PREFETCH_KEYS keys on
            for i in range(8):
                _prefetch_lines(builder, builder.gep(kp, [builder.mul(c(_KV_PREFETCH_KEYS + i), kst)]), 2 * nb)
        xs: list[list[Any]] = [[] for _ in range(nh)]
        for i in range(8):
            krow = builder.gep(kp, [builder.mul(c(i), kst)])
            t: list[list[Any]] = [[None] * (64 // w) for _ in range(nh)]
            for y in ((0, 4, 1, 5, 2, 6, 3, 7) if w == 8 else (0, 2, 1, 3)):
                for b in range(nb):
                    kv = _load_half(builder, krow, c(64 * b + w * y), w)
                    for h in range(nh):
                        if b == 0:
                            t[h][y] = builder.fmul(qpart(h, b, y), kv)
                        else:
                            t[h][y] = _qir._call(builder, f"llvm.fma.v{w}f32", vw, [qpart(h, b, y), kv, t[h][y]])
            for h in range(nh):
                xs[h].append(_fold64(builder, t[h]))
        for h in range(nh):
            sums, lane = _qir._tree8_many(builder, xs[h], [(i,) for i in range(8)])
            orow = builder.gep(op_, [builder.mul(c(h), ost)])
            for i in range(8):
                builder.store(builder.extract_element(sums, _ir.Constant(_ir.IntType(32), lane[i])),
                              builder.gep(orow, [c(i)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _pv_heads16(typingctx, acc, ao, astride, n_heads, p, po, pstride, vb, vo, vstride, ja, jb, n_dim, n_parts):
    """acc[ao + h * astride + i] += p[po + h * pstride + j] * v_j[i] for the ``n_heads`` rows h
    (a literal, at most 4) of one KV head's group, j = ja..jb-1 in key order, i < n_dim (a
    multiple of 16), v_j the float16 row at vb[vo + j * vstride] (uint16 bits): every
    element's sum is :func:`_pv_exact`'s (fused multiply-adds in key order), but each value
    part is loaded and widened once for all the rows, and 8 x n_parts dims x n_heads rows of
    accumulators stay in registers over the whole key range (vectors of 16 lanes where
    _SCORE_LANES is 16 and n_parts is even, else of 8: the same sums). Read in place (uint16),
    each key's pass prefetches its part of the row ``_KV_PREFETCH_KEYS`` keys on."""
    if not (isinstance(n_heads, types.IntegerLiteral) and isinstance(n_parts, types.IntegerLiteral)):
        return None
    sig = types.void(acc, ao, astride, n_heads, p, po, pstride, vb, vo, vstride, ja, jb, n_dim, n_parts)
    nh = n_heads.literal_value
    npt = n_parts.literal_value
    load_v = _load_half if vb.dtype == types.uint16 else _load_f32

    # 8 * npt dims per pass, as vectors of 16 lanes where those run (npt even), else of 8
    w = 16 if (_SCORE_LANES == 16 and npt % 2 == 0) else 8
    nv = 8 * npt // w

    def codegen(context, builder, signature, args):
        vw = _ir.VectorType(_ir.FloatType(), w)
        c = _c64
        ap = _ptr_arg(context, builder, signature, args, 0, 1)
        pp = _ptr_arg(context, builder, signature, args, 4, 5)
        vp = _ptr_arg(context, builder, signature, args, 7, 8)
        ast, pst, vst, ja_, jb_, nd = (_i64_arg(context, builder, signature, args, k) for k in (2, 6, 9, 10, 11, 12))

        with _cg.for_range(builder, builder.sdiv(nd, c(8 * npt))) as dl:
            d0 = builder.mul(dl.index, c(8 * npt))
            aptr = [[builder.bitcast(builder.gep(ap, [builder.add(builder.mul(c(h), ast), builder.add(d0, c(w * y)))]),
                                     vw.as_pointer()) for y in range(nv)] for h in range(nh)]
            accs = [[_cg.alloca_once_value(builder, builder.load(aptr[h][y], align=4)) for y in range(nv)]
                    for h in range(nh)]
            with _cg.for_range_slice(builder, ja_, jb_, c(1), inc=True) as (j, _):
                vrow = builder.gep(vp, [builder.add(builder.mul(j, vst), d0)])
                if vb.dtype == types.uint16:  # read in place: this pass's part of the row _KV_PREFETCH_KEYS on
                    _prefetch_lines(builder, builder.gep(vrow, [builder.mul(c(_KV_PREFETCH_KEYS), vst)]), max(1, 16 * npt // 64))
                kv = [load_v(builder, vrow, c(w * y), w) for y in range(nv)]
                for h in range(nh):
                    pj = builder.load(builder.gep(pp, [builder.add(builder.mul(c(h), pst), j)]))
                    pv = builder.shuffle_vector(builder.insert_element(_ir.Constant(vw, None), pj, _ir.Constant(_ir.IntType(32), 0)),
                                                _ir.Constant(vw, None), _ir.Constant(_ir.VectorType(_ir.IntType(32), w), [0] * w))
                    for y in range(nv):
                        builder.store(_qir._call(builder, f"llvm.fma.v{w}f32", vw, [pv, kv[y], builder.load(accs[h][y])]),
                                      accs[h][y])
            for h in range(nh):
                for y in range(nv):
                    builder.store(builder.load(accs[h][y]), aptr[h][y], align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _dot64_tile_keys8(typingctx, qarr, qo, tarr, to, tstride, n_blocks, oarr, oo):
    """:func:`_dot64_keys8` of one query row with eight keys already widened to float32 in a
    tile (tarr[to + i * tstride ...], i < 8; n_blocks = D / 64, a literal): the same sums (64
    lanes over the blocks, the first block's product, fused multiply-adds after it, then
    the halving tree). Slice by slice of eight lanes, the row's n_blocks query parts stay in
    registers over the eight keys (a latent cache has D = 576: nine blocks, one float32 load
    per fused multiply-add)."""
    if not isinstance(n_blocks, types.IntegerLiteral):
        return None
    sig = types.void(qarr, qo, tarr, to, tstride, n_blocks, oarr, oo)
    nb = n_blocks.literal_value

    def codegen(context, builder, signature, args):
        w = _SCORE_LANES
        vw = _ir.VectorType(_ir.FloatType(), w)
        c = _c64
        qp = _ptr_arg(context, builder, signature, args, 0, 1)
        tp = _ptr_arg(context, builder, signature, args, 2, 3)
        op_ = _ptr_arg(context, builder, signature, args, 6, 7)
        tst = _i64_arg(context, builder, signature, args, 4)

        def ld8(p, off):
            return _load_f32(builder, p, off, w)

        t: list[list[Any]] = [[None] * (64 // w) for _ in range(8)]
        krows = [builder.gep(tp, [builder.mul(c(i), tst)]) for i in range(8)]
        for y in range(64 // w):
            for b in range(nb):  # block outer, key inner: eight independent chains in flight
                qv = ld8(qp, c(64 * b + w * y))
                for i in range(8):
                    kv = ld8(krows[i], c(64 * b + w * y))
                    t[i][y] = builder.fmul(qv, kv) if b == 0 else \
                        _qir._call(builder, f"llvm.fma.v{w}f32", vw, [qv, kv, t[i][y]])
        xs = [_fold64(builder, t[i]) for i in range(8)]
        sums, lane = _qir._tree8_many(builder, xs, [(i,) for i in range(8)])
        for i in range(8):
            builder.store(builder.extract_element(sums, _ir.Constant(_ir.IntType(32), lane[i])),
                          builder.gep(op_, [c(i)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _ld_f32(typingctx, arr, idx):
    """arr[idx] as float32: a float32 array's element, or a uint16 array's float16 bits widened."""
    sig = types.float32(arr, idx)
    half = arr.dtype == types.uint16

    def codegen(context, builder, signature, args):
        p = _ptr_arg(context, builder, signature, args, 0, 1)
        v = builder.load(p)
        return builder.fpext(builder.bitcast(v, _ir.HalfType()), _ir.FloatType()) if half else v

    return sig, codegen
