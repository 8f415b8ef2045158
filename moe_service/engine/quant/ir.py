"""numba intrinsics: raw loads and stores, f16/bf16 conversions, rounding, atomics, raw
address views, and the LLVM vector building blocks the tile kernels and activation
quantizers emit. The worker pool (pool.py) and the MoE step (moe.py) use the scalar ones.

Importing this module switches on LLVM's SLP vectorizer for every numba function compiled
afterwards in this process (see below) and initializes LLVM's assembly parser.
"""

from __future__ import annotations

import os

import llvmlite.binding as _llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as _numba_config
from numba.extending import intrinsic

# The scalar kernels (quantizers, dequantization) rely on LLVM's SLP vectorizer to turn
# unrolled element loops into vector code (measured ~6x on a scalar Q8_0 dot). numba keeps
# it off by default; it is read when each function is optimized, so setting it here covers
# every function compiled in this process (the rest of the engine's numba code only gains).
_numba_config.SLP_VECTORIZE = 1

# ld_f16x2 uses two instructions of inline assembly; LLVM needs its assembly parser for that.
_llb.initialize_native_asmparser()

# ---------------------------------------------------------------------------------------
# Intrinsics: raw loads, f16/bf16 conversions, rounding, atomics (used by pool.py as well)
# ---------------------------------------------------------------------------------------

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _data(context, builder, aryty, ary):
    """Data pointer of a numba array, or the pointer itself for a CPointer."""
    if isinstance(aryty, types.CPointer):
        return ary
    return context.make_array(aryty)(context, builder, ary).data


def _byte_ptr(context, builder, aryty, ary, off, llty):
    data = builder.bitcast(_data(context, builder, aryty, ary), _I8.as_pointer())
    return builder.bitcast(builder.gep(data, [off]), llty.as_pointer())


@intrinsic
def ld(typingctx, arr, idx):
    """Element ``idx`` of a 1-D C array: no bounds check and no negative-index wraparound."""
    sig = arr.dtype(arr, idx)

    def codegen(context, builder, signature, args):
        data = _data(context, builder, signature.args[0], args[0])
        i = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.load(builder.gep(data, [i]))

    return sig, codegen


@intrinsic
def data_ptr(typingctx, arr):
    """The data pointer of a 1-D array as a CPointer (no reference count: the kernels' inner
    functions take pointers so no NRT incref/decref runs per row; the array must outlive it)."""
    sig = types.CPointer(arr.dtype)(arr)

    def codegen(context, builder, signature, args):
        return _data(context, builder, signature.args[0], args[0])

    return sig, codegen


@intrinsic
def st(typingctx, arr, idx, val):
    """``arr[idx] = val`` for a 1-D C array: no bounds check and no wraparound."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        data = _data(context, builder, signature.args[0], args[0])
        i = context.cast(builder, args[1], signature.args[1], types.int64)
        v = context.cast(builder, args[2], signature.args[2], signature.args[0].dtype)
        builder.store(v, builder.gep(data, [i]))
        return context.get_dummy_value()

    return sig, codegen


def _byte_loader(llty, retty, convert, doc):
    @intrinsic
    def loader(typingctx, arena, off):
        sig = retty(arena, off)

        def codegen(context, builder, signature, args):
            o = context.cast(builder, args[1], signature.args[1], types.int64)
            v = builder.load(_byte_ptr(context, builder, signature.args[0], args[0], o, llty))
            v.align = 1
            return convert(builder, v)

        return sig, codegen

    loader.__doc__ = doc
    return loader


ld_i8 = _byte_loader(_I8, types.int32, lambda b, v: b.sext(v, _I32), "int8 at a byte offset, as int32.")
ld_u8 = _byte_loader(_I8, types.int32, lambda b, v: b.zext(v, _I32), "uint8 at a byte offset, as int32.")
ld_i16 = _byte_loader(_I16, types.int32, lambda b, v: b.sext(v, _I32), "int16 at a byte offset, as int32.")
ld_u32 = _byte_loader(_I32, types.int64, lambda b, v: b.zext(v, _I64), "uint32 at a byte offset, as int64.")
ld_f32 = _byte_loader(_F32, types.float32, lambda b, v: v, "float32 at a byte offset.")
ld_f16 = _byte_loader(_I16, types.float32, lambda b, v: b.fpext(b.bitcast(v, ir.HalfType()), _F32),
                      "float16 at a byte offset, widened exactly to float32 (vcvtph2ps).")
ld_bf16 = _byte_loader(_I16, types.float32,
                       lambda b, v: b.bitcast(b.shl(b.zext(v, _I32), ir.Constant(_I32, 16)), _F32),
                       "bfloat16 at a byte offset, widened exactly to float32.")


@intrinsic
def ld_f16x2(typingctx, arena, off):
    """The two float16 at byte offsets ``off`` and ``off + 2``, widened to float32, as a tuple.

    The block kernels read their float16 scales with this: one 4-byte load into a general
    register, then ``vmovd`` + ``vcvtph2ps`` (inline asm). Left to itself LLVM narrows the
    load and inserts it into a live xmm register with ``vpinsrw``, which chains every block
    on the previous block's scale arithmetic (measured 2.8x slower on Q4_0).
    """
    retty = types.UniTuple(types.float32, 2)
    sig = retty(arena, off)

    def codegen(context, builder, signature, args):
        o = context.cast(builder, args[1], signature.args[1], types.int64)
        v = builder.load(_byte_ptr(context, builder, signature.args[0], args[0], o, _I32))
        v.align = 1
        f4 = builder.asm(ir.FunctionType(ir.VectorType(_F32, 4), [_I32]),
                         "vmovd $1, $0\n\tvcvtph2ps $0, $0", "=x,r", [v], False)
        a = builder.extract_element(f4, ir.Constant(_I32, 0))
        b = builder.extract_element(f4, ir.Constant(_I32, 1))
        return context.make_tuple(builder, retty, [a, b])

    return sig, codegen


@intrinsic
def f16_round(typingctx, x):
    """float32 -> float16 (nearest even, as GGML_FP32_TO_FP16) -> float32."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), _F32)

    return sig, codegen


