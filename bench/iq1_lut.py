"""Prototype (issue 27): a per-token lookup table for the one-token (T = 1) IQ1_S matmul,
T-MAC-like, measured against the current kernel (table.matmul_rows). Not used by the engine.

IQ1_S (ggml-common.h block_iq1_s, 50 B per 256 elements): f16 d | qs[32] | qh[8] u16; group
k of 8 elements has the 11-bit grid index qs[k] | ((qh[k // 4] >> 3 (k % 4)) & 7) << 8 into
the 2048 x 8 grid of {-1, 0, 1} (codebooks.grid("IQ1_S")); sub-block ib (32 elements) has
the scale 2 ((qh[ib] >> 12) & 7) + 1 and the delta sign qh[ib] >> 15 (ggml-quants.c
dequantize_row_iq1_s).

The current kernel (tiles_k._iq1_s_pieces, AVX2 one-item tile) keeps per super-block 8 int32
lanes: lane k = sum over the 8 sub-blocks ib of (2 s_ib + 1) x (the dot of elements
32 ib + 4 k .. + 3 with the Q8_K values), ggml_vec_dot_iq1_s_q8_K's lanes
(ggml-cpu/arch/x86/quants.c). Its float steps per super-block: acc = fma(float(lanes), d_w
d_x, acc) (8 lanes), mins = mins + ((d_w * -1/8) d_x) float(md), md = sum_m +-(2 s + 1)
bsums[m] over the 16 Q8_K 16-sums; the result ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 +
a7)) - mins. To be bit for bit the same, the table must give each group's two 4-element
halves apart (lane 2 g and 2 g + 1 of the sub-block), not the 8-element sum:

    lut int32 [nb * 32 * 2048]: entry (b, slice s, idx) = lo | hi << 16, lo / hi the int16
    dots of grid[idx][0:4] / [4:8] with the Q8_K values 256 b + 8 s + 0..3 / 4..7
    (|lo|, |hi| <= 4 x 127: exact in int16).

Per sub-block pair the 8 entries (4 groups x 2 sub-blocks) are loaded into one ymm, their
int16 halves paired across the two sub-blocks by one in-lane shuffle and multiplied by the
two scales with one vpmaddwd: exactly the integer lanes above, then the same float steps.
The table is 256 KiB per super-block (8 KiB per 8 columns): it lives in L2, not L1.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from moe_service.engine.quant import codebooks
from moe_service.engine.quant.ir import (
    _F32,
    _I8,
    _I16,
    _I32,
    _VF,
    _VI,
    _call,
    _ci,
    _cvec,
    _data,
    _i64,
    _ldv,
    _madd,
    _prefetch,
    _shuf,
    _slot_fields,
    _vt,
)
from moe_service.engine.quant.tiles_k import _hsum_i32, _iq1_s_indices, _lshr_and, _odd16, _spread
from moe_service.formats import BY_NAME

_F = BY_NAME["IQ1_S"]
_QS, _QH = _F.off("qs"), _F.off("qh")
BLOCK_BYTES = _F.block_bytes  # 50
ENTRIES = 2048  # grid indices
SLICES = 32  # groups of 8 columns per super-block
LUT_PER_BLOCK = SLICES * ENTRIES  # int32 entries per super-block (256 KiB)
STATE = 9  # floats of a row's running state: 8 acc lanes, mins

_G = codebooks.grid("IQ1_S").astype(np.int16)  # [2048, 8] of -1 / 0 / 1
PLANES = np.ascontiguousarray(_G.T)  # int16 [8, 2048]: value j of every grid entry


@njit(nogil=True, cache=True)
def build_lut(xq, xo, nb, planes, lut):
    """lut int32 [nb * LUT_PER_BLOCK] of the Q8_K row at xq[xo:xo + 256 nb] (see the module
    docstring); planes: PLANES."""
    for b in range(nb):
        for s in range(32):
            o = xo + b * 256 + s * 8
            x0, x1, x2, x3 = np.int16(xq[o]), np.int16(xq[o + 1]), np.int16(xq[o + 2]), np.int16(xq[o + 3])
            x4, x5, x6, x7 = (
                np.int16(xq[o + 4]),
                np.int16(xq[o + 5]),
                np.int16(xq[o + 6]),
                np.int16(xq[o + 7]),
            )
            t = (b * 32 + s) * 2048
            for i in range(2048):
                lo = np.int16(planes[0, i] * x0 + planes[1, i] * x1 + planes[2, i] * x2 + planes[3, i] * x3)
                hi = np.int16(planes[4, i] * x4 + planes[5, i] * x5 + planes[6, i] * x6 + planes[7, i] * x7)
                lut[t + i] = (np.int32(lo) & 0xFFFF) | (np.int32(hi) << 16)


_PAIR16 = [
    w
    for lane in range(2)
    for q in range(2)
    for w in (8 * lane + 4 * q, 8 * lane + 4 * q + 2, 8 * lane + 4 * q + 1, 8 * lane + 4 * q + 3)
]
"""Word shuffle of the 8 gathered entries [g0 ib, g0 ib', g1 ib, g1 ib' | g2 .., g3 ..] (each
lo, hi): per group (lo ib, lo ib', hi ib, hi ib'), so vpmaddwd with (s_ib, s_ib') pairs
gives lanes 2 g, 2 g + 1 in order."""


@intrinsic
def lut_row(typingctx, lut, arena, wo, b0, b1, xd, xbs, xa, nb, state, so):
    """Super-blocks [b0, b1) of the IQ1_S row at byte ``wo`` of ``arena`` against the token
    whose table is ``lut`` (build_lut), Q8_K scales xd / 16-sums xbs of activation row xa
    (nb blocks a row); state float32 [so:so + 9] (8 acc lanes, mins) read and written back."""
    sig = types.void(lut, arena, wo, b0, b1, xd, xbs, xa, nb, state, so)

    def codegen(context, builder, signature, args):
        ty = signature.args
        lutp = builder.bitcast(_data(context, builder, ty[0], args[0]), _I32.as_pointer())
        base = builder.bitcast(_data(context, builder, ty[1], args[1]), _I8.as_pointer())
        wo_, b0_, b1_, xa_, nb_, so_ = (_i64(context, builder, args[i], ty[i]) for i in (2, 3, 4, 7, 8, 10))
        row = builder.gep(base, [wo_])
        xdp = builder.gep(
            builder.bitcast(_data(context, builder, ty[5], args[5]), _F32.as_pointer()),
            [builder.mul(xa_, nb_)],
        )
        xbsp = builder.gep(
            builder.bitcast(_data(context, builder, ty[6], args[6]), _I8.as_pointer()),
            [builder.mul(xa_, builder.mul(nb_, _ci(32)))],
        )
        stp = builder.gep(builder.bitcast(_data(context, builder, ty[9], args[9]), _F32.as_pointer()), [so_])
        acc = cgutils.alloca_once(builder, _VF)
        mv = cgutils.alloca_once(builder, _F32)
        ld8 = builder.load(builder.bitcast(stp, _VF.as_pointer()))
        ld8.align = 4
        builder.store(ld8, acc)
        builder.store(builder.load(builder.gep(stp, [_ci(8)])), mv)
        slots = cgutils.alloca_once(builder, _vt(_I16, 32), size=2)
        bb = _ci(BLOCK_BYTES)
        with cgutils.if_likely(builder, builder.icmp_signed("<", b0_, b1_)):
            builder.store(
                _iq1_s_indices(builder, _F, builder.gep(row, [builder.mul(b0_, bb)])),
                builder.gep(slots, [builder.and_(b0_, _ci(1))]),
            )
        with cgutils.for_range_slice(builder, b0_, b1_, _ci(1)) as (b, _):
            o = builder.gep(row, [builder.mul(b, bb)])
            _prefetch(builder, builder.gep(o, [_ci(8192)]))
            nxt = builder.add(b, _ci(1))
            nxt = builder.select(builder.icmp_signed("<", nxt, b1_), nxt, b)
            par = builder.and_(b, _ci(1))
            builder.store(
                _iq1_s_indices(builder, _F, builder.gep(row, [builder.mul(nxt, bb)])),
                builder.gep(slots, [builder.xor(par, _ci(1))]),
            )
            idx = _slot_fields(builder, builder.gep(slots, [par]))
            tb = builder.gep(lutp, [builder.mul(b, _ci(LUT_PER_BLOCK))])
            qh = _ldv(builder, o, _QH, _vt(_I16, 8))
            lanes = ir.Constant(_VI, [0] * 8)
            for p in range(4):
                v = ir.Constant(_VI, None)
                for j in range(8):
                    g, h = j // 2, j % 2
                    k = 4 * (2 * p + h) + g  # group (= slice) of the super-block
                    e = builder.load(builder.gep(tb, [builder.add(idx[k], _ci(k * ENTRIES))]))
                    v = builder.insert_element(v, e, ir.Constant(_I32, j))
                v16 = _shuf(builder, builder.bitcast(v, _vt(_I16, 16)), _PAIR16)
                sc2 = _odd16(
                    builder, _lshr_and(builder, _shuf(builder, qh, [2 * p, 2 * p + 1] * 8), [12] * 16, 7)
                )
                lanes = builder.add(lanes, _madd(builder, v16, sc2))
            q16 = _spread(builder, qh, 16, 2)
            sc16 = _odd16(builder, _lshr_and(builder, q16, [12] * 16, 7))
            neg = builder.icmp_signed("<", q16, _cvec(_I16, [0] * 16))
            mins = builder.select(neg, builder.sub(_cvec(_I16, [0] * 16), sc16), sc16)
            bs = _ldv(builder, xbsp, builder.mul(b, _ci(32)), _vt(_I16, 16))
            md = builder.extract_element(_hsum_i32(builder, [_madd(builder, mins, bs)]), ir.Constant(_I32, 0))
            d = builder.fpext(builder.bitcast(_ldv(builder, o, 0, _I16), ir.HalfType()), _F32)
            yd = builder.load(builder.gep(xdp, [b]))
            dsc = builder.fmul(d, yd)
            one = builder.insert_element(ir.Constant(_VF, None), dsc, ir.Constant(_I32, 0))
            s8 = builder.shuffle_vector(one, one, _cvec(_I32, [0] * 8))
            builder.store(
                _call(builder, "llvm.fma.v8f32", _VF, [builder.sitofp(lanes, _VF), s8, builder.load(acc)]),
                acc,
            )
            t1 = builder.fmul(builder.fmul(d, ir.Constant(_F32, -0.125)), yd)
            builder.store(builder.fadd(builder.load(mv), builder.fmul(t1, builder.sitofp(md, _F32))), mv)
        st8 = builder.store(builder.load(acc), builder.bitcast(stp, _VF.as_pointer()))
        st8.align = 4
        builder.store(builder.load(mv), builder.gep(stp, [_ci(8)]))
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def finish(state, so):
    """A row's result from its state: the current kernel's tree sum of the 8 lanes minus mins."""
    a = state
    return (
        ((a[so] + a[so + 4]) + (a[so + 2] + a[so + 6]))
        + ((a[so + 1] + a[so + 5]) + (a[so + 3] + a[so + 7]))
        - a[so + 8]
    )


@njit(nogil=True, cache=True)
def lut_matmul_rows(lut, arena, wos, rb, n_rows, nb, xd, xbs, xa, out, state, b_step):
    """out[m * n_rows + r] = row r of matrix m (at byte wos[m] + r rb) . the token; the
    super-blocks in steps of ``b_step`` over all rows of all matrices (b_step = nb: row by
    row), so one step's table part (b_step x 256 KiB) is read by every row before the next."""
    n_m = wos.shape[0]
    state[:] = 0.0
    for b0 in range(0, nb, b_step):
        b1 = min(nb, b0 + b_step)
        for m in range(n_m):
            for r in range(n_rows):
                lut_row(lut, arena, wos[m] + r * rb, b0, b1, xd, xbs, xa, nb, state, (m * n_rows + r) * STATE)
    for i in range(n_m * n_rows):
        out[i] = finish(state, i * STATE)


# ---------------------------------------------------------------------------------------
# Measurement: python -m bench.iq1_lut (one thread, CPU time of the calling thread)
# ---------------------------------------------------------------------------------------


def _setup(rng, n_cols, n_tok=1):
    """Q8_K activations of one random token, its table, and quant.matmul_rows' fixed arguments."""
    from moe_service.engine import quant as q

    pa = q.quantize_activations(
        rng.standard_normal((n_tok, n_cols)).astype(np.float32), q.FORMATS[_F.type_id].partner
    )
    nb = n_cols // 256
    lut = np.empty(nb * LUT_PER_BLOCK, np.int32)
    build_lut(pa.xq, 0, nb, PLANES, lut)
    return pa, lut, q.ensure_kernels([_F.type_id])


def _current(arena, wos, n_rows, n_cols, pa, kernels, out):
    """The current kernel over matrices at byte offsets wos (out float32 [len(wos) * n_rows])."""
    from moe_service.engine import quant as q

    rb = n_cols // 256 * BLOCK_BYTES
    rows = np.zeros(1, np.int64)
    for m, wo in enumerate(wos):
        q.matmul_rows(
            arena,
            int(wo),
            _F.type_id,
            n_cols,
            rb,
            0,
            n_rows,
            pa.xf,
            pa.xq,
            pa.xd,
            pa.xs,
            pa.xbs,
            rows,
            rows,
            out,
            0,
            m * n_rows,
            kernels,
        )


def check(rng, n_rows: int, n_cols: int, n_m: int = 2) -> None:
    """The table kernel against the current one, bit for bit, on random blocks (raises)."""
    from moe_service.formats import random_blocks

    pa, lut, kernels = _setup(rng, n_cols)
    nb = n_cols // 256
    rb = nb * BLOCK_BYTES
    arena = np.concatenate(
        [random_blocks(rng, _F.type_id, n_rows, n_cols, scale=s) for s in (0.01, 3e-5)][:n_m]
    )
    wos = np.arange(n_m, dtype=np.int64) * n_rows * rb
    ref = np.empty(n_m * n_rows, np.float32)
    _current(arena, wos, n_rows, n_cols, pa, kernels, ref)
    lut2 = np.empty_like(lut)
    build_lut(pa.xq, 0, nb, PLANES, lut2)
    for step in (nb, 1):
        got = np.empty_like(ref)
        lut_matmul_rows(
            lut2,
            arena,
            wos,
            rb,
            n_rows,
            nb,
            pa.xd,
            pa.xbs,
            0,
            got,
            np.empty(n_m * n_rows * STATE, np.float32),
            step,
        )
        if not np.array_equal(got.view(np.uint32), ref.view(np.uint32)):
            bad = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
            raise AssertionError(
                f"{n_rows}x{n_cols} step {step}: {bad.size} differ, first {bad[:4]}: "
                f"{got[bad[:4]]} vs {ref[bad[:4]]}"
            )


def _cpu_ns(fn, calls):
    """Best and median CPU ns of ``calls`` calls of fn()."""
    import time

    ts = []
    for _ in range(calls):
        t0 = time.thread_time_ns()
        fn()
        ts.append(time.thread_time_ns() - t0)
    return min(ts), float(np.median(ts))


def _lut_call(lut, arena, wos, rb, n_rows, nb, pa, out, state, step, build=False):
    """One table-kernel call (``build``: the token's table first, as a real step must)."""
    if build:
        build_lut(pa.xq, 0, nb, PLANES, lut)
    lut_matmul_rows(lut, arena, wos, rb, n_rows, nb, pa.xd, pa.xbs, 0, out, state, step)


def _l1_indices(arena, n_blocks):
    """Set, in place, group k's grid index of every IQ1_S block of ``arena`` to 16 k (scales and
    delta signs kept): the 32 table entries of a super-block lie in 32 distinct lines and L1
    sets, the same for every row, so the table loads hit L1 (the consumer's compute floor)."""
    blk = arena.reshape(n_blocks, BLOCK_BYTES)
    idx = np.arange(32) * 16
    blk[:, _QS : _QS + 32] = (idx & 255).astype(np.uint8)
    qh = blk[:, _QH : _QH + 16].copy().view(np.uint16) & np.uint16(0xF000)
    hi = (idx >> 8).reshape(8, 4)
    for ib in range(8):
        qh[:, ib] |= np.uint16(sum(int(hi[ib, g]) << (3 * g) for g in range(4)))
    blk[:, _QH : _QH + 16] = qh.view(np.uint8)


def _cycled(sets, n_m, mat):
    """A function returning the byte offsets of the next of ``sets`` sets of n_m matrices."""
    it = [0]

    def nxt():
        s = it[0] % sets
        it[0] += 1
        return np.arange(s * n_m, (s + 1) * n_m, dtype=np.int64) * mat

    return nxt


def main(argv=None) -> int:
    import argparse
    from functools import partial as P

    from moe_service.formats import random_blocks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sets", type=int, default=8, help="distinct matrix sets cycled (streamed from memory)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    for n_rows, n_cols in ((37, 2048), (33, 768), (5, 512)):
        check(rng, n_rows, n_cols)
    print("bit for bit: ok")
    for n_cols in (2048, 768):
        pa, lut, _ = _setup(rng, n_cols)
        b, med = _cpu_ns(P(build_lut, pa.xq, 0, n_cols // 256, PLANES, lut), 50)
        print(f"build {n_cols} cols: best {b / 1e3:.1f} us, median {med / 1e3:.1f} us")
    # hot in L2: 256 rows x n_cols, one matrix, no table build; "l1" the same rows with every
    # group's index pointing at a line of its own in L1 (a floor no real row reaches)
    for n_rows, n_cols, layout in ((256, 2048, "random"), (256, 2048, "l1"), (256, 768, "random")):
        pa, lut, kernels = _setup(rng, n_cols)
        nb = n_cols // 256
        arena = random_blocks(rng, _F.type_id, n_rows, n_cols)
        if layout == "l1":
            _l1_indices(arena, n_rows * nb)
        wos = np.zeros(1, np.int64)
        out = np.empty(n_rows, np.float32)
        state = np.empty(n_rows * STATE, np.float32)
        per32 = n_rows * n_cols / 32
        lut_args = (lut, arena, wos, nb * BLOCK_BYTES, n_rows, nb, pa, out, state)
        for rnd in range(args.rounds):
            c = _cpu_ns(P(_current, arena, wos, n_rows, n_cols, pa, kernels, out), 200)
            a = _cpu_ns(P(_lut_call, *lut_args, nb), 200)
            s1 = _cpu_ns(P(_lut_call, *lut_args, 1), 200)
            print(
                f"hot {n_rows}x{n_cols} {layout} r{rnd}: ns/32w best (median) current {c[0] / per32:.3f} ({c[1] / per32:.3f})"
                f" | lut rows {a[0] / per32:.3f} ({a[1] / per32:.3f}) | lut blocks {s1[0] / per32:.3f} "
                f"({s1[1] / per32:.3f})  [no build]"
            )
    # the qwen3 step: gate + up of 8 experts (16 matrices of 768 x 2048) sharing the token's
    # table, built per call; matrix sets cycled so the weights come from memory
    for n_m, n_rows, n_cols in ((16, 768, 2048), (8, 2048, 768)):
        nb = n_cols // 256
        rb = nb * BLOCK_BYTES
        arena = random_blocks(rng, _F.type_id, args.sets * n_m * n_rows, n_cols)
        pa, lut, kernels = _setup(rng, n_cols)
        out = np.empty(n_m * n_rows, np.float32)
        state = np.empty(n_m * n_rows * STATE, np.float32)
        per32 = n_m * n_rows * n_cols / 32
        nxt = _cycled(args.sets, n_m, n_rows * rb)

        def cur(nxt=nxt, arena=arena, n_rows=n_rows, n_cols=n_cols, pa=pa, kernels=kernels, out=out):
            _current(arena, nxt(), n_rows, n_cols, pa, kernels, out)

        def lut_step(
            step, nxt=nxt, arena=arena, rb=rb, n_rows=n_rows, nb=nb, pa=pa, out=out, state=state, lut=lut
        ):
            _lut_call(lut, arena, nxt(), rb, n_rows, nb, pa, out, state, step, build=True)

        for rnd in range(args.rounds):
            c = _cpu_ns(cur, 4 * args.sets)
            a = _cpu_ns(P(lut_step, nb), 4 * args.sets)
            s1 = _cpu_ns(P(lut_step, 1), 4 * args.sets)
            print(
                f"step {n_m}x{n_rows}x{n_cols} ({arena.nbytes >> 20} MiB cycled) r{rnd}: ns/32w best (median) "
                f"current {c[0] / per32:.3f} ({c[1] / per32:.3f}) | lut rows {a[0] / per32:.3f} "
                f"({a[1] / per32:.3f}) | lut blocks {s1[0] / per32:.3f} ({s1[1] / per32:.3f})  [with build]"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
