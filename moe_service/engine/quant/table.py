"""The kernel table: one C-ABI matmul kernel per format, generated from the format
declarations, compiled on first use and called through an address table (matmul_rows).
Also the Python-facing ``matmul``."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

from moe_service.engine.quant.activations import Activations
from moe_service.engine.quant.dequant import check_tensor
from moe_service.engine.quant.ir import (
    _JIT,
    _JIT_INLINE,
    _VNNI,
    data_ptr,
    dot_f32_ggml,
    ld,
    ld_bf16,
    ld_f16,
    st,
)
from moe_service.engine.quant.ladder import tile_ladder, tile_ladder_range
from moe_service.engine.quant.tiles32 import OFFSET, _tile32_codegen
from moe_service.engine.quant.tiles_iq import opaque_int, takes_unpacked
from moe_service.engine.quant.tiles_iq_blocked import mmq_unpacked_blocked
from moe_service.engine.quant.tiles_k import UNPACKED, _tilek_codegen
from moe_service.engine.quant.tiles_q6_unpacked import Q6_UNPACKED, mmq_q6_unpacked, takes_q6_unpacked
from moe_service.engine.quant.tiles_t1 import T1_SIDES
from moe_service.formats import (
    FORMATS,
    GGML_F16,
    GGML_F32,
    BlockFormat,
    block_format,
)


@intrinsic
def _tile(typingctx, fmt, n_w, n_a, arena, wo, rb, nb, xq, xd, xaux, a_rows, i0, o_rows, out, out_stride, ocol):
    """out[o_rows[i0+t] * out_stride + ocol + k] = W[k] . act[a_rows[i0+t]] for k < n_w, t < n_a.

    fmt, n_w, n_a: literal ints (a quantized GGML type, weight rows, items); W[k] is the row
    at byte ``wo + k * rb`` of ``arena`` (nb blocks); xq/xd: the partner's int8 values and
    block scales, xaux: Q8_1 sums s (32-element formats) or Q8_K 16-sums (K-quants). Emits
    the whole pass over the row's blocks (tiles32.py, tiles_k.py)."""
    for v in (fmt, n_w, n_a):
        if not isinstance(v, types.IntegerLiteral):
            return None
    sig = types.void(fmt, n_w, n_a, arena, wo, rb, nb, xq, xd, xaux, a_rows, i0, o_rows, out, out_stride, ocol)
    if FORMATS[fmt.literal_value].family == "32":
        return sig, _tile32_codegen(fmt.literal_value, n_w.literal_value, n_a.literal_value)
    return sig, _tilek_codegen(fmt.literal_value, n_w.literal_value, n_a.literal_value,
                               t1_side=T1_SIDES.get(fmt.literal_value),
                               ymm=n_a.literal_value == 1 and fmt.literal_value in _T1_YMM)


@intrinsic
def _aux(typingctx, fmt, xs, xbs):
    """The partner's auxiliary array a format's tiles read (literal ``fmt``): the Q8_1 sums
    ``xs`` (float32*) for the 32-element family, the Q8_K 16-sums ``xbs`` (int16*) for the
    K-quants. Chosen at compile time: a run-time ``xs if ... else xbs`` would not unify."""
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    k_family = FORMATS[fmt.literal_value].family == "k"
    sig = (xbs if k_family else xs)(fmt, xs, xbs)

    def codegen(context, builder, signature, args):
        return args[2] if k_family else args[1]

    return sig, codegen


_A8 = frozenset() if _VNNI else frozenset(t for t, f in FORMATS.items() if f.family == "k")
"""Formats whose tiles take 8 items at a time: the AVX2 K-quants, whose (row, item) integer
accumulator is one ymm (tiles_k._kq_dot), so 8 items fit the 16 registers and one weight
row's unpacking (about 40% of a 4-item tile's instructions) serves twice the items.
Measured on AMD EPYC Zen 3, one thread, T = 8..64: Q5_K and Q6_K ~10% faster, Q4_K within
the noise (python bench/kernels.py --formats Q4_K,Q5_K,Q6_K --tokens 8,16,64 --threads 1).
The results are the same bit for bit (integer sums)."""


def _member_of(formats: frozenset, name: str):
    """An intrinsic ``f(fmt)``: whether the literal format ``fmt`` is in ``formats``, as a
    compile-time constant (each call site's branch folds away)."""

    @intrinsic
    def member(typingctx, fmt):
        if not isinstance(fmt, types.IntegerLiteral):
            return None
        val = fmt.literal_value in formats

        def codegen(context, builder, signature, args):
            return ir.Constant(ir.IntType(1), int(val))

        return types.boolean(fmt), codegen

    member.__doc__ = f"Whether the literal format ``fmt`` is in {name}, as a constant."
    return member