def _unary_f32_intrinsic(llvm_name, doc):
    @intrinsic
    def fn(typingctx, x):
        sig = types.float32(types.float32)

        def codegen(context, builder, signature, args):
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32]), llvm_name)
            return builder.call(f, [args[0]])

        return sig, codegen

    fn.__doc__ = doc
    return fn


roundf = _unary_f32_intrinsic("llvm.round.f32", "C roundf: round half away from zero.")
rintf = _unary_f32_intrinsic("llvm.rint.f32", "Round half to even (ggml's nearest_int for |x| < 2^22).")


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE-754 bits of a float32, as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return sig, codegen


@intrinsic
def bits_f32(typingctx, x):
    """The float32 whose IEEE-754 bits are the low 32 bits of the integer ``x``."""
    sig = types.float32(x)

    def codegen(context, builder, signature, args):
        v = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(v, _F32)

    return sig, codegen


def _elem_ptr(context, builder, aryty, ary, idx, idxty):
    data = _data(context, builder, aryty, ary)
    return builder.gep(data, [context.cast(builder, idx, idxty, types.int64)])


@intrinsic
def atomic_load(typingctx, arr, idx):
    """Sequentially consistent load of int64 element ``idx`` (a volatile read for spin loops)."""
    sig = types.int64(arr, idx)

    def codegen(context, builder, signature, args):
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        return builder.load_atomic(p, "seq_cst", 8)

    return sig, codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """Sequentially consistent store into int64 element ``idx``."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(v, p, "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """Atomically add ``val`` to int64 element ``idx`` (``lock xadd``); returns the old value."""
    sig = types.int64(arr, idx, val)

    def codegen(context, builder, signature, args):
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", p, v, "seq_cst")

    return sig, codegen


@intrinsic
def cpu_relax(typingctx):
    """Spin-wait hint (x86 ``pause``)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                           "llvm.x86.sse2.pause")
        builder.call(f, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cycle_counter(typingctx):
    """The CPU cycle counter (``rdtsc`` via llvm.readcyclecounter), as int64."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, []), "llvm.readcyclecounter")
        return builder.call(f, [])

    return sig, codegen


def _addr_view(dtype):
    arrty = types.Array(dtype, 1, "C")

    @intrinsic
    def view(typingctx, addr, n):
        sig = arrty(addr, n)

        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[0], signature.args[0], types.int64)
            count = context.cast(builder, args[1], signature.args[1], types.int64)
            llelem = context.get_data_type(dtype)
            ary = context.make_array(arrty)(context, builder)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(llelem))
            context.populate_array(ary, data=builder.inttoptr(a, llelem.as_pointer()),
                                   shape=cgutils.pack_array(builder, [count]),
                                   strides=cgutils.pack_array(builder, [itemsize]),
                                   itemsize=itemsize, meminfo=None)
            return ary._getvalue()

        return sig, codegen

    view.__doc__ = f"A 1-D {dtype} array of ``n`` elements at raw address ``addr`` (no ownership)."
    return view


view_u8 = _addr_view(types.uint8)
view_i8 = _addr_view(types.int8)
view_i16 = _addr_view(types.int16)
view_i32 = _addr_view(types.int32)
view_i64 = _addr_view(types.int64)
view_f32 = _addr_view(types.float32)

_JIT = dict(nogil=True, cache=True)
_JIT_FLOAT = dict(nogil=True, cache=True, fastmath={"reassoc", "contract", "nsz"})
_JIT_INLINE = dict(nogil=True, cache=True, inline="always")



# ---------------------------------------------------------------------------------------
# Vector building blocks (LLVM vector IR) for the tile kernels (tiles32.py, tiles_k.py)
# ---------------------------------------------------------------------------------------
# As ggml's x86 kernels: weights become bytes (unpacked nibbles, or the int8 values),
# multiplied with the activation's int8 by vpdpbusd (AVX-512 VNNI: unsigned x signed bytes,
# four adjacent products summed into each int32 lane) or by vpmaddubsw (unsigned x signed
# bytes -> int16 pair sums) + vpmaddwd (int16 pairs -> int32, times 1 or times the
# sub-block scale). No int16 pair sum can saturate: |w| <= 128 and |a| <= 127 (both
# quantizers clamp to 127), so 2 * 128 * 127 = 32512. Integer sums are exact, so every
# instruction choice gives the same int32 lanes; the float steps are spelled out per lane.

def _target_has_avx512() -> bool:
    """Whether numba compiles for a CPU with AVX-512 BW + VL + VNNI (the host, unless
    NUMBA_CPU_NAME is set): the 512-bit kernels need all three (Ice Lake / Zen 4 and later);
    other AVX-512 CPUs (Skylake-SP) run the AVX2 code. MOE_SERVICE_KERNEL_ISA=avx2 forces the
    AVX2 code (the engine's numba cache folder is keyed by it, see engine/__init__.py)."""
    if os.environ.get("MOE_SERVICE_KERNEL_ISA", "").lower() == "avx2":
        return False
    need = ("avx512bw", "avx512vl", "avx512vnni")
    if _numba_config.CPU_NAME:
        return all(f"+{f}" in (_numba_config.CPU_FEATURES or "") for f in need)
    feats = _llb.get_host_cpu_features()
    return all(bool(feats.get(f, False)) for f in need)


_AVX512 = _target_has_avx512()
_VNNI = _AVX512  # the 512-bit path requires AVX-512 BW + VL + VNNI (see _target_has_avx512)
_VF = ir.VectorType(_F32, 8)
_VI = ir.VectorType(_I32, 8)


def _vt(t, n):
    return ir.VectorType(t, n)


def _cvec(t, vals):
    return ir.Constant(_vt(t, len(vals)), list(vals))


def _splat_f32(builder, v, n):
    """<n x float> of the scalar float v."""
    one = builder.insert_element(ir.Constant(_vt(_F32, n), None), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, _cvec(_I32, [0] * n))


def _i64(context, builder, val, ty):
    return context.cast(builder, val, ty, types.int64)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _maddubs(builder, w_u8, a_s8):
    """vpmaddubsw: <32 x u8> . <32 x s8> -> <16 x i16> sums of adjacent products."""
    return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vt(_I16, 16), [w_u8, a_s8])


def _madd(builder, p16, m16):
    """vpmaddwd: <16 x i16> . <16 x i16> -> <8 x i32> sums of adjacent products."""
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _VI, [p16, m16])


