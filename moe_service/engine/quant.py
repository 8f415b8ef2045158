"""GGUF block kernels: dequantize, quantize activations, dot products, matmul over an arena.

Shape legend: T tokens (1 in decode, up to a few hundred in a prefill ubatch), N output rows
of a weight tensor, C input columns (ggml ``ne[0]``), B = C / block_elems blocks per row.

::

    x [T, C] f32 ──quantize_activations(partner)──> Activations: xq int8 [T, C], xd f32 [T, C/32|256], ...
                                                                    │  (once per token row, reused by every weight row)
    arena uint8 ── w = N rows x row_bytes at a byte offset ─────────┤
                                                                    v
                                     matmul_rows(row_lo, row_hi): out [T, N] f32

Weights are read in place from the arena in their GGUF block format; nothing is
dequantized at load. As in ggml's CPU backend, each weight format has a *partner*
activation format (``Partner``): the activation row is quantized to 8 bits once
(ggml's quantize_row_q8_0 / q8_1 / q8_K) and every block dot product is an integer sum
of products scaled by the two block scales, so results agree closely with llama.cpp.
F32 / F16 / BF16 weights are dotted against the activation rounded to the weight's own
precision (ggml's vec_dot_type for those types), accumulating in float32.

Performance (the point of this module; bench/kernels.py measures GB/s of weight bytes per
format against the machine's read bandwidth):

- The block dot products are written in LLVM vector IR (numba intrinsics). A matmul runs
  in *tiles*: 4 consecutive weight rows x up to 4 activation rows per pass over the rows'
  blocks (AVX-512 VNNI; 1 row on AVX2). Each weight block is unpacked once per tile and
  each activation block loaded once per tile, so a weight row is read from memory once per
  call however many tokens there are, and the per-token cost at T >= 4 is the vpdpbusd /
  vpmaddubsw arithmetic, not the unpacking. Accumulators stay in registers; the horizontal
  sum happens once per (row, token). Tiles prefetch the next tile's rows.
- Results are bit-identical whatever the tile shape, the number of tokens, or the ISA: the
  integer sums are exact and each row's float32 steps follow one fixed per-lane order (see
  the tile sections).
- The format kernels are C-ABI functions (numba cfunc) called through an address table:
  each compiles once and only when a model uses the format (``ensure_kernels``), and no
  reference counting runs per row (they take raw pointers).
- Scalar helpers (quantizers, dequantization) rely on LLVM's SLP vectorizer, which this
  module switches on (numba ships with it off).

All kernels are compiled with ``nogil=True, cache=True``; numba's on-disk cache honours
NUMBA_CACHE_DIR, which the service sets before numba is imported. Requires an x86-64 CPU
with AVX2 (and SSSE3 pshufb for MXFP4).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from enum import IntEnum

import llvmlite.binding as _llb
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.core import cgutils
from numba.core import config as _numba_config
from numba.extending import intrinsic

from moe_service.errors import ModelFileError

# The scalar kernels (quantizers, dequantization) rely on LLVM's SLP vectorizer to turn
# unrolled element loops into vector code (measured ~6x on a scalar Q8_0 dot). numba keeps
# it off by default; it is read when each function is optimized, so setting it here covers
# every function compiled in this process (the rest of the engine's numba code only gains).
_numba_config.SLP_VECTORIZE = 1

# ld_f16x2 uses two instructions of inline assembly; LLVM needs its assembly parser for that.
_llb.initialize_native_asmparser()

__all__ = [
    "GGML_F32", "GGML_F16", "GGML_BF16", "GGML_Q4_0", "GGML_Q4_1", "GGML_Q5_0", "GGML_Q5_1",
    "GGML_Q8_0", "GGML_Q4_K", "GGML_Q5_K", "GGML_Q6_K", "GGML_MXFP4",
    "Partner", "BlockFormat", "FORMATS", "block_format", "row_bytes",
    "Activations", "PartnerArrays", "quantize_activations", "dequantize", "matmul",
    "matmul_rows", "dequantize_rows", "random_blocks", "check_tensor", "ensure_kernels", "kernel_table", "quantize_partner_rows", "quantize_partner_row",
]

# ---------------------------------------------------------------------------------------
# Format table (one place): GGML type id -> block elements, block bytes, partner format
# ---------------------------------------------------------------------------------------

GGML_F32 = 0
GGML_F16 = 1
GGML_Q4_0 = 2
GGML_Q4_1 = 3
GGML_Q5_0 = 6
GGML_Q5_1 = 7
GGML_Q8_0 = 8
GGML_Q4_K = 12
GGML_Q5_K = 13
GGML_Q6_K = 14
GGML_BF16 = 30
GGML_MXFP4 = 39

QK = 32    # elements per block of the 32-element formats and of Q8_0 / Q8_1 activations
QK_K = 256  # elements per K-quant super-block and per Q8_K activation block


class Partner(IntEnum):
    """Activation format a weight format is dotted against (ggml's ``vec_dot_type``)."""

    F32 = 0   # activation as is
    F16 = 1   # activation rounded to float16 (nearest even)
    BF16 = 2  # activation rounded to bfloat16 (nearest even, as ggml_compute_fp32_to_bf16)
    Q8_0 = 3  # 32-element blocks: int8 q, f16 d = amax/127
    Q8_1 = 4  # Q8_0 plus f16 s = d * sum(q)
    Q8_K = 5  # 256-element blocks: int8 q, f32 d, int16 sums of each 16 q


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF tensor type as the kernels see it.

    ``block_bytes`` is written as the field arithmetic of the block (gguf-py style);
    ``layout`` names the fields in byte order.
    """

    type_id: int
    name: str
    block_elems: int
    block_bytes: int
    partner: Partner
    layout: str

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of ``n_cols`` elements (``n_cols`` a multiple of block_elems)."""
        return n_cols // self.block_elems * self.block_bytes


FORMATS: dict[int, BlockFormat] = {
    f.type_id: f
    for f in (
        BlockFormat(GGML_F32, "F32", 1, 4, Partner.F32, "f32"),
        BlockFormat(GGML_F16, "F16", 1, 2, Partner.F16, "f16"),
        BlockFormat(GGML_BF16, "BF16", 1, 2, Partner.BF16, "bf16 (f32 bits = u16 << 16)"),
        BlockFormat(GGML_Q4_0, "Q4_0", QK, 2 + 16, Partner.Q8_0, "f16 d | 16 B nibbles; x = d*(q-8)"),
        BlockFormat(GGML_Q4_1, "Q4_1", QK, 2 + 2 + 16, Partner.Q8_1, "f16 d | f16 m | 16 B nibbles; x = d*q + m"),
        BlockFormat(GGML_Q5_0, "Q5_0", QK, 2 + 4 + 16, Partner.Q8_0, "f16 d | u32 qh | 16 B nibbles; x = d*(q-16)"),
        BlockFormat(GGML_Q5_1, "Q5_1", QK, 2 + 2 + 4 + 16, Partner.Q8_1,
                    "f16 d | f16 m | u32 qh | 16 B nibbles; x = d*q + m"),
        BlockFormat(GGML_Q8_0, "Q8_0", QK, 2 + 32, Partner.Q8_0, "f16 d | 32 int8; x = d*q"),
        BlockFormat(GGML_Q4_K, "Q4_K", QK_K, 2 + 2 + 12 + QK_K // 2, Partner.Q8_K,
                    "f16 d | f16 dmin | 12 B 6-bit scales/mins | 128 B nibbles"),
        BlockFormat(GGML_Q5_K, "Q5_K", QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2, Partner.Q8_K,
                    "f16 d | f16 dmin | 12 B scales/mins | 32 B high bits | 128 B nibbles"),
        BlockFormat(GGML_Q6_K, "Q6_K", QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, Partner.Q8_K,
                    "128 B low nibbles | 64 B high 2 bits | 16 int8 scales | f16 d"),
        BlockFormat(GGML_MXFP4, "MXFP4", QK, 1 + 16, Partner.Q8_0,
                    "u8 E8M0 e | 16 B E2M1 codes; x = kvalue[code] * 2^(e-128)"),
    )
}

# Partner block geometry: elements per activation scale block (1 = no scales).
PARTNER_BLOCK = {Partner.F32: 1, Partner.F16: 1, Partner.BF16: 1, Partner.Q8_0: QK,
                 Partner.Q8_1: QK, Partner.Q8_K: QK_K}


def block_format(ggml_type: int) -> BlockFormat:
    """The BlockFormat of a GGML type id; ModelFileError names the type when unsupported."""
    try:
        return FORMATS[int(ggml_type)]
    except KeyError:
        supported = ", ".join(f"{f.name}({t})" for t, f in sorted(FORMATS.items()))
        raise ModelFileError(
            f"GGML tensor type {int(ggml_type)} is not supported by the CPU kernels (supported: {supported})"
        ) from None


def row_bytes(ggml_type: int, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` elements of ``ggml_type``; ValueError if not whole blocks."""
    f = block_format(ggml_type)
    if n_cols % f.block_elems:
        raise ValueError(f"row of {n_cols} columns is not a whole number of {f.name} blocks of {f.block_elems}")
    return f.row_bytes(n_cols)


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
# Scalar helpers
# ---------------------------------------------------------------------------------------


@njit(**_JIT_INLINE)
def _e8m0_half(e):
    """2^(e-128) as float32 for an E8M0 byte ``e``: ggml's GGML_E8M0_TO_FP32_HALF."""
    if e < 2:
        return bits_f32(np.uint32(0x00200000) << np.uint32(e))
    return bits_f32(np.uint32(e - 1) << np.uint32(23))


@njit(**_JIT_INLINE)
def _mxfp4_value(c):
    """Doubled E2M1 value of a 4-bit code: {0,1,2,3,4,6,8,12}, bit 3 the sign (kvalues_mxfp4)."""
    m = c & 7
    mag = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    return mag - ((c >> 3) & 1) * 2 * mag


@njit(**_JIT_INLINE)
def _k4_scale(arena, so, j):
    """6-bit scale j (0..7) of the 12 packed Q4_K/Q5_K scale bytes at byte offset ``so``."""
    if j < 4:
        return ld_u8(arena, so + j) & 63
    return (ld_u8(arena, so + j + 4) & 15) | ((ld_u8(arena, so + j - 4) >> 6) << 4)


@njit(**_JIT_INLINE)
def _k4_min(arena, so, j):
    """6-bit min j (0..7) of the 12 packed Q4_K/Q5_K scale bytes at byte offset ``so``."""
    if j < 4:
        return ld_u8(arena, so + j + 4) & 63
    return (ld_u8(arena, so + j + 4) >> 4) | ((ld_u8(arena, so + j) >> 6) << 4)


@njit(**_JIT_INLINE)
def _bf16_round(x):
    """float32 -> bfloat16 -> float32, as ggml_compute_fp32_to_bf16 (nearest even, NaN quieted)."""
    u = np.int64(f32_bits(x))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        h = (u >> 16) | 64
    else:
        h = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return bits_f32((h & 0xFFFF) << 16)


# ---------------------------------------------------------------------------------------
# Dequantization: one row of C elements at byte offset ``wo`` -> out[oo : oo + C]
# (bit-exact with gguf.quants.dequantize: same float32 operations in the same order)
# ---------------------------------------------------------------------------------------


@njit(**_JIT)
def _dequant_row(arena, wo, ggml_type, n_cols, out, oo):
    if ggml_type == GGML_F32:
        for j in range(n_cols):
            st(out, oo + j, ld_f32(arena, wo + 4 * j))
    elif ggml_type == GGML_F16:
        for j in range(n_cols):
            st(out, oo + j, ld_f16(arena, wo + 2 * j))
    elif ggml_type == GGML_BF16:
        for j in range(n_cols):
            st(out, oo + j, ld_bf16(arena, wo + 2 * j))
    elif ggml_type == GGML_Q4_0:
        for b in range(n_cols // QK):
            o = wo + b * 18
            d = ld_f16(arena, o)
            for j in range(16):
                v = ld_u8(arena, o + 2 + j)
                st(out, oo + b * QK + j, d * np.float32((v & 15) - 8))
                st(out, oo + b * QK + 16 + j, d * np.float32((v >> 4) - 8))
    elif ggml_type == GGML_Q4_1:
        for b in range(n_cols // QK):
            o = wo + b * 20
            d = ld_f16(arena, o)
            m = ld_f16(arena, o + 2)
            for j in range(16):
                v = ld_u8(arena, o + 4 + j)
                st(out, oo + b * QK + j, d * np.float32(v & 15) + m)
                st(out, oo + b * QK + 16 + j, d * np.float32(v >> 4) + m)
    elif ggml_type == GGML_Q5_0:
        for b in range(n_cols // QK):
            o = wo + b * 22
            d = ld_f16(arena, o)
            qh = ld_u32(arena, o + 2)
            for j in range(16):
                v = ld_u8(arena, o + 6 + j)
                x0 = ((v & 15) | (((qh >> j) & 1) << 4)) - 16
                x1 = ((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16
                st(out, oo + b * QK + j, d * np.float32(x0))
                st(out, oo + b * QK + 16 + j, d * np.float32(x1))
    elif ggml_type == GGML_Q5_1:
        for b in range(n_cols // QK):
            o = wo + b * 24
            d = ld_f16(arena, o)
            m = ld_f16(arena, o + 2)
            qh = ld_u32(arena, o + 4)
            for j in range(16):
                v = ld_u8(arena, o + 8 + j)
                x0 = (v & 15) | (((qh >> j) & 1) << 4)
                x1 = (v >> 4) | (((qh >> (j + 16)) & 1) << 4)
                st(out, oo + b * QK + j, d * np.float32(x0) + m)
                st(out, oo + b * QK + 16 + j, d * np.float32(x1) + m)
    elif ggml_type == GGML_Q8_0:
        for b in range(n_cols // QK):
            o = wo + b * 34
            d = ld_f16(arena, o)
            for j in range(QK):
                st(out, oo + b * QK + j, np.float32(ld_i8(arena, o + 2 + j)) * d)
    elif ggml_type == GGML_MXFP4:
        for b in range(n_cols // QK):
            o = wo + b * 17
            d = _e8m0_half(ld_u8(arena, o))
            for j in range(16):
                v = ld_u8(arena, o + 1 + j)
                st(out, oo + b * QK + j, d * np.float32(_mxfp4_value(v & 15)))
                st(out, oo + b * QK + 16 + j, d * np.float32(_mxfp4_value(v >> 4)))
    elif ggml_type == GGML_Q4_K or ggml_type == GGML_Q5_K:
        is_q5 = ggml_type == GGML_Q5_K
        bb = 176 if is_q5 else 144
        qo = 48 if is_q5 else 16
        for b in range(n_cols // QK_K):
            o = wo + b * bb
            d = ld_f16(arena, o)
            dmin = ld_f16(arena, o + 2)
            for g in range(4):
                for h in range(2):
                    j = 2 * g + h
                    ds = d * np.float32(_k4_scale(arena, o + 4, j))
                    dm = dmin * np.float32(_k4_min(arena, o + 4, j))
                    for k in range(32):
                        q = (ld_u8(arena, o + qo + 32 * g + k) >> (4 * h)) & 15
                        if is_q5:
                            q |= ((ld_u8(arena, o + 16 + k) >> j) & 1) << 4
                        st(out, oo + b * QK_K + 32 * j + k, ds * np.float32(q) - dm)
    elif ggml_type == GGML_Q6_K:
        for b in range(n_cols // QK_K):
            o = wo + b * 210
            d = ld_f16(arena, o + 208)
            for i in range(8):
                n = i // 4
                k = i % 4
                for el in range(32):
                    lo = (ld_u8(arena, o + 64 * n + 32 * (k % 2) + el) >> (4 * (k // 2))) & 15
                    hi = (ld_u8(arena, o + 128 + 32 * n + el) >> (2 * k)) & 3
                    q = (lo | (hi << 4)) - 32
                    sc = d * np.float32(ld_i8(arena, o + 192 + 2 * i + el // 16))
                    st(out, oo + b * QK_K + 32 * i + el, sc * np.float32(q))
    else:
        raise ValueError("unsupported ggml type")


@njit(**_JIT)
def dequantize_rows(arena, w_off, ggml_type, n_cols, row_bytes_, rows, out):
    """Dequantize selected rows of a tensor to float32.

    arena: uint8 [*]; w_off: byte offset of row 0; rows: int64 [R] row indices;
    out: float32 [R * n_cols] (row-major). Used for embedding lookups and as a test oracle.
    """
    for i in range(rows.shape[0]):
        _dequant_row(arena, w_off + ld(rows, i) * row_bytes_, ggml_type, n_cols, out, i * n_cols)


# ---------------------------------------------------------------------------------------
# Activation quantization (ggml-quants.c reference rows), one row at x[xo : xo + n]
# ---------------------------------------------------------------------------------------


@intrinsic
def _absmax(typingctx, x, base, n):
    """max |x[base : base + n]| (n a literal 32 or 256) as numba's running ``max(amax, abs(v))``
    from 0.0 computes it (NaN elements ignored: maxnum), as one vector reduction: the running
    scalar max is a loop-carried chain the vectorizer cannot break without fast-math."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    sig = types.float32(x, base, n)
    count = n.literal_value

    def codegen(context, builder, signature, args):
        vty = _vt(_F32, count)
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = builder.load(builder.bitcast(p, vty.as_pointer()))
        v.align = 4
        a = _call(builder, f"llvm.fabs.v{count}f32", vty, [v])
        m = _call(builder, f"llvm.vector.reduce.fmax.v{count}f32", _F32, [a])
        return _call(builder, "llvm.maxnum.f32", _F32, [m, ir.Constant(_F32, 0.0)])

    return sig, codegen


@intrinsic
def _first_absmax(typingctx, x, base, amax):
    """The first of x[base : base + 256] whose magnitude equals ``amax`` (> 0, one of them):
    the element quantize_row_q8_k's strict ``abs(v) > amax`` scan keeps, found with one
    vector compare and a count of trailing zeros."""
    sig = types.float32(x, base, types.float32)

    def codegen(context, builder, signature, args):
        vty = _vt(_F32, QK_K)
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = builder.load(builder.bitcast(p, vty.as_pointer()))
        v.align = 4
        a = _call(builder, f"llvm.fabs.v{QK_K}f32", vty, [v])
        hit = builder.fcmp_ordered("==", a, _splat_f32(builder, args[2], QK_K))
        bits = builder.bitcast(hit, ir.IntType(QK_K))
        tz = _call(builder, f"llvm.cttz.i{QK_K}", ir.IntType(QK_K), [bits, ir.Constant(ir.IntType(1), 0)])
        return builder.extract_element(v, builder.trunc(tz, _I32))

    return sig, codegen


@intrinsic
def _quant_block(typingctx, x, base, scale, qs, qo, n, clamp):
    """qs[qo + j] = int8(q_j), q_j = rint(x[base + j] * scale) (round half to even; clamped to
    <= 127 when the literal ``clamp`` is 1) for j < n (literal 32 or 256), as one vector
    pass; returns sum(q_j) as int32 (exact). Element for element what the scalar
    ``np.int8(rintf(x * scale))`` loop stores."""
    if not (isinstance(n, types.IntegerLiteral) and isinstance(clamp, types.IntegerLiteral)):
        return None
    sig = types.int32(x, base, types.float32, qs, qo, n, clamp)
    count, do_clamp = n.literal_value, clamp.literal_value

    def codegen(context, builder, signature, args):
        vf = _vt(_F32, count)
        vi = _vt(_I32, count)
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = builder.load(builder.bitcast(p, vf.as_pointer()))
        v.align = 4
        r = _call(builder, f"llvm.rint.v{count}f32", vf, [builder.fmul(v, _splat_f32(builder, args[2], count))])
        q = builder.fptosi(r, vi)
        if do_clamp:
            q = _call(builder, f"llvm.smin.v{count}i32", vi, [q, _cvec(_I32, [127] * count)])
        out = _elem_ptr(context, builder, signature.args[3], args[3], args[4], signature.args[4])
        st_ = builder.store(builder.trunc(q, _vt(_I8, count)), builder.bitcast(out, _vt(_I8, count).as_pointer()))
        st_.align = 1
        return _call(builder, f"llvm.vector.reduce.add.v{count}i32", _I32, [q])

    return sig, codegen


@intrinsic
def _sums16(typingctx, qs, qo, bsums, bo):
    """bsums[bo + j] = int16(sum of qs[qo + 16j : qo + 16j + 16]) for j < 16 (Q8_K's sums)."""
    sig = types.void(qs, qo, bsums, bo)

    def codegen(context, builder, signature, args):
        p = _elem_ptr(context, builder, signature.args[0], args[0], args[1], signature.args[1])
        v = builder.load(builder.bitcast(p, _vt(_I8, QK_K).as_pointer()))
        v.align = 1
        w = builder.sext(v, _vt(_I32, QK_K))
        sums = ir.Constant(_vt(_I16, 16), None)
        for j in range(16):
            g = _shuf(builder, w, range(16 * j, 16 * j + 16))
            t = _call(builder, "llvm.vector.reduce.add.v16i32", _I32, [g])
            sums = builder.insert_element(sums, builder.trunc(t, _I16), ir.Constant(_I32, j))
        out = _elem_ptr(context, builder, signature.args[2], args[2], args[3], signature.args[3])
        st_ = builder.store(sums, builder.bitcast(out, _vt(_I16, 16).as_pointer()))
        st_.align = 2
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def quantize_row_q8_0(x, xo, n, qs, qo, d_out, do_):
    """As ggml-cpu's x86 quantize_row_q8_0 (the AVX2/AVX-512 path llama.cpp runs on these
    hosts): per 32: d = amax/127 stored as f16, id = 127/amax, q = round-half-to-even(x*id)
    (_mm256_round_ps with _MM_ROUND_NEAREST). The portable quantize_row_q8_0_ref differs (id =
    1/d and roundf, half away from zero): a few elements per block land one step apart, which
    moved logits by ~0.5% against llama.cpp.

    x: float32 (row at element ``xo``, ``n`` a multiple of 32); writes qs[qo:qo+n] int8 and
    d_out[do_ : do_ + n/32] float32 (the f16-rounded d the dot products use).
    """
    for b in range(n // QK):
        base = xo + b * QK
        amax = _absmax(x, base, 32)
        d = amax / np.float32(127.0)
        idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        st(d_out, do_ + b, f16_round(d))
        _quant_block(x, base, idd, qs, qo + b * QK, 32, 0)


@njit(**_JIT)
def quantize_row_q8_1(x, xo, n, qs, qo, d_out, s_out, do_):
    """As ggml-cpu's x86 quantize_row_q8_1: the Q8_0 rule above (id = 127/amax, half to even)
    plus s = f16(d * sum(q)) per 32-element block."""
    for b in range(n // QK):
        base = xo + b * QK
        amax = _absmax(x, base, 32)
        d = amax / np.float32(127.0)
        idd = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
        st(d_out, do_ + b, f16_round(d))
        total = _quant_block(x, base, idd, qs, qo + b * QK, 32, 0)
        st(s_out, do_ + b, f16_round(np.float32(total) * d))


@njit(**_JIT)
def quantize_row_q8_k(x, xo, n, qs, qo, d_out, do_, bsums, bo):
    """As ggml's quantize_row_q8_K_ref: per 256: iscale = -127/max (max = the first element of
    largest magnitude), q = min(127, nearest_int(iscale*x)), d = 1/iscale (f32), int16 sums of
    each 16 q into bsums[bo + 16*b : ...]. An all-zero block gets d = 0, q = 0, sums 0.
    """
    for b in range(n // QK_K):
        base = xo + b * QK_K
        amax = _absmax(x, base, 256)
        if amax == 0:
            st(d_out, do_ + b, np.float32(0.0))
            for j in range(QK_K):
                st(qs, qo + b * QK_K + j, np.int8(0))
            for j in range(QK_K // 16):
                st(bsums, bo + b * 16 + j, np.int16(0))
            continue
        iscale = np.float32(-127.0) / _first_absmax(x, base, amax)
        _quant_block(x, base, iscale, qs, qo + b * QK_K, 256, 1)
        _sums16(qs, qo + b * QK_K, bsums, bo + b * 16)
        st(d_out, do_ + b, np.float32(1.0) / iscale)


@njit(**_JIT)
def quantize_partner_row(partner, x, xo, n, xf, xq, xd, xs, xbs, row):
    """Encode activation row x[xo:xo+n] in ``partner`` format into row ``row`` of the partner
    arrays (xf float32 [*, n], xq int8 [*, n], xd/xs float32 [*, n/32|256], xbs int16 [*, n/16]).
    """
    if partner == 0:
        for j in range(n):
            st(xf, row * n + j, ld(x, xo + j))
    elif partner == 1:
        for j in range(n):
            st(xf, row * n + j, f16_round(ld(x, xo + j)))
    elif partner == 2:
        for j in range(n):
            st(xf, row * n + j, _bf16_round(ld(x, xo + j)))
    elif partner == 3:
        quantize_row_q8_0(x, xo, n, xq, row * n, xd, row * (n // QK))
    elif partner == 4:
        quantize_row_q8_1(x, xo, n, xq, row * n, xd, xs, row * (n // QK))
    else:
        quantize_row_q8_k(x, xo, n, xq, row * n, xd, row * (n // QK_K), xbs, row * (n // 16))


@njit(**_JIT)
def quantize_partner_rows(partner, x, n_rows, n, xf, xq, xd, xs, xbs):
    """quantize_partner_row for rows 0..n_rows-1 of x float32 [n_rows * n]."""
    for r in range(n_rows):
        quantize_partner_row(partner, x, r * n, n, xf, xq, xd, xs, xbs, r)


@njit(**_JIT)
def quantize_partner_rows_range(partner, x, row_lo, row_hi, n, xf, xq, xd, xs, xbs):
    """quantize_partner_row for rows row_lo..row_hi-1 of x float32 [*, n] (worker share)."""
    for r in range(row_lo, row_hi):
        quantize_partner_row(partner, x, r * n, n, xf, xq, xd, xs, xbs, r)


# ---------------------------------------------------------------------------------------
# Vector building blocks (LLVM vector IR) for the tile kernels below
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


def _concat(builder, a, b):
    n = a.type.count
    return builder.shuffle_vector(a, b, _cvec(_I32, range(2 * n)))


def _abs8(builder, w):
    return _call(builder, "llvm.abs.v32i8", _vt(_I8, 32), [w, ir.Constant(ir.IntType(1), 0)])


def _sign8(builder, a, w):
    """vpsignb: a where w > 0, -a where w < 0, 0 where w == 0."""
    return _call(builder, "llvm.x86.avx2.psign.b", _vt(_I8, 32), [a, w])


_ONES16 = _cvec(_I16, [1] * 16)


_MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


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

_VNNI = _AVX512  # the 512-bit path requires AVX-512 BW + VL + VNNI (see _target_has_avx512)


@dataclass(frozen=True)
class _Fmt32:
    """Byte layout of one 32-element weight format for the tile kernels."""

    bb: int            # block bytes
    qs: int            # offset of the 16 nibble bytes (or the 32 int8 of Q8_0)
    qh: int            # offset of the u32 high bits (Q5_*), -1 if none
    bias: int          # subtracted from the unsigned values (Q4_0: 8, Q5_0: 16)
    signed: bool       # weight values signed (sign trick / a + 128 path)
    has_min: bool      # Q4_1 / Q5_1: x = d*q + m (the m term uses the Q8_1 sums s)
    kind: str          # "q8", "nib" (4/5-bit nibbles), "mxfp4"


_FMT32 = {
    GGML_Q8_0: _Fmt32(34, 2, -1, 0, True, False, "q8"),
    GGML_Q4_0: _Fmt32(18, 2, -1, 8, True, False, "nib"),
    GGML_Q4_1: _Fmt32(20, 4, -1, 0, False, True, "nib"),
    GGML_Q5_0: _Fmt32(22, 6, 2, 16, True, False, "nib"),
    GGML_Q5_1: _Fmt32(24, 8, 4, 0, False, True, "nib"),
    GGML_MXFP4: _Fmt32(17, 1, -1, 0, True, False, "mxfp4"),
}


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


def _unpack32(builder, f, ptrs):
    """The int8 values of the blocks at i8* ptrs (1 or 2 consecutive blocks of one row) as
    one <32*len(ptrs) x i8> (signed values for signed formats, else 0..31)."""
    n = len(ptrs)
    if f.kind == "q8":
        return _cat(builder, [_ldv(builder, p, _ci(f.qs), _vt(_I8, 32)) for p in ptrs])
    v = _cat(builder, [_ldv(builder, p, _ci(f.qs), _vt(_I8, 16)) for p in ptrs])  # <16n x i8>
    # block j: its 16 low nibbles (elements 0..15), then its 16 high nibbles (16..31): each
    # block's 16 bytes twice, the second copy shifted right by 4 (as 16-bit lanes), & 15
    dup = _shuf(builder, v, [16 * j + i for j in range(n) for _ in range(2) for i in range(16)])
    w16 = builder.lshr(builder.bitcast(dup, _vt(_I16, 16 * n)), _cvec(_I16, ([0] * 8 + [4] * 8) * n))
    q = builder.and_(builder.bitcast(w16, _vt(_I8, 32 * n)), _cvec(_I8, [15] * 32 * n))
    if f.kind == "mxfp4":
        table = _cvec(_I8, [v_ & 0xFF for v_ in _MXFP4_KVALUES] * (2 * n))
        name = "llvm.x86.avx512.pshuf.b.512" if n == 2 else "llvm.x86.avx2.pshuf.b"
        return _call(builder, name, _vt(_I8, 32 * n), [table, q])
    if f.qh >= 0:
        bits = [builder.zext(_ldv(builder, p, _ci(f.qh), _I32), _I64) for p in ptrs]
        m = bits[0] if n == 1 else builder.or_(bits[0], builder.shl(bits[1], _ci(32)))
        mask = builder.bitcast(builder.trunc(m, _I32) if n == 1 else m, _vt(ir.IntType(1), 32 * n))
        q = builder.or_(q, builder.select(mask, _cvec(_I8, [16] * 32 * n), _cvec(_I8, [0] * 32 * n)))
    if f.bias:
        q = builder.sub(q, _cvec(_I8, [f.bias] * 32 * n))
    return q


def _scales32(builder, f, ptrs):
    """<2n x float>: [d, m] of each block (m only meaningful for Q4_1 / Q5_1), widened
    exactly from float16 (MXFP4: [2^(e-128), 0])."""
    n = len(ptrs)
    if f.kind == "mxfp4":
        e = ir.Constant(_vt(_I32, 2 * n), None)
        for j, p in enumerate(ptrs):
            e = builder.insert_element(e, builder.zext(builder.load(p), _I32), ir.Constant(_I32, 2 * j))
            e = builder.insert_element(e, ir.Constant(_I32, 2), ir.Constant(_I32, 2 * j + 1))
        small = builder.shl(_cvec(_I32, [0x00200000] * 2 * n), e)
        big = builder.shl(builder.sub(e, _cvec(_I32, [1] * 2 * n)), _cvec(_I32, [23] * 2 * n))
        bits = builder.select(builder.icmp_unsigned("<", e, _cvec(_I32, [2] * 2 * n)), small, big)
        return builder.bitcast(bits, _vt(_F32, 2 * n))
    w = ir.Constant(_vt(_I32, n), None)
    for j, p in enumerate(ptrs):
        w = builder.insert_element(w, _ldv(builder, p, _ci(0), _I32), ir.Constant(_I32, j))
    return builder.fpext(builder.bitcast(w, _vt(ir.HalfType(), 2 * n)), _vt(_F32, 2 * n))


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


def _tile32_codegen(fmt, n_w, n_a):
    f = _FMT32[fmt]
    # accumulator layout: VNNI: one <16 x float> per (row, item) = [even blocks | odd blocks];
    # AVX2: two <8 x float> (even, odd).
    n_par_parts = 1 if _VNNI else 2

    def codegen(context, builder, sig, args):
        rb, nb, i0, ostride, ocol, xq8, xd32, x3, orow, outp, wrow, arows = _tile_args(context, builder, sig,
                                                                                        args, n_w, n_a)
        xs32 = builder.bitcast(x3, _F32.as_pointer())
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
        mvec = []
        if f.has_min:
            mty = _vt(_F32, 2 * n_a)
            mvec = [cgutils.alloca_once(builder, mty) for _ in range(n_w)]
            for p in mvec:
                builder.store(ir.Constant(mty, [0.0] * 2 * n_a), p)

        def step(b, n):
            """Blocks b .. b+n-1 (n = 1 or 2) of every row and item (b even)."""
            boff = builder.mul(b, _ci(f.bb))
            wp = [[builder.gep(wrow[k], [builder.add(boff, _ci(j * f.bb))]) for j in range(n)] for k in range(n_w)]
            if n == 2:
                for k in range(n_w):
                    for line in range(0, 2 * f.bb, 64):
                        _prefetch(builder, builder.gep(wp[k][0], [builder.add(pf_dist, _ci(line))]))
            if _VNNI:
                ws = [[_unpack32(builder, f, wp[k])] for k in range(n_w)]  # one vector of n blocks
            else:
                ws = [[_unpack32(builder, f, [wp[k][j]]) for j in range(n)] for k in range(n_w)]
            sc = [_scales32(builder, f, wp[k]) for k in range(n_w)]  # [d0, m0, (d1, m1)]
            if _VNNI:
                dw = [[_shuf(builder, sc[k], [0] * 8 + ([2] * 8 if n == 2 else []))] for k in range(n_w)]
            else:
                dw = [[_shuf(builder, sc[k], [2 * j] * 8) for j in range(n)] for k in range(n_w)]
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
                dx2 = _ldv(builder, builder.bitcast(builder.gep(xd_t[t], [b]), _I8.as_pointer()), 0, _vt(_F32, n), 4)
                if _VNNI:
                    dx = [_shuf(builder, dx2, [0] * 8 + ([1] * 8 if n == 2 else []))]
                else:
                    dx = [_shuf(builder, dx2, [j] * 8) for j in range(n)]
                for k in range(n_w):
                    for j in range(len(av)):
                        li = _dot32(builder, f, ws[k][j], neg[k][j], av[j], au[j])
                        fl = builder.sitofp(li, _vt(_F32, li.type.count))
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

        npairs = builder.lshr(nb, _ci(1))
        with cgutils.for_range(builder, npairs) as loop:
            step(builder.mul(loop.index, _ci(2)), 2)
        odd = builder.icmp_unsigned("!=", builder.and_(nb, _ci(1)), _ci(0))
        with builder.if_then(odd, likely=False):
            step(builder.sub(nb, _ci(1)), 1)
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


# ---------------------------------------------------------------------------------------
# Tile kernels of the K-quants (Q4_K, Q5_K, Q6_K x Q8_K): R weight rows x A items per pass
# ---------------------------------------------------------------------------------------
# Per super-block (256 elements) and (row, item): an int32 accumulator of 16 lanes takes
# four 64-element pieces, each vpmaddubsw (unsigned weights x activation -> int16 pairs)
# then vpdpwssd / vpmaddwd+vpaddd with the int16 sub-block scales; lanes k and k + 8 are
# then folded (exact), so lane k holds the same integer as ggml's AVX2 kernel's lane k.
# Q6_K's -32 offset enters as -32 * (16 scales . 16 Q8_K sums) in lanes 0..7, and Q4_K /
# Q5_K's mins as sum_j min_j * (bsums[2j] + bsums[2j+1]) (exact int32 dot).
# Float part, in the one-row order: acc = fma(float(lanes), d_w * d_x, acc) per
# super-block (8 lanes; on AVX-512 two items share one zmm), mins = mins + ((dmin_w * d_x) *
# float(min dot)), result = tree sum of acc - mins.


def _kq_pieces(builder, fmt, o):
    """Weight side of one super-block at i8* o: ([4 pieces of <64 x i8> unsigned values],
    [4 x <32 x i16> scale lanes], min lanes <16 x i16> or None, Q6 -32*scales <16 x i16> or
    None, <2 x float> [d, dmin])."""
    pieces, scl = [], []
    if fmt == GGML_Q6_K:
        sc = builder.sext(_ldv(builder, o, 192, _vt(_I8, 16)), _vt(_I16, 16))
        for g in range(4):  # groups 2g, 2g+1: ql half n = g // 2, shift by 4 * (g % 2)
            n, hi4 = g // 2, g % 2
            qh = _ldv(builder, o, 128 + 32 * n, _vt(_I8, 32))
            parts = []
            for delta in range(2):
                ql = _ldv(builder, o, 64 * n + 32 * delta, _vt(_I8, 32))
                k = 2 * hi4 + delta  # group index within its 128-element half
                lo = builder.and_(builder.lshr(ql, _cvec(_I8, [4 * hi4] * 32)), _cvec(_I8, [15] * 32))
                h2 = builder.and_(builder.lshr(qh, _cvec(_I8, [2 * k] * 32)), _cvec(_I8, [3] * 32))
                parts.append(builder.or_(lo, builder.shl(h2, _cvec(_I8, [4] * 32))))
            pieces.append(_concat(builder, parts[0], parts[1]))
            scl.append(_shuf(builder, sc, [4 * g + m // 8 for m in range(32)]))
        neg = builder.mul(sc, _cvec(_I16, [-32] * 16))
        # d: the f16 at 208, read with the scales' last two bytes as one u32 (a lone 16-bit
        # load becomes a vpinsrw into a live register, see ld_f16x2), moved to lane 0
        d2 = builder.fpext(builder.bitcast(_ldv(builder, o, 206, _I32), _vt(ir.HalfType(), 2)), _vt(_F32, 2))
        return pieces, scl, None, neg, _shuf(builder, d2, [1, 0])
    q5 = fmt == GGML_Q5_K
    u = [builder.zext(_ldv(builder, o, 4 + 4 * i, _I32), _I64) for i in range(3)]
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
    qs_off = 48 if q5 else 16
    qh = _ldv(builder, o, 16, _vt(_I8, 32)) if q5 else None
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
    d2 = builder.fpext(builder.bitcast(_ldv(builder, o, 0, _I32), _vt(ir.HalfType(), 2)), _vt(_F32, 2))
    return pieces, scl, mins, None, d2


def _kq_dot(builder, w64, a64, sc32, iacc):
    """iacc <16 x i32> += scale-weighted int16 pair sums of w64 (u8) x a64 (s8)."""
    if _VNNI:
        vi = _vt(_I32, 16)
        p = _maddubs512(builder, w64, a64)
        return _call(builder, "llvm.x86.avx512.vpdpwssd.512", vi,
                     [iacc, builder.bitcast(p, vi), builder.bitcast(sc32, vi)])
    halves = []
    for h in range(2):
        w = _shuf(builder, w64, range(32 * h, 32 * h + 32))
        a = _shuf(builder, a64, range(32 * h, 32 * h + 32))
        halves.append(_madd(builder, _maddubs(builder, w, a), _shuf(builder, sc32, range(16 * h, 16 * h + 16))))
    return builder.add(iacc, _concat(builder, halves[0], halves[1]))


def _hsum_i32(builder, vs):
    """<len(vs) x i32>: lane t = the (exact) sum of the 8 lanes of vs[t] (len a power of 2)."""
    x = _cat(builder, vs) if len(vs) > 1 else vs[0]
    n = x.type.count
    while n > len(vs):
        x = builder.add(_shuf(builder, x, range(0, n, 2)), _shuf(builder, x, range(1, n, 2)))
        n //= 2
    return x


def _tilek_codegen(fmt, n_w, n_a):
    bb = FORMATS[fmt].block_bytes
    has_min = fmt != GGML_Q6_K
    n_pk = (n_a + 1) // 2  # accumulators per row: items packed two per <16 x float>

    def codegen(context, builder, sig, args):
        rb, nb, i0, ostride, ocol, xq8, xd32, x3, orow, outp, wrow, arows = _tile_args(context, builder, sig,
                                                                                        args, n_w, n_a)
        xbs8 = builder.bitcast(x3, _I8.as_pointer())
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

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            boff = builder.mul(b, _ci(bb))
            wb = [builder.gep(wrow[k], [boff]) for k in range(n_w)]
            for k in range(n_w):
                for line in range(0, bb, 64):
                    _prefetch(builder, builder.gep(wb[k], [builder.add(pf_dist, _ci(line))]))
            aoff = builder.mul(b, _ci(QK_K))
            yd = _cat(builder, [builder.insert_element(ir.Constant(_vt(_F32, 1), None),
                                                       builder.load(builder.gep(xd_t[t], [b])), ir.Constant(_I32, 0))
                                for t in range(n_a)]) if n_a > 1 else \
                builder.insert_element(ir.Constant(_vt(_F32, 1), None), builder.load(builder.gep(xd_t[0], [b])),
                                       ir.Constant(_I32, 0))
            bs = [_ldv(builder, xbs_t[t], builder.mul(b, _ci(32)), _vt(_I16, 16)) for t in range(n_a)]
            wk = [_kq_pieces(builder, fmt, wb[k]) for k in range(n_w)]
            # int32 lanes per (row, item); Q6_K starts from -32 * (scales . bsums) in lanes 0..7
            iacc = [[_concat(builder, _madd(builder, wk[k][3], bs[t]), ir.Constant(_VI, [0] * 8))
                     if fmt == GGML_Q6_K else z16 for t in range(n_a)] for k in range(n_w)]
            for g in range(4):  # piece-major: one piece of every row live at a time
                for t in range(n_a):
                    a64 = _ldv(builder, xq_t[t], builder.add(aoff, _ci(64 * g)), _vt(_I8, 64))
                    for k in range(n_w):
                        iacc[k][t] = _kq_dot(builder, wk[k][0][g], a64, wk[k][1][g], iacc[k][t])
            for k in range(n_w):
                _, _, mins, _, d2 = wk[k]
                lanes = [builder.add(_shuf(builder, v, range(8)), _shuf(builder, v, range(8, 16))) for v in iacc[k]]
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


@intrinsic
def _tile(typingctx, fmt, n_w, n_a, arena, wo, rb, nb, xq, xd, xaux, a_rows, i0, o_rows, out, out_stride, ocol):
    """out[o_rows[i0+t] * out_stride + ocol + k] = W[k] . act[a_rows[i0+t]] for k < n_w, t < n_a.

    fmt, n_w, n_a: literal ints (a quantized GGML type, weight rows, items); W[k] is the row
    at byte ``wo + k * rb`` of ``arena`` (nb blocks); xq/xd: the partner's int8 values and
    block scales, xaux: Q8_1 sums s (32-element formats) or Q8_K 16-sums (K-quants). Emits
    the whole pass over the row's blocks (see the two tile sections above)."""
    for v in (fmt, n_w, n_a):
        if not isinstance(v, types.IntegerLiteral):
            return None
    sig = types.void(fmt, n_w, n_a, arena, wo, rb, nb, xq, xd, xaux, a_rows, i0, o_rows, out, out_stride, ocol)
    gen = _tile32_codegen if fmt.literal_value in _FMT32 else _tilek_codegen
    return sig, gen(fmt.literal_value, n_w.literal_value, n_a.literal_value)


_R_TILE = 4 if _VNNI else 1  # weight rows per tile (AVX2: 16 ymm registers hold one row's tiles)


@njit(**_JIT_INLINE)
def _sequential_t1(fmt):
    """Whether a single-item (T=1) matmul of ``fmt`` runs one weight row at a time: a plain
    sequential stream reaches more DRAM bandwidth than a tile's 4 side-by-side rows, which
    decides T=1 for the formats with the least arithmetic per byte. Measured (Zen 5, 256 MiB
    tensors, GB/s, 4-row tiles -> single rows): 1 thread Q8_0 31 -> 38, Q6_K 33 -> 40, Q4_K
    33 -> 33, Q4_1 36 -> 28; 2 threads Q8_0 38 -> 45, Q6_K 36 -> 46, Q4_K 41 -> 46, Q4_1 41 ->
    46 (memory bandwidth ~45). The nibble formats keep their tiles: at T=1 they are
    compute-bound on one core, and so is a small model's decode (SmolLM2-MoE, Q4_1)."""
    return fmt == GGML_Q8_0 or fmt == GGML_Q4_K or fmt == GGML_Q5_K or fmt == GGML_Q6_K


@njit(**_JIT_INLINE)
def _items(fmt, n_w, arena, wo, rb, nb, xq, xd, xaux, a_rows, o_rows, n_items, out, out_stride, ocol):
    """n_w weight rows at byte wo x every item, in tiles of 4, 2, 1 items."""
    i = 0
    while i + 4 <= n_items:
        _tile(fmt, n_w, 4, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)
        i += 4
    if i + 2 <= n_items:
        _tile(fmt, n_w, 2, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)
        i += 2
    if i < n_items:
        _tile(fmt, n_w, 1, arena, wo, rb, nb, xq, xd, xaux, a_rows, i, o_rows, out, out_stride, ocol)


@njit(**_JIT_INLINE)
def _mmq(fmt, arena, w_off, row_bytes_, nb, row_lo, row_hi, xq, xd, xaux, a_rows, o_rows, n_items, out,
         out_stride, out_col):
    """A quantized format's rows [row_lo, row_hi) (nb blocks each) x items: weight rows in
    tiles of _R_TILE (then single rows), each tile read from memory once and dotted with
    every item; a single item of a _sequential_t1 format goes row by row."""
    r = row_lo
    if not (n_items == 1 and _sequential_t1(fmt)):
        while r + _R_TILE <= row_hi:
            _items(fmt, _R_TILE, arena, w_off + r * row_bytes_, row_bytes_, nb, xq, xd, xaux, a_rows, o_rows,
                   n_items, out, out_stride, out_col + r)
            r += _R_TILE
    while r < row_hi:
        _items(fmt, 1, arena, w_off + r * row_bytes_, row_bytes_, nb, xq, xd, xaux, a_rows, o_rows, n_items, out,
               out_stride, out_col + r)
        r += 1


@njit(**_JIT_INLINE)
def _row1_float(ggml_type, arena, wo, n, xf, a):
    """F32 / F16 / BF16 row x activation row a (already rounded to the weight's precision)."""
    s = np.float32(0.0)
    xo = a * n
    if ggml_type == GGML_F32:
        for j in range(n):
            s += ld_f32(arena, wo + 4 * j) * ld(xf, xo + j)
    elif ggml_type == GGML_F16:
        for j in range(n):
            s += ld_f16(arena, wo + 2 * j) * ld(xf, xo + j)
    else:
        for j in range(n):
            s += ld_bf16(arena, wo + 2 * j) * ld(xf, xo + j)
    return s


# ---------------------------------------------------------------------------------------
# Format kernels: compiled once each, as C-ABI functions (numba cfunc), called through an
# address table
# ---------------------------------------------------------------------------------------
# numba re-optimizes a callee's whole code inside every jitted caller that links it, so the
# big format kernels would be recompiled once per call site (matmul, the pool's items, the
# MoE items, ...). Compiled as cfuncs and called through addresses read at run time from
# ``kernel_table()`` (never baked into cached code), each is compiled exactly once, and only
# for the formats a model uses (``ensure_kernels``). All share one signature:
#   (arena u8*, w_off, row_bytes, n_cols, row_lo, row_hi, xf f32*, xq i8*, xd f32*, xs f32*,
#    xbs i16*, a_rows i64*, o_rows i64*, n_items, out f32*, out_stride, out_col, ggml_type)


def _mm_q8_0(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
            out, out_stride, out_col, ggml_type):
    """Q8_0 rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q8_0, arena, w_off, row_bytes_, n_cols // QK, row_lo, row_hi, xq, xd, xs, a_rows, o_rows, n_items, out,
          out_stride, out_col)


def _mm_q4_0(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
            out, out_stride, out_col, ggml_type):
    """Q4_0 rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q4_0, arena, w_off, row_bytes_, n_cols // QK, row_lo, row_hi, xq, xd, xs, a_rows, o_rows, n_items, out,
          out_stride, out_col)


def _mm_q4_1(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
            out, out_stride, out_col, ggml_type):
    """Q4_1 rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q4_1, arena, w_off, row_bytes_, n_cols // QK, row_lo, row_hi, xq, xd, xs, a_rows, o_rows, n_items, out,
          out_stride, out_col)


def _mm_q5_0(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
            out, out_stride, out_col, ggml_type):
    """Q5_0 rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q5_0, arena, w_off, row_bytes_, n_cols // QK, row_lo, row_hi, xq, xd, xs, a_rows, o_rows, n_items, out,
          out_stride, out_col)


def _mm_q5_1(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
            out, out_stride, out_col, ggml_type):
    """Q5_1 rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q5_1, arena, w_off, row_bytes_, n_cols // QK, row_lo, row_hi, xq, xd, xs, a_rows, o_rows, n_items, out,
          out_stride, out_col)


def _mm_mxfp4(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
             out, out_stride, out_col, ggml_type):
    """MXFP4 rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_MXFP4, arena, w_off, row_bytes_, n_cols // QK, row_lo, row_hi, xq, xd, xs, a_rows, o_rows, n_items, out,
          out_stride, out_col)


def _mm_q4_k(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
             out, out_stride, out_col, ggml_type):
    """Q4_K rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q4_K, arena, w_off, row_bytes_, n_cols // QK_K, row_lo, row_hi, xq, xd, xbs, a_rows, o_rows, n_items,
         out, out_stride, out_col)


def _mm_q5_k(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
             out, out_stride, out_col, ggml_type):
    """Q5_K rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q5_K, arena, w_off, row_bytes_, n_cols // QK_K, row_lo, row_hi, xq, xd, xbs, a_rows, o_rows, n_items,
         out, out_stride, out_col)


def _mm_q6_k(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
             out, out_stride, out_col, ggml_type):
    """Q6_K rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."""
    _mmq(GGML_Q6_K, arena, w_off, row_bytes_, n_cols // QK_K, row_lo, row_hi, xq, xd, xbs, a_rows, o_rows, n_items,
         out, out_stride, out_col)


def _mm_float(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
              out, out_stride, out_col, ggml_type):
    """F32 / F16 / BF16 rows [row_lo, row_hi) x activation rows (see matmul_rows)."""
    for r in range(row_lo, row_hi):
        wo = w_off + r * row_bytes_
        for i in range(n_items):
            st(out, ld(o_rows, i) * out_stride + out_col + r, _row1_float(ggml_type, arena, wo, n_cols, xf, ld(a_rows, i)))


_P = types.CPointer
_KERNEL_SIG = types.void(_P(types.uint8), types.int64, types.int64, types.int64, types.int64, types.int64,
                         _P(types.float32), _P(types.int8), _P(types.float32), _P(types.float32), _P(types.int16),
                         _P(types.int64), _P(types.int64), types.int64, _P(types.float32), types.int64, types.int64,
                         types.int64)
_KERNEL_PY = {GGML_Q8_0: _mm_q8_0, GGML_Q4_0: _mm_q4_0, GGML_Q4_1: _mm_q4_1, GGML_Q5_0: _mm_q5_0,
              GGML_Q5_1: _mm_q5_1, GGML_MXFP4: _mm_mxfp4, GGML_Q6_K: _mm_q6_k, GGML_Q4_K: _mm_q4_k,
              GGML_Q5_K: _mm_q5_k, GGML_F32: _mm_float, GGML_F16: _mm_float, GGML_BF16: _mm_float}
_KERNEL_TABLE = np.zeros(64, np.int64)  # ggml type id -> cfunc address (0: not compiled yet)
_KERNEL_CFUNCS: dict[object, object] = {}  # python function -> its cfunc (keeps the code alive)
_KERNEL_LOCK = threading.Lock()


def ensure_kernels(ggml_types) -> np.ndarray:
    """Compile (or load from numba's cache) the kernels of these GGML types; returns the
    address table matmul_rows reads. Thread-safe; each kernel is compiled once per process.
    ModelFileError for an unsupported type."""
    for t in ggml_types:
        t = int(t)
        if _KERNEL_TABLE[t]:
            continue
        block_format(t)
        with _KERNEL_LOCK:
            if _KERNEL_TABLE[t]:
                continue
            py = _KERNEL_PY[t]
            cf = _KERNEL_CFUNCS.get(py)
            if cf is None:
                opts = dict(nopython=True, cache=True)
                if py is _mm_float:
                    opts["fastmath"] = {"reassoc", "contract", "nsz"}
                cf = _KERNEL_CFUNCS[py] = cfunc(_KERNEL_SIG, **opts)(py)
            _KERNEL_TABLE[t] = cf.address
    return _KERNEL_TABLE


def kernel_table() -> np.ndarray:
    """The address table of the kernels compiled so far (see ensure_kernels)."""
    return _KERNEL_TABLE


@intrinsic
def _call_kernel(typingctx, addr, arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows,
                 o_rows, n_items, out, out_stride, out_col, ggml_type):
    """Call the format kernel at address ``addr`` (one of ensure_kernels' cfuncs)."""
    sig = types.void(types.int64, *_KERNEL_SIG.args)

    def codegen(context, builder, signature, args):
        argtys = signature.args[1:]
        fnty = ir.FunctionType(ir.VoidType(), [context.get_value_type(t) for t in argtys])
        fptr = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fptr, list(args[1:]))
        return context.get_dummy_value()

    return sig, codegen


@njit(**_JIT)
def matmul_rows(arena, w_off, ggml_type, n_cols, row_bytes_, row_lo, row_hi, xf, xq, xd, xs, xbs,
                a_rows, o_rows, out, out_stride, out_col, kernels):
    """out[o_rows[i], out_col + r] = W[r] . act[a_rows[i]] for r in [row_lo, row_hi), all i.

    arena: uint8 [*], the weight tensor's row r at byte ``w_off + r * row_bytes_`` (GGUF
    blocks of ``ggml_type``, read in place, n_cols elements); xf/xq/xd/xs/xbs: activations in
    the type's partner format (PartnerArrays, rows of n_cols); a_rows/o_rows: int64 [n]
    activation row and output row of each item (arange(T) for a plain matmul; the tokens
    routed to one expert for the MoE); out: float32, flat, (o, c) at ``o * out_stride + c``;
    kernels: ensure_kernels([ggml_type]) (the format kernels' addresses).
    Quantized formats run in tiles of 4 weight rows x 4 items (see the tile sections): each
    weight row is read from memory once per call and each block unpacked once per tile.
    The caller validates types, offsets and shapes; a type whose kernel is not compiled
    writes nothing.
    """
    addr = ld(kernels, ggml_type)
    if addr == 0:
        return
    _call_kernel(addr, data_ptr(arena), w_off, row_bytes_, n_cols, row_lo, row_hi, data_ptr(xf), data_ptr(xq),
                 data_ptr(xd), data_ptr(xs), data_ptr(xbs), data_ptr(a_rows), data_ptr(o_rows), a_rows.shape[0],
                 data_ptr(out), out_stride, out_col, ggml_type)


# ---------------------------------------------------------------------------------------
# Python-facing API
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartnerArrays:
    """Activations [T, C] encoded in one partner format, as flat C-contiguous arrays.

    xf float32 [T*C] (F32/F16/BF16 partners), xq int8 [T*C] (Q8 partners), xd float32 [T*C/32]
    or [T*C/256] (block scales d), xs float32 [T*C/32] (Q8_1 s), xbs int16 [T*C/16] (Q8_K
    sums). Arrays a partner does not use hold one element.
    """

    partner: Partner
    n_tok: int
    n_cols: int
    xf: np.ndarray
    xq: np.ndarray
    xd: np.ndarray
    xs: np.ndarray
    xbs: np.ndarray


def _alloc_partner(partner: Partner, n_tok: int, n_cols: int) -> PartnerArrays:
    blk = PARTNER_BLOCK[partner]
    if n_cols % max(blk, 16 if partner == Partner.Q8_K else 1):
        raise ValueError(f"activation rows of {n_cols} columns are not whole {partner.name} blocks of {blk}")
    one_f = np.zeros(1, np.float32)
    is_float = blk == 1
    return PartnerArrays(
        partner, n_tok, n_cols,
        xf=np.empty(n_tok * n_cols, np.float32) if is_float else one_f,
        xq=np.empty(n_tok * n_cols, np.int8) if not is_float else np.zeros(1, np.int8),
        xd=np.empty(n_tok * (n_cols // blk), np.float32) if not is_float else one_f,
        xs=np.empty(n_tok * (n_cols // blk), np.float32) if partner == Partner.Q8_1 else one_f,
        xbs=np.empty(n_tok * (n_cols // 16), np.int16) if partner == Partner.Q8_K else np.zeros(1, np.int16),
    )


def quantize_activations(x: np.ndarray, partner: Partner) -> PartnerArrays:
    """Encode activations x float32 [T, C] (or [C]) in ``partner`` format, one pass per row."""
    x2 = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    n_tok, n_cols = x2.shape
    pa = _alloc_partner(Partner(partner), n_tok, n_cols)
    quantize_partner_rows(int(partner), x2.reshape(-1), n_tok, n_cols, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs)
    return pa


class Activations:
    """Activations x float32 [T, C] plus each partner encoding, computed once on first use.

    ``encoded(partner)`` quantizes every token row once; all weight rows (and all tensors of
    the same partner format, e.g. q/k/v) then reuse it.
    """

    def __init__(self, x: np.ndarray):
        self.x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)  # [T, C]
        self.n_tok, self.n_cols = self.x.shape
        self._enc: dict[Partner, PartnerArrays] = {}

    def encoded(self, partner: Partner) -> PartnerArrays:
        pa = self._enc.get(partner)
        if pa is None:
            pa = self._enc[partner] = quantize_activations(self.x, partner)
        return pa


def random_blocks(rng: np.random.Generator, ggml_type: int, n_rows: int, n_cols: int,
                  scale: float = 0.01) -> np.ndarray:
    """A tensor of n_rows x n_cols ``ggml_type`` as uint8 [n_rows * row_bytes]: random bytes
    with finite float16 scale fields (normal, std ``scale``), MXFP4 exponents in 2^-10..2^-1,
    and normal F32/F16/BF16 values. For tests and benchmarks of the kernels."""
    f = block_format(ggml_type)
    nb = n_cols // f.block_elems
    if f.block_elems == 1:
        x = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        if ggml_type == GGML_F32:
            return x.view(np.uint8).reshape(-1)
        if ggml_type == GGML_F16:
            return x.astype(np.float16).view(np.uint8).reshape(-1)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    raw = rng.integers(0, 256, size=(n_rows, nb, f.block_bytes), dtype=np.uint8)
    f16_fields = {GGML_Q4_0: (0,), GGML_Q5_0: (0,), GGML_Q8_0: (0,), GGML_Q4_1: (0, 2), GGML_Q5_1: (0, 2),
                  GGML_Q4_K: (0, 2), GGML_Q5_K: (0, 2), GGML_Q6_K: (208,)}
    for off in f16_fields.get(ggml_type, ()):
        v = (rng.standard_normal((n_rows, nb)) * scale).astype(np.float16)
        raw[:, :, off:off + 2] = v.view(np.uint8).reshape(n_rows, nb, 2)
    if ggml_type == GGML_MXFP4:
        raw[:, :, 0] = rng.integers(118, 128, size=(n_rows, nb))
    return raw.reshape(-1)


def check_tensor(arena: np.ndarray, offset: int, ggml_type: int, n_rows: int, n_cols: int) -> int:
    """Validate a tensor of n_rows x n_cols ``ggml_type`` at byte ``offset`` of ``arena``.

    Returns its row bytes. ValueError when the arena is not a 1-D C-contiguous uint8 array or
    the tensor runs past its end; ModelFileError for an unsupported type.
    """
    if arena.dtype != np.uint8 or arena.ndim != 1 or not arena.flags.c_contiguous:
        raise ValueError(f"arena must be a 1-D C-contiguous uint8 array (got {arena.dtype} {arena.shape})")
    rb = row_bytes(ggml_type, n_cols)
    if offset < 0 or offset + n_rows * rb > arena.size:
        raise ValueError(
            f"tensor of {n_rows} x {n_cols} {block_format(ggml_type).name} at byte {offset} needs "
            f"{n_rows * rb} bytes but the arena ends at {arena.size}"
        )
    return rb


def dequantize(arena: np.ndarray, ggml_type: int, n_rows: int, n_cols: int, offset: int = 0) -> np.ndarray:
    """Dequantize a whole tensor to float32 [n_rows, n_cols] (bit-exact with gguf.quants)."""
    rb = check_tensor(arena, offset, ggml_type, n_rows, n_cols)
    out = np.empty(n_rows * n_cols, np.float32)
    dequantize_rows(arena, int(offset), int(ggml_type), int(n_cols), rb, np.arange(n_rows, dtype=np.int64), out)
    return out.reshape(n_rows, n_cols)


def matmul(arena: np.ndarray, offset: int, ggml_type: int, n_rows: int, n_cols: int,
           x: np.ndarray | Activations, out: np.ndarray | None = None,
           row_lo: int = 0, row_hi: int | None = None) -> np.ndarray:
    """Single-threaded y = x @ W.T for a GGUF tensor read in place.

    arena: uint8 [*]; the tensor is n_rows rows of row_bytes(ggml_type, n_cols) bytes at
    ``offset`` (ggml ne = {n_cols, n_rows}); x: float32 [T, n_cols] or an Activations;
    returns out float32 [T, n_rows] (only columns [row_lo, row_hi) written). The worker pool
    (pool.py) splits the row range over threads.
    """
    rb = check_tensor(arena, offset, ggml_type, n_rows, n_cols)
    act = x if isinstance(x, Activations) else Activations(x)
    if act.n_cols != n_cols:
        raise ValueError(f"activations have {act.n_cols} columns, the tensor has {n_cols}")
    pa = act.encoded(block_format(ggml_type).partner)
    if out is None:
        out = np.zeros((act.n_tok, n_rows), np.float32)
    if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape != (act.n_tok, n_rows):
        raise ValueError(f"out must be C-contiguous float32 {(act.n_tok, n_rows)} (got {out.dtype} {out.shape})")
    hi = n_rows if row_hi is None else row_hi
    if not 0 <= row_lo <= hi <= n_rows:
        raise ValueError(f"row range [{row_lo}, {hi}) is outside [0, {n_rows})")
    rows = np.arange(act.n_tok, dtype=np.int64)
    matmul_rows(arena, int(offset), int(ggml_type), int(n_cols), rb, int(row_lo), int(hi), pa.xf, pa.xq, pa.xd,
                pa.xs, pa.xbs, rows, rows, out.reshape(-1), n_rows, 0, ensure_kernels([ggml_type]))
    return out