_a8 = _member_of(_A8, "_A8")


_T1_YMM = frozenset(t for t, f in FORMATS.items() if f.name in ("IQ1_S", "Q2_K")) if _VNNI else frozenset()
"""AVX-512 hosts: formats whose one-item matmul takes the AVX2 (256-bit) one-item tile (its
indices a super-block ahead, tiles_t1's sides; IQ1_S two rows per tile as _T1_PAIRS), where it
measured faster than the 4-row 512-bit tiles (Sapphire Rapids-class Xeon, one thread, T = 1, 32
x 7,168 hot, ns per 32 weights, AVX-512 -> AVX2 kernels: IQ1_S 2.26 -> 1.94-2.01, Q2_K 1.03 ->
0.93-0.99; not taken: IQ1_M 2.41 -> 2.53, IQ2_XXS 1.82 -> 1.88, IQ2_XS 1.86 -> 2.10, Q6_K 0.72 ->
1.00). The same integer lanes and float steps: the same results bit for bit."""


_t1_ymm = _member_of(_T1_YMM, "_T1_YMM")

_T1_PAIRS = (frozenset(t for t, f in FORMATS.items() if f.name == "IQ1_S") if _VNNI
             else frozenset(t for t, f in FORMATS.items() if f.name in ("IQ1_S", "IQ1_M")))
"""Formats whose one-item matmul takes its weight rows two per tile (AVX2: IQ1_S, IQ1_M; AVX-512:
IQ1_S, in its _T1_YMM tile): the two
rows' unpacking (table loads, index arithmetic) and dots interleave in one loop, which the
out-of-order core overlaps better than one row's chain after another's (each row's indices
one super-block ahead: tiles_k._IndicesAhead). Measured on Zen 3, one thread, T = 1, 256
rows x 2048 hot in L2, CPU time, best of 5 x 200 calls, alternated, ns per 32 weights:
IQ1_S 2.70-2.75 -> 2.55-2.57 (without _IndicesAhead two rows measured no gain:
docs/iq-decode-notes.md); IQ1_M 3.24-3.41 -> 3.10-3.26; not taken: IQ2_XXS 2.76-2.78 ->
2.93-2.98, IQ2_S 2.84-2.87 -> 2.85, IQ3_S 3.67-3.77 -> 3.79-3.90. The same results bit
for bit: each row's integer lanes and float steps are the one-row tile's."""


_t1_pairs = _member_of(_T1_PAIRS, "_T1_PAIRS")


_R_TILE = 4 if _VNNI else 1  # weight rows per tile (AVX2: 16 ymm registers hold one row's tiles)


@njit(**_JIT_INLINE)
def _items(fmt, n_w, arena, wo, rb, nb, xq, xd, xaux, a_rows, o_rows, n_items, out, out_stride, ocol):
    """n_w weight rows at byte wo x every item, in tiles of 8 (see _A8), 4, 2, 1 items (ladder.py)."""
    tile_ladder(_tile, _a8(fmt), fmt, n_w, arena, wo, rb, nb, xq, xd, xaux, a_rows, o_rows, n_items, out,
                out_stride, ocol)


@intrinsic
def _offset_of(typingctx, fmt):
    """tiles32.OFFSET of the literal format ``fmt`` (0: none), as a constant."""
    if not isinstance(fmt, types.IntegerLiteral):
        return None
    val = OFFSET.get(fmt.literal_value, 0)

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(64), val)

    return types.int64(fmt), codegen


@njit(**_JIT_INLINE)
def _fill_sums(off, xq, row, nb, sums):
    """sums[8 b + k] = off x (the four int8 activation values 32 b + 4 k .. + 3 of row ``row``)."""
    base = row * nb * 32
    for b in range(nb):
        for k in range(8):
            o = base + b * 32 + 4 * k
            st(sums, b * 8 + k, np.int32(off * (np.int64(ld(xq, o)) + ld(xq, o + 1) + ld(xq, o + 2) + ld(xq, o + 3))))


@njit(**_JIT)
def _mmq_offset1(fmt, arena, w_off, row_bytes_, nb, row_lo, row_hi, xq, xd, a_rows, o_rows, out, out_stride,
                 out_col):
    """_mmq of one item for a tiles32.OFFSET format: the item's activation sums once per call,
    then row by row in the offset form (a function of its own: the kernel's multi-item
    tiles compile exactly as for the other formats). Measured on AMD EPYC Zen 3 at one
    token (python bench/kernels.py --formats MXFP4,Q4_0 --tokens 1 --threads 1,2): MXFP4
    10.4 -> 12.8 GB/s on one thread and 20.4 -> 25.3 on two, Q4_0 10.4 -> 13.0 / 20.3 ->
    25.8; the same results bit for bit."""
    sums = np.empty(nb * 8, np.int32)
    _fill_sums(_offset_of(fmt), xq, ld(a_rows, 0), nb, sums)
    sp = data_ptr(sums)
    for r in range(row_lo, row_hi):
        _items(fmt, 1, arena, w_off + r * row_bytes_, row_bytes_, nb, xq, xd, sp, a_rows, o_rows, 1, out,
               out_stride, out_col + r)
    # sp carries no reference: numba releases an array after its last use in the function, so
    # this use keeps ``sums`` alive until every row has read it through sp
    st(sums, 0, ld(sums, 0))