def _maddubs512(builder, w_u8, a_s8):
    """512-bit vpmaddubsw: <64 x u8> . <64 x s8> -> <32 x i16> (AVX-512BW)."""
    return _call(builder, "llvm.x86.avx512.pmaddubs.w.512", _vt(_I16, 32), [w_u8, a_s8])


def _dot_scaled512(builder, u8, s8, sc32, iacc):
    """iacc <16 x i32> += vpdpwssd(vpmaddubsw(u8, s8), sc32): the <64 x u8> . <64 x s8>
    adjacent-pair sums (<32 x i16>) times the int16 scales sc32, pairs summed into lane j =
    elements 4 j .. 4 j + 3 (AVX-512 BW + VNNI; exact while no pair sum saturates)."""
    vi = _vt(_I32, 16)
    p = _maddubs512(builder, u8, s8)
    return _call(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [iacc, builder.bitcast(p, vi), builder.bitcast(sc32, vi)])


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, _cvec(_I32, range(2 * n)))


def _abs8(builder, w):
    return _call(builder, "llvm.abs.v32i8", _vt(_I8, 32), [w, ir.Constant(ir.IntType(1), 0)])


def _sign8(builder, a, w):
    """vpsignb: a where w > 0, -a where w < 0, 0 where w == 0."""
    return _call(builder, "llvm.x86.avx2.psign.b", _vt(_I8, 32), [a, w])


_ONES16 = _cvec(_I16, [1] * 16)




def _ldv(builder, ptr, off, vty, align=1):
    """Load a value of type vty at byte offset ``off`` (an int or an i64 value) of the i8* ``ptr``."""
    if isinstance(off, int):
        off = _ci(off)
    p = builder.bitcast(builder.gep(ptr, [off]), vty.as_pointer())
    v = builder.load(p)
    v.align = align
    return v


def _ci(v):
    return ir.Constant(_I64, v)


def _shuf(builder, v, idx):
    return builder.shuffle_vector(v, v, _cvec(_I32, idx))


def _cat(builder, parts):
    """Concatenate equal vectors into one."""
    while len(parts) > 1:
        parts = [_concat(builder, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def _tree8(builder, v, lo):
    """Pairwise sum of lanes lo..lo+7 of float vector v, as _acc_sum."""
    v = builder.shuffle_vector(v, v, _cvec(_I32, range(lo, lo + 8)))
    n = 8
    while n > 1:
        h = n // 2
        v = builder.fadd(_shuf(builder, v, range(h)), _shuf(builder, v, range(h, n)))
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _tree8_many(builder, vecs, ids):
    """The _tree8 sums of many 8-lane float groups at once (transposed: ~1.3 vector ops per
    group instead of ~7), with exactly _tree8's pairings: (j, j+4), then (j, j+2), then (0, 1).

    vecs: <8 x float> (one group) or <16 x float> (two groups) values; ids: per vector, the
    ids of its groups. Returns (one float vector holding every sum, {id: lane})."""
    zero8 = ir.Constant(_VF, [0.0] * 8)
    zero16 = ir.Constant(_vt(_F32, 16), [0.0] * 16)
    v16, gid, eights = [], [], []
    for v, i in zip(vecs, ids, strict=True):
        if v.type.count == 16:
            v16.append(v)
            gid += list(i)
        else:
            eights.append((v, i[0]))
    if len(eights) % 2:
        eights.append((zero8, None))
    for (a, ia), (b, ib) in zip(eights[::2], eights[1::2], strict=True):
        v16.append(_concat(builder, a, b))
        gid += [ia, ib]

    def level(vs, lanes):  # each group of ``lanes`` lanes -> lanes/2: j + (j + lanes/2)
        if len(vs) % 2:
            vs = vs + [zero16]
        h = lanes // 2
        out = []
        for a, b in zip(vs[::2], vs[1::2], strict=True):
            lo = [16 * src + lanes * g + j for src in (0, 1) for g in range(16 // lanes) for j in range(h)]
            out.append(builder.fadd(builder.shuffle_vector(a, b, _cvec(_I32, lo)),
                                    builder.shuffle_vector(a, b, _cvec(_I32, [i + h for i in lo]))))
        return out

    w = level(level(level(v16, 8), 4), 2)  # 16 group sums per vector, in input order
    while len(w) & (len(w) - 1):
        w.append(zero16)
    return _cat(builder, w), {g: lane for lane, g in enumerate(gid) if g is not None}


def _store_rows(builder, outp, orow, i0, ostride, ocol, res, n_w, n_a):
    """res: float vector, lane t * n_w + k = the result of (weight row k, item t): one n_w-float
    store per item at out[o_rows[i0 + t] * ostride + ocol]."""
    for t in range(n_a):
        orow_t = builder.load(builder.gep(orow, [builder.add(i0, _ci(t))]))
        ptr = builder.gep(outp, [builder.add(builder.mul(orow_t, ostride), ocol)])
        if n_w == 1:
            builder.store(builder.extract_element(res, ir.Constant(_I32, t)), ptr)
        else:
            st_ = builder.store(_shuf(builder, res, range(t * n_w, t * n_w + n_w)),
                                builder.bitcast(ptr, _vt(_F32, n_w).as_pointer()))
            st_.align = 4





# Software prefetch distance, at least the next tile (n_w rows on) and at least this many
# bytes: a tile streams n_w rows side by side, which the hardware prefetchers do not follow
# (T=1 from DRAM ran at half speed without prefetching). Measured on Zen 5 at T=1, one
# thread (GB/s vs distance 2/4/6/8/12/16 KiB): the 32-element formats peak at 8-16 KiB
# (Q4_1 +30% at 12 KiB over 8 KiB), the K-quants at 8 KiB (Q6_K -10% at 12 KiB).
_PF_MIN_32 = 12288
_PF_MIN_K = 8192


def _pf_distance(builder, rb, n_w, min_bytes):
    """Prefetch distance in bytes: max(n_w * rb, min_bytes) (see _PF_MIN_32)."""
    d = builder.mul(rb, _ci(n_w))
    return builder.select(builder.icmp_signed("<", d, _ci(min_bytes)), _ci(min_bytes), d)


def _prefetch(builder, ptr):
    """prefetcht0 of the line at i8* ptr (a hint: never faults)."""
    _call(builder, "llvm.prefetch.p0", ir.VoidType(), [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                                         ir.Constant(_I32, 1)])


def _tile_args(context, builder, sig, args, n_w, n_a):
    """The tile intrinsics' arguments (fmt, n_w, n_a, arena, wo, rb, nb, xq, xd, x3, a_rows, i0,
    o_rows, out, out_stride, out_col) as IR values: (rb, nb, i0, out_stride, out_col as i64; xq as
    i8*, xd as f32*, x3's data pointer for the caller to cast (Q8_1 sums f32*, Q8_K block sums
    i8*); o_rows' and out's data pointers; the n_w weight row pointers wo + k*rb into the
    arena; the n_a activation rows a_rows[i0 + t])."""
    (_, _, _, arena, wo, rb, nb, xq, xd, x3, a_rows, i0, o_rows, out, ostride, ocol) = args
    ty = sig.args
    wo, rb, nb, i0, ostride, ocol = (_i64(context, builder, v, t) for v, t in
                                    ((wo, ty[4]), (rb, ty[5]), (nb, ty[6]), (i0, ty[11]), (ostride, ty[14]),
                                     (ocol, ty[15])))
    base = builder.bitcast(_data(context, builder, ty[3], arena), _I8.as_pointer())
    xq8 = builder.bitcast(_data(context, builder, ty[7], xq), _I8.as_pointer())
    xd32 = builder.bitcast(_data(context, builder, ty[8], xd), _F32.as_pointer())
    x3p = _data(context, builder, ty[9], x3)
    arow = _data(context, builder, ty[10], a_rows)
    orow = _data(context, builder, ty[12], o_rows)
    outp = _data(context, builder, ty[13], out)
    wrow = [builder.gep(base, [builder.add(wo, builder.mul(rb, _ci(k)))]) for k in range(n_w)]
    arows = [builder.load(builder.gep(arow, [builder.add(i0, _ci(t))])) for t in range(n_a)]
    return rb, nb, i0, ostride, ocol, xq8, xd32, x3p, orow, outp, wrow, arows


@intrinsic
def dot_f32_ggml(typingctx, arena, wo, xf, xo, n):
    """float32 dot of the n float32 at byte ``wo`` of ``arena`` with ``xf[xo : xo + n]``, in
    ggml's F32 order on AVX-512 (llamafile's tinyBLAS, what llama.cpp runs for an F32
    matrix such as an MoE router): 16 lanes, lane l = fma over elements l, l + 16, ... in
    order, then the pairwise tree of _mm512_reduce_add_ps ((l, l + 8), (l, l + 4),
    (l, l + 2), (0, 1)). Elements past the last multiple of 16 (tinyBLAS refuses such
    rows; ggml then uses another kernel) are added by fma one by one. The explicit vector
    IR fixes the order on every ISA (AVX2 runs each 16-lane fma as two 8-lane ones), so the
    result does not depend on the host CPU, T, or the caller's fast-math flags."""
    sig = types.float32(arena, wo, xf, xo, n)

    def codegen(context, builder, signature, args):
        ty = signature.args
        base = builder.bitcast(_data(context, builder, ty[0], args[0]), _I8.as_pointer())
        w0 = context.cast(builder, args[1], ty[1], types.int64)
        xp = builder.bitcast(_data(context, builder, ty[2], args[2]), _F32.as_pointer())
        x0 = context.cast(builder, args[3], ty[3], types.int64)
        nn = context.cast(builder, args[4], ty[4], types.int64)
        v16 = _vt(_F32, 16)
        acc = cgutils.alloca_once(builder, v16)
        builder.store(ir.Constant(v16, [0.0] * 16), acc)
        nv = builder.lshr(nn, _ci(4))
        with cgutils.for_range(builder, nv) as loop:
            j = builder.mul(loop.index, _ci(16))
            w = _ldv(builder, base, builder.add(w0, builder.mul(j, _ci(4))), v16)
            xv = builder.load(builder.bitcast(builder.gep(xp, [builder.add(x0, j)]), v16.as_pointer()))
            xv.align = 4
            builder.store(_call(builder, "llvm.fma.v16f32", v16, [w, xv, builder.load(acc)]), acc)
        v = builder.load(acc)
        # numba's fastmath pass adds its flags (reassoc among them) to every float op that has
        # none, in the whole module of a fastmath caller (table._mm_float): a flag of no effect
        # on an add ('arcp') keeps these adds in the order written
        for h in (8, 4, 2, 1):
            v = builder.fadd(_shuf(builder, v, range(h)), _shuf(builder, v, range(h, 2 * h)), flags=("arcp",))
        res = cgutils.alloca_once(builder, _F32)
        builder.store(builder.extract_element(v, ir.Constant(_I32, 0)), res)
        tail0 = builder.mul(nv, _ci(16))
        with cgutils.for_range(builder, builder.sub(nn, tail0)) as loop:
            j = builder.add(tail0, loop.index)
            w = _ldv(builder, base, builder.add(w0, builder.mul(j, _ci(4))), _F32)
            xv = builder.load(builder.gep(xp, [builder.add(x0, j)]))
            builder.store(_call(builder, "llvm.fma.f32", _F32, [w, xv, builder.load(res)]), res)
        return builder.load(res)

    return sig, codegen


@intrinsic
def dot4_f32_ggml(typingctx, arena, wo, wstride, xf, xo, xstride, n):
    """Four :func:`dot_f32_ggml` dots computed side by side: dot k (k < 4) of the n float32 at
    byte ``wo + k * wstride`` of ``arena`` with ``xf[xo + k * xstride :][:n]``, each in exactly
    dot_f32_ggml's order (16 lanes of in-order fma, the same reduction tree, the same tail),
    so each equals dot_f32_ggml's result bit for bit. Returns a UniTuple of 4 float32.
    ``wstride = 0`` dots one row with four vectors (the attention's heads against one key):
    the row is loaded once and the four fma chains run interleaved (AVX2: 8 independent
    ymm chains instead of 2, so the loop is bound by fma throughput, not its latency)."""
    sig = types.UniTuple(types.float32, 4)(arena, wo, wstride, xf, xo, xstride, n)

    def codegen(context, builder, signature, args):
        ty = signature.args
        base = builder.bitcast(_data(context, builder, ty[0], args[0]), _I8.as_pointer())
        w0 = context.cast(builder, args[1], ty[1], types.int64)
        ws = context.cast(builder, args[2], ty[2], types.int64)
        xp = builder.bitcast(_data(context, builder, ty[3], args[3]), _F32.as_pointer())
        x0 = context.cast(builder, args[4], ty[4], types.int64)
        xs = context.cast(builder, args[5], ty[5], types.int64)
        nn = context.cast(builder, args[6], ty[6], types.int64)
        v16 = _vt(_F32, 16)
        wk = [builder.add(w0, builder.mul(ws, _ci(k))) for k in range(4)]
        xk = [builder.add(x0, builder.mul(xs, _ci(k))) for k in range(4)]
        accs = [cgutils.alloca_once(builder, v16) for _ in range(4)]
        for a in accs:
            builder.store(ir.Constant(v16, [0.0] * 16), a)
        nv = builder.lshr(nn, _ci(4))
        with cgutils.for_range(builder, nv) as loop:
            j = builder.mul(loop.index, _ci(16))
            jb = builder.mul(j, _ci(4))
            for k in range(4):
                w = _ldv(builder, base, builder.add(wk[k], jb), v16)
                xv = builder.load(builder.bitcast(builder.gep(xp, [builder.add(xk[k], j)]), v16.as_pointer()))
                xv.align = 4
                builder.store(_call(builder, "llvm.fma.v16f32", v16, [w, xv, builder.load(accs[k])]), accs[k])
        tail0 = builder.mul(nv, _ci(16))
        outs = []
        for k in range(4):
            v = builder.load(accs[k])
            for h in (8, 4, 2, 1):  # 'arcp': see dot_f32_ggml (keeps the adds in the order written)
                v = builder.fadd(_shuf(builder, v, range(h)), _shuf(builder, v, range(h, 2 * h)), flags=("arcp",))
            res = cgutils.alloca_once(builder, _F32)
            builder.store(builder.extract_element(v, ir.Constant(_I32, 0)), res)
            with cgutils.for_range(builder, builder.sub(nn, tail0)) as loop:
                j = builder.add(tail0, loop.index)
                w = _ldv(builder, base, builder.add(wk[k], builder.mul(j, _ci(4))), _F32)
                xv = builder.load(builder.gep(xp, [builder.add(xk[k], j)]))
                builder.store(_call(builder, "llvm.fma.f32", _F32, [w, xv, builder.load(res)]), res)
            outs.append(builder.load(res))
        return context.make_tuple(builder, signature.return_type, outs)

    return sig, codegen


@intrinsic
def wsum4x16_f32(typingctx, keys, cols, cb, n, kstride, ko, p, po, ps, out, oo, ostride):
    """Weighted sums of rows for four weight vectors, 16 columns at a time in registers:
    out[oo + k * ostride + l] = sum over i < n, in order, of p[po + k * ps + i] *
    keys[cols[cb + i] * kstride + ko + l] (k < 4, l < 16), each product rounded to float32
    and added in float32 (no fma), starting from 0: the float32 value sums of an attention
    (``acc += p * v`` key by key) bit for bit, with the 4 x 16 sums held in registers over
    the keys instead of loaded and stored per key. keys, p, out: float32 arrays; cols: int64."""
    sig = types.void(keys, cols, cb, n, kstride, ko, p, po, ps, out, oo, ostride)

    def codegen(context, builder, signature, args):
        ty = signature.args
        kp = builder.bitcast(_data(context, builder, ty[0], args[0]), _F32.as_pointer())
        cp = builder.bitcast(_data(context, builder, ty[1], args[1]), _I64.as_pointer())
        cb_, nn, ks_, ko_, po_, ps_, oo_, os_ = (context.cast(builder, args[i], ty[i], types.int64)
                                                 for i in (2, 3, 4, 5, 7, 8, 10, 11))
        pp = builder.bitcast(_data(context, builder, ty[6], args[6]), _F32.as_pointer())
        op = builder.bitcast(_data(context, builder, ty[9], args[9]), _F32.as_pointer())
        v16 = _vt(_F32, 16)
        accs = [cgutils.alloca_once(builder, v16) for _ in range(4)]
        for a in accs:
            builder.store(ir.Constant(v16, [0.0] * 16), a)
        pk = [builder.add(po_, builder.mul(ps_, _ci(k))) for k in range(4)]
        with cgutils.for_range(builder, nn) as loop:
            i = loop.index
            row = builder.load(builder.gep(cp, [builder.add(cb_, i)]))
            kv = builder.load(builder.bitcast(builder.gep(kp, [builder.add(builder.mul(row, ks_), ko_)]),
                                              v16.as_pointer()))
            kv.align = 4
            for k in range(4):
                pv = builder.load(builder.gep(pp, [builder.add(pk[k], i)]))
                sp = builder.shuffle_vector(builder.insert_element(ir.Constant(v16, ir.Undefined), pv,
                                                                   ir.Constant(_I32, 0)),
                                            ir.Constant(v16, ir.Undefined), ir.Constant(_vt(_I32, 16), [0] * 16))
                prod = builder.fmul(sp, kv, flags=("arcp",))
                builder.store(builder.fadd(builder.load(accs[k]), prod, flags=("arcp",)), accs[k])
        for k in range(4):
            dst = builder.gep(op, [builder.add(oo_, builder.mul(os_, _ci(k)))])
            stv = builder.store(builder.load(accs[k]), builder.bitcast(dst, v16.as_pointer()))
            stv.align = 4
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def mix_rows_f64(typingctx, xn, xo, table, k_rows, m_cols, acc):
    """acc[m] = sum over k < k_rows, in order, of float64(xn[xo + k]) * float64(table[k *
    m_cols + m]) for m < m_cols (a literal multiple of 4), each product rounded to float64
    and added in float64 (no fma), starting from 0: the hyper-connections' mixes as a plain
    loop ``acc[m] += v * w`` computes them, bit for bit, with the m_cols sums held in
    registers over the k rows instead of loaded and stored per row. xn, table: float32
    arrays; acc: float64 array (written)."""
    if not isinstance(m_cols, types.IntegerLiteral) or m_cols.literal_value % 4:
        return None
    M = m_cols.literal_value
    sig = types.void(xn, xo, table, k_rows, m_cols, acc)

    def codegen(context, builder, signature, args):
        ty = signature.args
        xp = builder.bitcast(_data(context, builder, ty[0], args[0]), _F32.as_pointer())
        x0 = context.cast(builder, args[1], ty[1], types.int64)
        tp = builder.bitcast(_data(context, builder, ty[2], args[2]), _F32.as_pointer())
        kk = context.cast(builder, args[3], ty[3], types.int64)
        ap = builder.bitcast(_data(context, builder, ty[5], args[5]), ir.DoubleType().as_pointer())
        f64 = ir.DoubleType()
        v4d, v4f = _vt(f64, 4), _vt(_F32, 4)
        accs = [cgutils.alloca_once(builder, v4d) for _ in range(M // 4)]
        for a in accs:
            builder.store(ir.Constant(v4d, [0.0] * 4), a)
        with cgutils.for_range(builder, kk) as loop:
            k = loop.index
            v = builder.fpext(builder.load(builder.gep(xp, [builder.add(x0, k)])), f64)
            sp = builder.shuffle_vector(builder.insert_element(ir.Constant(v4d, ir.Undefined), v, ir.Constant(_I32, 0)),
                                        ir.Constant(v4d, ir.Undefined), ir.Constant(_vt(_I32, 4), [0] * 4))
            row = builder.mul(k, _ci(M))
            for g in range(M // 4):
                wv = builder.load(builder.bitcast(builder.gep(tp, [builder.add(row, _ci(4 * g))]), v4f.as_pointer()))
                wv.align = 4
                prod = builder.fmul(sp, builder.fpext(wv, v4d), flags=("arcp",))
                builder.store(builder.fadd(builder.load(accs[g]), prod, flags=("arcp",)), accs[g])
        for g in range(M // 4):
            dst = builder.bitcast(builder.gep(ap, [_ci(4 * g)]), v4d.as_pointer())
            stv = builder.store(builder.load(accs[g]), dst)
            stv.align = 8
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def index_scores16_f64(typingctx, q, w, n_heads, dim, kt, out):
    """The lightning indexer's scores of 16 keys: out[u] = sum over heads h in order of
    relu(dot_h,u) * w[h] for u < 16, dot_h,u = sum over d < dim in order of fma(q[h * dim +
    d], kt[d * 16 + u], .) from 0, in float64. q: float64 [n_heads * dim]; w: float64
    [n_heads]; kt: float64 [dim * 16], the 16 keys transposed (a key's score depends on its
    own column only: pad unused columns with anything); out: float64 [16]. Two heads at a
    time, the 16 keys in four 4-lane vectors: 8 independent fma chains (AVX2's throughput,
    not its latency)."""
    sig = types.void(q, w, n_heads, dim, kt, out)

    def codegen(context, builder, signature, args):
        ty = signature.args
        f64 = ir.DoubleType()
        v4 = _vt(f64, 4)
        qp = builder.bitcast(_data(context, builder, ty[0], args[0]), f64.as_pointer())
        wp = builder.bitcast(_data(context, builder, ty[1], args[1]), f64.as_pointer())
        nh = context.cast(builder, args[2], ty[2], types.int64)
        dd = context.cast(builder, args[3], ty[3], types.int64)
        kp = builder.bitcast(_data(context, builder, ty[4], args[4]), f64.as_pointer())
        op = builder.bitcast(_data(context, builder, ty[5], args[5]), f64.as_pointer())
        zero = ir.Constant(v4, [0.0] * 4)

        def splat(x):
            return builder.shuffle_vector(builder.insert_element(ir.Constant(v4, ir.Undefined), x, ir.Constant(_I32, 0)),
                                          ir.Constant(v4, ir.Undefined), ir.Constant(_vt(_I32, 4), [0] * 4))

        def ldk(d, g):
            v = builder.load(builder.bitcast(builder.gep(kp, [builder.add(builder.mul(d, _ci(16)), _ci(4 * g))]),
                                             v4.as_pointer()))
            v.align = 8
            return v

        sacc = [cgutils.alloca_once(builder, v4) for _ in range(4)]
        for a in sacc:
            builder.store(zero, a)

        def heads(h0, n):  # n (1 or 2) heads from h0: their dots, then relu * w into the sums in head order
            acc = [[cgutils.alloca_once(builder, v4) for _ in range(4)] for _ in range(n)]
            for row in acc:
                for a in row:
                    builder.store(zero, a)
            with cgutils.for_range(builder, dd) as loop:
                d = loop.index
                ks = [ldk(d, g) for g in range(4)]
                for i in range(n):
                    qv = splat(builder.load(builder.gep(qp, [builder.add(builder.mul(builder.add(h0, _ci(i)), dd), d)])))
                    for g in range(4):
                        builder.store(_call(builder, "llvm.fma.v4f64", v4, [qv, ks[g], builder.load(acc[i][g])]),
                                      acc[i][g])
            for i in range(n):
                wv = splat(builder.load(builder.gep(wp, [builder.add(h0, _ci(i))])))
                for g in range(4):
                    a = builder.load(acc[i][g])
                    r = builder.select(builder.fcmp_ordered(">", a, zero), a, zero)
                    builder.store(builder.fadd(builder.load(sacc[g]), builder.fmul(r, wv, flags=("arcp",)),
                                               flags=("arcp",)), sacc[g])

        with cgutils.for_range(builder, builder.lshr(nh, _ci(1))) as loop:
            heads(builder.mul(loop.index, _ci(2)), 2)
        with builder.if_then(builder.icmp_signed("!=", builder.and_(nh, _ci(1)), _ci(0))):
            heads(builder.sub(nh, _ci(1)), 1)
        for g in range(4):
            stv = builder.store(builder.load(sacc[g]), builder.bitcast(builder.gep(op, [_ci(4 * g)]), v4.as_pointer()))
            stv.align = 8
        return context.get_dummy_value()

    return sig, codegen


def _slot_fields(builder, slot):
    """i64 scalars: the lanes of the <n x i16> stored at pointer ``slot``, read back 64 bits at
    a time and split in general registers (tiles_k._spilled's read side; the slot's address
    through an empty asm, so LLVM keeps the loads instead of lane extracts)."""
    qp = builder.bitcast(builder.asm(ir.FunctionType(slot.type, [slot.type]), "", "=r,0", [slot], False),
                         _I64.as_pointer())
    out = []
    for j in range(slot.type.pointee.count // 4):
        w = builder.load(builder.gep(qp, [_ci(j)]))
        out += [builder.and_(builder.lshr(w, _ci(16 * m)) if m else w, _ci(0xFFFF)) for m in range(4)]
    return out