_ITEM_BLOCK_BYTES = 128 << 10
"""Activation bytes (Q8_K: 292 per 256 elements) of one item block of _mmq_blocked."""

_ROW_BLOCK_BYTES = 192 << 10
"""Weight bytes of one row block of _mmq_blocked."""


@njit(**_JIT_INLINE)
def _item_block(nb):
    """Items per block of _mmq_blocked at nb Q8_K blocks a row: a multiple of 8, at least 8."""
    return max(8, _ITEM_BLOCK_BYTES // (nb * 292) // 8 * 8)


@njit(**_JIT_INLINE)
def _mmq_blocked(fmt, arena, w_off, row_bytes_, nb, row_lo, row_hi, xq, xd, xaux, a_rows, o_rows, n_items, out,
                 out_stride, out_col):
    """_mmq of the AVX2 K-quants (table._A8) at more items than one item block: blocks of
    rows (_ROW_BLOCK_BYTES of weights) x blocks of items (_ITEM_BLOCK_BYTES of activations),
    ggml's 16 x 16 blocking of its mul_mat (ggml-cpu.c) in byte-sized blocks. Row by row over
    all items, the T = 128 activations of a 7168-column row (1.05 MB of Q8_K) outgrow the 512
    KiB L2, and every weight row streamed them from L3; in blocks, an item block stays in L2
    while the row block's rows (from memory once, then L2) pass over it. The item blocks
    start at multiples of 8, so every (row, item) gets the same tile as row by row: the same
    results bit for bit. Measured (Zen 3, one thread, shared host, ns per 32 weights per token,
    T = 128, python bench/kernels.py --formats Q6_K --tokens 128 --threads 1 --cols 7168):
    Q6_K 0.91-0.93 -> 0.66-0.72; Q4_K / Q5_K at 7168 columns (CPU time) 0.90-0.98 -> 0.74-0.75;
    2048 columns (activations in L2 already) unchanged (docs/v3-prefill-notes.md). The
    32-element formats' 4-item tiles gained ~4% in blocks (Q8_0, 7168 columns): not taken."""
    ib = _item_block(nb)
    rblk = max(1, _ROW_BLOCK_BYTES // row_bytes_)
    for r0 in range(row_lo, row_hi, rblk):
        r1 = min(row_hi, r0 + rblk)
        for i0 in range(0, n_items, ib):
            i1 = min(n_items, i0 + ib)
            for r in range(r0, r1):
                tile_ladder_range(_tile, True, fmt, 1, arena, w_off + r * row_bytes_, row_bytes_, nb, xq, xd, xaux,
                                  a_rows, o_rows, i0, i1, out, out_stride, out_col + r)


@njit(**_JIT_INLINE)
def _mmq(fmt, sequential_t1, arena, w_off, row_bytes_, nb, row_lo, row_hi, xq, xd, xaux, a_rows, o_rows, n_items,
         out, out_stride, out_col):
    """A quantized format's rows [row_lo, row_hi) (nb blocks each) x items: weight rows in
    tiles of _R_TILE (then single rows), each tile read from memory once and dotted with
    every item; a single item of a ``sequential_t1`` format (formats.SEQUENTIAL_T1_NOTE:
    a plain stream beats 4 side-by-side rows when memory-bound) goes row by row, of a
    _T1_PAIRS format two rows per tile."""
    if _a8(fmt) and n_items > _item_block(nb):
        _mmq_blocked(fmt, arena, w_off, row_bytes_, nb, row_lo, row_hi, xq, xd, xaux, a_rows, o_rows, n_items, out,
                     out_stride, out_col)
        return
    r = row_lo
    if n_items == 1 and _t1_pairs(fmt):
        while r + 2 <= row_hi:
            _tile(fmt, 2, 1, arena, w_off + r * row_bytes_, row_bytes_, nb, xq, xd, xaux, a_rows, 0, o_rows, out,
                  out_stride, out_col + r)
            r += 2
    if not (n_items == 1 and (sequential_t1 or _t1_ymm(fmt))):
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
    """F32 / F16 / BF16 row x activation row a (already rounded to the weight's precision).
    F32 sums in ggml's fixed 16-lane order (ir.dot_f32_ggml); F16 / BF16 in the order LLVM's
    vectorizer picks for the host."""
    s = np.float32(0.0)
    xo = a * n
    if ggml_type == GGML_F32:
        s = dot_f32_ggml(arena, wo, xf, xo, n)
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


# The quantized kernels are generated from the format declarations by ``_make_kernel``: the
# format id, its block size and its sequential_t1 choice are closure constants, which numba
# compiles as literals (the tile intrinsics need the format id as one) and which its on-disk
# cache hashes into the index key (numba/core/caching.py ``_index_key``), so each format
# caches separately. Closures hold only ints and bools: a dispatcher in a closure pickles
# with a per-process uuid and would never hit the cache.


def _make_kernel(f: BlockFormat):
    """The matmul kernel of quantized format ``f`` (python function, for cfunc)."""
    fmt, block_elems, sequential_t1 = f.type_id, f.block_elems, f.sequential_t1

    if fmt in OFFSET:  # one item in tiles32's offset form (a call of its own), more in the tiles
        def kernel(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
                   out, out_stride, out_col, ggml_type):
            if n_items == 1:
                _mmq_offset1(fmt, arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd, a_rows,
                             o_rows, out, out_stride, out_col)
            else:
                _mmq(fmt, sequential_t1, arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd,
                     _aux(fmt, xs, xbs), a_rows, o_rows, n_items, out, out_stride, out_col)
    elif fmt in UNPACKED:  # each row unpacked once (tiles_iq.takes_unpacked), else the tiles over the blocks
        def kernel(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
                   out, out_stride, out_col, ggml_type):
            if takes_unpacked(fmt, n_items):
                mmq_unpacked_blocked(fmt, arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd,
                                     xbs, a_rows, o_rows, n_items, out, out_stride, out_col)
            else:
                _mmq(fmt, sequential_t1, arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd,
                     xbs, a_rows, o_rows, opaque_int(n_items), out, out_stride, out_col)
    elif fmt in Q6_UNPACKED:  # unpacked rows at the shapes where they measure faster (tiles_q6_unpacked)
        def kernel(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
                   out, out_stride, out_col, ggml_type):
            if takes_q6_unpacked(n_cols // block_elems, n_items):
                mmq_q6_unpacked(arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd, xbs, a_rows,
                                o_rows, n_items, out, out_stride, out_col)
            else:  # n_items opaque: today's path compiles as before (see opaque_int)
                _mmq(fmt, sequential_t1, arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd,
                     xbs, a_rows, o_rows, opaque_int(n_items), out, out_stride, out_col)
    else:
        def kernel(arena, w_off, row_bytes_, n_cols, row_lo, row_hi, xf, xq, xd, xs, xbs, a_rows, o_rows, n_items,
                   out, out_stride, out_col, ggml_type):
            _mmq(fmt, sequential_t1, arena, w_off, row_bytes_, n_cols // block_elems, row_lo, row_hi, xq, xd,
                 _aux(fmt, xs, xbs), a_rows, o_rows, n_items, out, out_stride, out_col)

    kernel.__name__ = kernel.__qualname__ = f"_mm_{f.name.lower()}"
    kernel.__doc__ = f"{f.name} rows [row_lo, row_hi) x activation rows a_rows -> out rows o_rows (see matmul_rows)."
    return kernel


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
_KERNEL_PY = {t: (_mm_float if f.family == "float" else _make_kernel(f)) for t, f in FORMATS.items()}
_KERNEL_TABLE = np.zeros(64, np.int64)  # ggml type id -> cfunc address (0: not compiled yet)
_KERNEL_CFUNCS: dict[object, Any] = {}  # python function -> its cfunc (keeps the code alive)
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
                opts: dict[str, Any] = dict(nopython=True, cache=True)
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
    Quantized formats run in tiles of 4 weight rows x 4 items (AVX2: 1 row x up to 4 items, 8
    for the K-quants; see the tile sections): each weight row is read from memory once per
    call and each block unpacked once per tile (AVX2 K-quants at many items: in L2-sized row x
    item blocks, _mmq_blocked).
    The caller validates types, offsets and shapes; a type whose kernel is not compiled
    writes nothing.
    """
    addr = ld(kernels, ggml_type)
    if addr == 0:
        return
    _call_kernel(addr, data_ptr(arena), w_off, row_bytes_, n_cols, row_lo, row_hi, data_ptr(xf), data_ptr(xq),
                 data_ptr(xd), data_ptr(xs), data_ptr(xbs), data_ptr(a_rows), data_ptr(o_rows), a_rows.shape[0],
                 data_ptr(out), out_stride, out_col, ggml_type)



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
