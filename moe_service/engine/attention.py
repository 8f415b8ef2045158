"""Attention over the KV cache on the CPU: the one interface every architecture calls.

This module is the contract between the per-architecture blocks (they compute q, k, v and
call :func:`store` then :func:`attend` once per layer with every sequence of the step) and
the attention kernels (how the work is split over cores, tiled and vectorised). Its
callers never see the cache's element format or the work split.

Shapes: T tokens of this step (all sequences together), S sequence slots, C cache length,
NH query heads, NKV KV heads, D key dim, Dv value dim, G = NH / NKV query heads per KV head.

``spans``: a list of (seq, a, e, n0): the step's tokens a..e-1 belong to sequence slot
``seq`` and sit at positions n0..n0+(e-a)-1 of its cache.

Caches (one pair per layer, as the KV cache holds them, see moe_service.engine.kv):

- float16 (``kv_type = f16``): ``kc`` uint16 [S, C, NKV, D] and ``vc`` uint16 [S, C, NKV, Dv],
  float16 values held as their bits (numba has no float16 type);
- q8_0 (``kv_type = q8_0``, llama.cpp's ``-ctk/-ctv q8_0``): ``kc`` uint8 [S, C, NKV, D/32*34],
  each head row D/32 ggml Q8_0 blocks (float16 scale d, 32 int8 q; value = d * q);
  ``vc`` likewise with Dv.

A latent (MLA) cache passes ``vc is kc``: V is then the first Dv dims of each K row, and
:func:`store` writes K only.

How the work runs (:func:`attend`): tasks of (sequence, KV head, query tile[, part]) on the
engine's persistent worker pool (pool.K_CALL items calling this module's compiled item
function through its address, so editing this file never recompiles the pool's kernels).
A task gathers its tile's query rows of the heads of one KV head's group (R = tokens x
heads), rounds them to float16, and walks the cache in key tiles of ``BK`` rows (a tile
serves all R query rows). Default mode: K.Q as vector dot products in ggml's lane order and
P.V as fused multiply-adds (each value row loaded once for up to four heads, whose
accumulators stay in registers: :func:`_pv_heads16`). A decode reads a float16 cache in
place (each key once for two to four heads of the group: :func:`_dot64_heads_keys8`),
prefetching the rows ``_KV_PREFETCH_KEYS`` keys ahead. A
prefill widens each key and value tile once into a contiguous float32 tile that all the
task's rows read, and scores 16 keys x two to four heads of a token per call
(:func:`_dot16_heads_keys`). A Q8_0 cache is always widened to a float32 tile. These
kernels hold 16 float32 lanes per vector where the 512-bit kernels run (``_SCORE_LANES``),
else 8; each lane's sum is the same either way. Online mode
widens K and V tiles (float32, about one L1d) once each. Small steps run on the calling
thread (no dispatch). When a step has fewer than 2 x workers tasks (decode:
one query row per sequence), a task with at least 2 x MIN_SPLIT_KEYS keys is split by key
range. Default mode, four phases: K parts write their rows' scores into one buffer per task,
one item per task normalises each row over all its keys (the contract below, unchanged),
V parts accumulate P.V over their keys, and one item per task sums the parts in key order.
Online mode: parts keep (m, l, acc) and a merge phase combines them (flash-decoding).

Numerics, default (``online=False``; ggml's CPU non-flash path, which llama.cpp takes on
these files; the former single-threaded kernel, kept as cpu_layers.attention, states it in
scalar code): Q rounded to float16, K.Q in float32 in ggml's summation order (below),
scores = K.Q * scale, masked (causal, and the sliding window when ``window`` > 0), softmax
with the maximum taken over the scores (and the head's sink logit when ``sinks`` is given),
exponentials (Cephes' expf polynomial, ~1 ulp) summed in float64 (four partial sums, the
row's k-th key into sum k % 4, added as (s0 + s1) + (s2 + s3), then the last keys in order;
twice as fast as one chain, and float32(1 / sum) is the same as after a key-order sum unless
the two float64 sums straddle a float32 rounding boundary), scaled by
float32(1/sum), probabilities rounded to float16, then P.V in float32 in key order (fused
multiply-adds change nothing there: the product of two float16 values is exact in float32).
A task keeps its rows' scores (at most SCORE_BUDGET floats; long prefills get shorter query
tiles) between the pass over K and the pass over V.

K.Q summation order: as ggml on AVX-512, which llama.cpp's KQ matrix product takes: a step
of one token (decode; llama.cpp's mul_mat with n = 1 calls ggml_vec_dot_f16) sums element i
into lane i % 64 (four 16-lane accumulators), folds the lanes in halves (64 -> 32 -> ... -> 1)
and adds the dims past the last multiple of 64 in float64; a step of several tokens (prefill;
llamafile's tinyBLAS, used by ggml for n >= 2 when D % 16 == 0) sums into lane i % 16 and
folds those. Written in LLVM vector IR (:func:`_lane_dot`), so the dot products run in
vector lanes and still round exactly as ggml's do (the former strict key order could not
be vectorised; LLVM's own reassociation lost a decisive greedy step of the gpt-oss l3
golden). Against the scalar kernel: a score differs in its last bits now and then, which
moves a probability across a float16 rounding boundary (tests/moe_service/engine/test_attention.py
bounds it), plus, for a split decode, the order of the float32 additions of the parts' P.V,
plus the four float64 partial sums of the exponentials.
The goldens are unchanged and pass.

Online mode (``online=True``; flash attention, as ggml's CPU flash-attention path): one pass,
per row a running maximum m (float32), a running float64 sum l of exp(score - m) and a
float32 accumulator of exp(score - m) * V, both rescaled by exp(m_old - m_new) when a key
tile raises m; the sink joins m and l at the end; out = acc * float32(1 / l); probabilities
are not rounded to float16. Kept as an option, not the default: on the goldens it moved
tiny-llama-mxfp4 (a routing near-tie) to 4.24 against its bound of 4.0. It was ~20% faster
per (query row, key) on one thread (demo shapes, depth 4096: 11.5 vs 14.1 ns, loaded
machine), and its key-range split keeps every worker busy for one latent KV head.

Sliding window (llama.cpp ``LLAMA_SWA_TYPE_STANDARD``): a query at position p sees keys
at positions j with p - window < j <= p. Sinks (gpt-oss ``attn_sinks``): one logit per
query head that joins the softmax's denominator and contributes no value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir as _ir
from numba import carray, njit, types
from numba.core import cgutils as _cg
from numba.extending import intrinsic

from moe_service.engine import pool as _pool
from moe_service.engine import quant as _q
from moe_service.engine.cpu_layers import _f16_bits_to_f32, _f32_to_f16_bits
from moe_service.engine.quant import ir as _qir

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}
# No fastmath: every reduction's order is the one written (the score dot products' lanes are
# explicit vector IR, see _lane_dot); LLVM's reassociation once lost a decisive greedy step
# of tiny-gpt-oss-l3-pattern3-q8_0 against its llama.cpp golden.
_JIT_VEC = {"nogil": True, "cache": True, "error_model": "numpy", "fastmath": False}
_JIT_INLINE = {**_JIT_VEC, "inline": "always"}  # small per-key helpers: a call per key costs more than the work
# Vector width of the score kernels (prefill, decode, latent) and the P.V kernel: 16 float32
# lanes where the 512-bit kernels run (AVX-512 BW + VL + VNNI, quant.ir._AVX512), else 8. The sums are the same either way
# (each lane's order is fixed by the contract; the width only sets how many lanes one
# instruction holds).
_SCORE_LANES = 16 if _qir._AVX512 else 8
# A decode reads the float16 cache in place: one KV head's rows sit NKV x D x 2 bytes apart,
# a few rows per 4 KiB page, which the hardware prefetchers do not follow across pages. The
# score and P.V kernels prefetch the rows this many keys ahead.
_KV_PREFETCH_KEYS = 16
_KEYS_PER_PASS = 2  # keys per pass of _dot16_heads_keys (4 measured no faster with 16 lanes)

FMT_F16 = 0
FMT_Q8_0 = 1
Q8_0_BLOCK = 32  # values per block
Q8_0_BYTES = 34  # float16 scale + 32 int8

_view_u16 = _q._addr_view(types.uint16)
_view_f64 = _q._addr_view(types.float64)

# op array (int64) of one attend call: addresses, then dims. Offsets:
O_Q, O_KC, O_VC, O_OUT, O_TASKS, O_PML, O_PACC, O_SINKS = range(8)
O_NH, O_D, O_NKV, O_DV, O_GROUP, O_BK = range(8, 14)
O_KFMT, O_K_SEQ, O_K_POS, O_K_HEAD = range(14, 18)  # strides in cache elements (u16 or bytes)
O_VFMT, O_V_SEQ, O_V_POS, O_V_HEAD = range(18, 22)
O_SCALE, O_WINDOW, O_HAS_SINKS, O_RMAX, O_NTOK = range(22, 27)
O_SC, O_META = 27, 28  # exact split decode: scores buffer (float32), group table (int64 [*, META_W])
O_WIDE = 29  # 1: a one-token step (ggml_vec_dot_f16's 64-lane score order), 0: 16 lanes (tinyBLAS)
OP_LEN = 30
META_W = 8  # sc offset, L, j_start, h_lo, h_hi, first part task, n parts, partial-acc offset

# task rows (int64 [n, TASK_W]): seq, t_lo, t_hi (query rows of q), p0 (cache position of
# t_lo), g (KV head), k_lo, k_hi (key positions this task reads), part (-1: final result to
# out; else the partial-result slot).
TASK_W = 8


# ---------------------------------------------------------------------------------------
# Storing
# ---------------------------------------------------------------------------------------


@njit(**_JIT)
def _store_span(k, kc, seq, n0, a, e):
    """kc[seq, n0 + t - a] = float16(k[t]) for t in a..e-1 (k float32 [T, NKV, D'])."""
    for t in range(a, e):
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                kc[seq, n0 + t - a, h, i] = _f32_to_f16_bits(k[t, h, i])


@njit(**_JIT)
def quantize_row_q8_0(x, dst, off):
    """ggml's quantize_row_q8_0_ref: per block of 32, amax = max|x|, d = amax / 127,
    q = roundf(x / d) (as x * (1/d)), stored as float16(d) then 32 int8 at dst[off...].
    x: float32 [n] (n a multiple of 32); dst: uint8 [*]."""
    nb = x.shape[0] // Q8_0_BLOCK
    for b in range(nb):
        amax = np.float32(0.0)
        for i in range(Q8_0_BLOCK):
            v = abs(x[b * Q8_0_BLOCK + i])
            if v > amax:
                amax = v
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        hb = _f32_to_f16_bits(d)
        o = off + b * Q8_0_BYTES
        dst[o] = np.uint8(hb & 0xFF)
        dst[o + 1] = np.uint8(hb >> 8)
        for i in range(Q8_0_BLOCK):
            v = x[b * Q8_0_BLOCK + i] * inv
            r = np.float32(np.floor(abs(v) + np.float32(0.5)))  # roundf: half away from zero
            qv = np.int64(r) if v >= 0 else -np.int64(r)
            dst[o + 2 + i] = np.uint8(qv & 0xFF)


@njit(**_JIT)
def _store_span_q8_0(k, kc, seq, n0, a, e):
    """Q8_0 rows: kc uint8 [S, C, NKV, D/32*34] <- k float32 [T, NKV, D]."""
    flat = kc.reshape(-1)
    nkv, rb = kc.shape[2], kc.shape[3]
    row = np.empty(k.shape[2], np.float32)
    for t in range(a, e):
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                row[i] = k[t, h, i]
            base = ((seq * kc.shape[1] + n0 + t - a) * nkv + h) * rb
            quantize_row_q8_0(row, flat, base)


def cache_format(c: np.ndarray) -> int:
    """FMT_F16 for a uint16 cache, FMT_Q8_0 for a uint8 one; ValueError otherwise."""
    if c.dtype == np.uint16:
        return FMT_F16
    if c.dtype == np.uint8:
        return FMT_Q8_0
    raise ValueError(f"attention: cache dtype {c.dtype} is neither float16 bits (uint16) nor q8_0 bytes (uint8)")


def cache_head_dim(c: np.ndarray) -> int:
    """Values per head row of a cache of either format."""
    return c.shape[3] if c.dtype == np.uint16 else c.shape[3] // Q8_0_BYTES * Q8_0_BLOCK


def store(kc: np.ndarray, vc: np.ndarray, k: np.ndarray, v: np.ndarray | None, spans) -> None:
    """Append the step's new keys and values to the layer's caches (in their format).

    k: float32 [T, NKV, D]; v: float32 [T, NKV, Dv], or None when ``vc is kc`` (latent
    cache: the value is the key's first Dv dims). Raises ValueError when v is missing for a
    separate value cache, or a span would write past the cache.
    """
    if v is None and vc is not kc:
        raise ValueError("attention.store: v is None but the value cache is separate from the key cache")
    k = np.ascontiguousarray(k, dtype=np.float32)
    vv = None if vc is kc else np.ascontiguousarray(v, dtype=np.float32)
    for seq, a, e, n0 in spans:
        if n0 + (e - a) > kc.shape[1] or not 0 <= seq < kc.shape[0]:
            raise ValueError(f"attention.store: sequence {seq} rows {n0}..{n0 + e - a} outside the cache {kc.shape}")
        for src, c in ((k, kc),) if vv is None else ((k, kc), (vv, vc)):
            if c.dtype == np.uint16:
                _store_span(src, c, seq, n0, a, e)
            else:
                _store_span_q8_0(src, c, seq, n0, a, e)


# ---------------------------------------------------------------------------------------
# The task kernel
# ---------------------------------------------------------------------------------------


# The hot helpers index flat arrays through quant.ld/st (no wraparound of negative indices):
# numba's checked indexing with run-time trip counts keeps LLVM from vectorising the loops
# (measured 8x slower per key).


@njit(**_JIT_VEC)
def _load_rows(addr, fmt, base, stride, n_rows, n_dim, dst):
    """dst[r * n_dim + i] = float32 of element i of the cache row at ``base + r * stride``
    (r < n_rows). f16: elements are uint16; q8_0: elements are bytes, a row is n_dim/32
    blocks. dst: float32 [>= n_rows * n_dim] (flat)."""
    if fmt == FMT_F16:
        src = _view_u16(addr, 1)
        for r in range(n_rows):
            o = base + r * stride
            od = r * n_dim
            for i in range(n_dim):
                _q.st(dst, od + i, _f16_bits_to_f32(_q.ld(src, o + i)))
    else:
        src8 = _q.view_u8(addr, 1)
        srci = _q.view_i8(addr, 1)
        for r in range(n_rows):
            o = base + r * stride
            for b in range(n_dim // Q8_0_BLOCK):
                ob = o + b * Q8_0_BYTES
                d = _f16_bits_to_f32(np.uint16(_q.ld(src8, ob)) | (np.uint16(_q.ld(src8, ob + 1)) << np.uint16(8)))
                od = r * n_dim + b * Q8_0_BLOCK
                for i in range(Q8_0_BLOCK):
                    _q.st(dst, od + i, d * np.float32(_q.ld(srci, ob + 2 + i)))


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


@njit(**_JIT_INLINE)
def _scale_max(s, a, b, scale, mx):
    """s[j] = s[j] * scale for j in a..b-1 (raw dot products to scores); returns the largest
    of mx and those scores."""
    for j in range(a, b):
        v = _q.ld(s, j) * scale
        _q.st(s, j, v)
        mx = max(mx, v)
    return mx


@njit(**_JIT_INLINE)
def _finish_rows(qb, qo, nrows, d, kb, k0, kstride, s, so, L, ja, jdone, jb, scale, mrow, r0):
    """After a several-rows kernel left the raw dot products of keys ja..jdone-1 for rows
    r < nrows (query qb[qo + r * d], scores s[so + r * L + j]): scale them, score keys
    jdone..jb-1 one by one (:func:`_score_keys`, 64 lanes), raise mrow[r0 + r] to each row's
    maximum."""
    for r in range(nrows):
        o = so + r * L
        mx = _scale_max(s, o + ja, o + jdone, scale, mrow[r0 + r])
        if jdone < jb:
            mx = max(mx, _score_keys(qb, qo + r * d, kb, k0, kstride, s, o, jdone, jb, d, scale, True))
        mrow[r0 + r] = mx


@njit(**_JIT_INLINE)
def _score_heads_wide16(qb, qo, gh, kb, k0, kstride, s, so, L, ja, jb, d, scale, mrow, r0):
    """:func:`_score_keys_wide16` for the ``gh`` query rows qb[qo + r * d] (r < gh) of one KV
    head, whose scores go to s[so + r * L + j]: the same scores, each key read and widened once
    for up to four rows; mrow[r0 + r] raised to each row's maximum. D = 64 or 128."""
    nb = d // 64
    hb = 4 if nb == 1 else 2  # rows per key read: measured best (D = 64: 3.7 ns per (row, key); 128: 6.0)
    h0 = 0
    while h0 < gh:
        hn = min(hb, gh - h0)
        qh = qo + h0 * d
        sh = so + h0 * L
        j = ja
        while j + 8 <= jb:
            ko = k0 + j * kstride
            if nb == 1:
                if hn == 4:
                    _dot64_heads_keys8(qb, qh, d, 4, kb, ko, kstride, 1, s, sh + j, L)
                elif hn == 3:
                    _dot64_heads_keys8(qb, qh, d, 3, kb, ko, kstride, 1, s, sh + j, L)
                elif hn == 2:
                    _dot64_heads_keys8(qb, qh, d, 2, kb, ko, kstride, 1, s, sh + j, L)
                else:
                    _dot64_heads_keys8(qb, qh, d, 1, kb, ko, kstride, 1, s, sh + j, L)
            else:
                if hn == 4:
                    _dot64_heads_keys8(qb, qh, d, 4, kb, ko, kstride, 2, s, sh + j, L)
                elif hn == 3:
                    _dot64_heads_keys8(qb, qh, d, 3, kb, ko, kstride, 2, s, sh + j, L)
                elif hn == 2:
                    _dot64_heads_keys8(qb, qh, d, 2, kb, ko, kstride, 2, s, sh + j, L)
                else:
                    _dot64_heads_keys8(qb, qh, d, 1, kb, ko, kstride, 2, s, sh + j, L)
            j += 8
        _finish_rows(qb, qh, hn, d, kb, k0, kstride, s, sh, L, ja, j, jb, scale, mrow, r0 + h0)
        h0 += hn


@njit(**_JIT_INLINE)
def _pv_heads_f16(acc, ao, gh, p, po, L, vb, vo, vstride, ja, jb, dv):
    """:func:`_pv_exact` for the ``gh`` rows of one KV head (acc rows ao + r * dv, probabilities
    at p[po + r * L + j]) over a float16 cache read in place (uint16) or a widened float32
    tile, Dv a multiple of 16: the same sums, each value row loaded once per four rows."""
    h0 = 0
    while h0 < gh:
        hn = min(4, gh - h0)
        a, q = ao + h0 * dv, po + h0 * L
        if hn == 4:
            _pv_heads16(acc, a, dv, 4, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
        elif hn == 3:
            _pv_heads16(acc, a, dv, 3, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
        elif hn == 2:
            if dv % 32 == 0:
                _pv_heads16(acc, a, dv, 2, p, q, L, vb, vo, vstride, ja, jb, dv, 4)
            else:
                _pv_heads16(acc, a, dv, 2, p, q, L, vb, vo, vstride, ja, jb, dv, 2)
        else:  # one row: the row-at-a-time kernel is as fast
            _pv_exact(acc, a, p, q, vb, vo, vstride, ja, jb, dv)
        h0 += hn


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


@njit(**_JIT_INLINE)
def _score_latent(qb, qo, gh, kb, k0, kstride, s, so, L, ja, jb, d, scale, mrow, r0, tile):
    """:func:`_score_keys_wide16` for the ``gh`` query rows qb[qo + r * d] of a latent (MLA)
    cache, D = 576 (kv_lora_rank 512 + 64 rope dims): the same scores. Every key is widened
    to float32 once (eight at a time into ``tile``, float32 [>= 8 * D]) for all the rows, instead of
    once per row (one vcvtph2ps per eight dims per row was the bound); then eight keys per
    :func:`_dot64_tile_keys8`. mrow[r0 + r] raised to each row's maximum."""
    n = jb - ja
    n8 = n - n % 8
    for j in range(0, n8, 8):  # eight keys at a time: their float32 tile (18 KiB) stays in L1d for every row
        _load_rows(kb.ctypes.data, FMT_F16, k0 + (ja + j) * kstride, kstride, 8, d, tile)
        for r in range(gh):
            _dot64_tile_keys8(qb, qo + r * d, tile, 0, d, 9, s, so + r * L + ja + j)
    _finish_rows(qb, qo, gh, d, kb, k0, kstride, s, so, L, ja, ja + n8, jb, scale, mrow, r0)


@njit(**_JIT_INLINE)
def _score_keys_wide16(qb, qo, kb, k0, kstride, s, so, ja, jb, d, scale):
    """:func:`_score_keys` of a one-token step over a float16 cache read in place, D a
    multiple of 64: eight keys per :func:`_dot64_keys8` (the same scores; a zero may change
    sign), the rest one by one."""
    mx = np.float32(-np.inf)
    j = ja
    while j + 8 <= jb:
        if d == 64:  # one block (a literal: no block loop)
            _dot64_keys8(qb, qo, kb, k0 + j * kstride, kstride, 1, s, so + j)
        else:
            _dot64_keys8(qb, qo, kb, k0 + j * kstride, kstride, d // 64, s, so + j)
        mx = _scale_max(s, so + j, so + j + 8, scale, mx)
        j += 8
    if j < jb:
        mx = max(mx, _score_keys(qb, qo, kb, k0, kstride, s, so, j, jb, d, scale, True))
    return mx


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


@njit(**_JIT_INLINE)
def _dot(qb, qo, kb, ko, d, wide):
    """The score dot product q . k of one query row and one key (module docstring: ggml's
    order). wide (a one-token step, as llama.cpp's decode): ggml_vec_dot_f16, 64 lanes over
    the first d - d % 64 dims, the rest added in float64 in order, rounded to float32 once;
    otherwise (prefill, as llama.cpp's tinyBLAS for n_tokens >= 2; d a multiple of 16): 16
    lanes."""
    if wide:
        n = d - d % 64
        acc = np.float64(_dot64(qb, qo, kb, ko, n // 64))
        for i in range(n, d):
            acc += np.float64(_q.ld(qb, qo + i) * _ld_f32(kb, ko + i))
        return np.float32(acc)
    return _dot16(qb, qo, kb, ko, d // 16)


@njit(**_JIT_INLINE)
def _score_keys(qb, qo, kb, k0, kstride, s, so, ja, jb, d, scale, wide):
    """s[so + j] = (q . key j) * scale for keys ja..jb-1, key j at kb[k0 + j * kstride] (the
    float16 cache read in place, or a float32 tile); returns the largest."""
    mx = np.float32(-np.inf)
    for j in range(ja, jb):
        v = _dot(qb, qo, kb, k0 + j * kstride, d, wide) * scale
        _q.st(s, so + j, v)
        mx = max(mx, v)
    return mx


@njit(**_JIT_INLINE)
def _score_keys4(qb, qo, d, kb, k0, kstride, s, so, L, ja, jb, scale, mrow, r0, nr):
    """:func:`_score_keys` (16 lanes, D a multiple of 16) for the ``nr`` (2 to 4) query rows at
    qb[qo], qb[qo + d], ... whose scores go to s[so + j], s[so + L + j], ...: each key read
    once for the rows (D = 64 or 128: 16 keys per :func:`_dot16_heads_keys` call, the rest
    one by one, :func:`_dot16_rows`); mrow[r0 .. r0 + nr - 1] raised to the rows' maxima."""
    j16 = ja
    if d == 128 or d == 64:
        while j16 + 16 <= jb:  # (16 keys per call: 5% faster than 8 at D = 128; 32 slower)
            ko = k0 + j16 * kstride
            if d == 128:
                if nr == 4:
                    _dot16_heads_keys(qb, qo, d, 4, kb, ko, kstride, 8, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                elif nr == 3:
                    _dot16_heads_keys(qb, qo, d, 3, kb, ko, kstride, 8, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                else:
                    _dot16_heads_keys(qb, qo, d, 2, kb, ko, kstride, 8, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            else:
                if nr == 4:
                    _dot16_heads_keys(qb, qo, d, 4, kb, ko, kstride, 4, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                elif nr == 3:
                    _dot16_heads_keys(qb, qo, d, 3, kb, ko, kstride, 4, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
                else:
                    _dot16_heads_keys(qb, qo, d, 2, kb, ko, kstride, 4, s, so + j16, L, 16, _KEYS_PER_PASS, scale, mrow, r0)
            j16 += 16
    for j in range(j16, jb):
        if nr == 4:
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 4)
        elif nr == 3:
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 3)
        else:
            _dot16_rows(qb, qo, d, kb, k0 + j * kstride, d // 16, s, so + j, L, 2)
    for r in range(nr):  # (the eight-key kernel scaled its keys and raised mrow itself)
        mrow[r0 + r] = _scale_max(s, so + r * L + j16, so + r * L + jb, scale, mrow[r0 + r])


@njit(**_JIT_INLINE)
def _row_keys(p, window, j0, j1):
    """Keys j0 <= j < j1 that a query at position p sees: (jlo, jhi) (causal, window)."""
    jlo = j0
    if window > 0 and p - window + 1 > jlo:
        jlo = p - window + 1
    return jlo, min(j1, p + 1)


_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)


@njit(**_JIT_VEC)
def _exp_shifted(s, ja, jb, mx):
    """s[j] = exp(s[j] - mx) for j in ja..jb-1 (every s[j] <= mx), returns their sum in float64:
    four partial sums (s[ja + k] into sum k % 4; one float64 chain of additions costs a
    nanosecond per key), added (s0 + s1) + (s2 + s3), then the last jb - ja mod 4 in order.

    Cephes' expf (range reduction by ln2 in two parts, degree-5 polynomial, 2^n from the
    exponent bits; ~1 ulp), written as a plain loop so it runs in vector lanes (libm's expf
    is one call per element). Arguments below -87.3 give exp(-87.3) ~ 1e-38 instead of 0."""
    total = 0.0
    for j in range(ja, jb):
        x = max(_q.ld(s, j) - mx, np.float32(-87.3))
        n = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - n * _LN2_HI - n * _LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * r * r + r + np.float32(1.0)
        _q.st(s, j, p * _q.bits_f32((np.int32(n) + np.int32(127)) << np.int32(23)))
    t1 = 0.0
    t2 = 0.0
    t3 = 0.0
    j = ja
    while j + 4 <= jb:  # four float64 partial sums (key j into sum j % 4), apart from the loop above
        total += np.float64(_q.ld(s, j))
        t1 += np.float64(_q.ld(s, j + 1))
        t2 += np.float64(_q.ld(s, j + 2))
        t3 += np.float64(_q.ld(s, j + 3))
        j += 4
    total = (total + t1) + (t2 + t3)
    while j < jb:
        total += np.float64(_q.ld(s, j))
        j += 1
    return total


@njit(**_JIT_VEC)
def _pv(acc, ao, s, vt, ja, jb, dv):
    """acc[ao:ao+dv] += sum_j s[j] * vt[j*dv:(j+1)*dv] for j in ja..jb-1 (four keys per pass
    over the accumulator)."""
    j = ja
    while j + 4 <= jb:
        p0 = _q.ld(s, j)
        p1 = _q.ld(s, j + 1)
        p2 = _q.ld(s, j + 2)
        p3 = _q.ld(s, j + 3)
        v0 = j * dv
        for i in range(dv):
            _q.st(acc, ao + i, _q.ld(acc, ao + i) + (p0 * _q.ld(vt, v0 + i) + p1 * _q.ld(vt, v0 + dv + i)
                                                     + p2 * _q.ld(vt, v0 + 2 * dv + i)
                                                     + p3 * _q.ld(vt, v0 + 3 * dv + i)))
        j += 4
    while j < jb:
        pj = _q.ld(s, j)
        vo = j * dv
        for i in range(dv):
            _q.st(acc, ao + i, _q.ld(acc, ao + i) + pj * _q.ld(vt, vo + i))
        j += 1


@njit(**_JIT_VEC)
def _scale_row(acc, ao, f, n):
    for i in range(n):
        _q.st(acc, ao + i, _q.ld(acc, ao + i) * f)


@njit(**_JIT_VEC)
def run_task(op, tasks, ti, pml, pacc):
    """Task ``ti``: its query rows of every head of KV head g over keys k_lo..k_hi-1 (masked
    per row: causal and window), online softmax; the normalised result into out (part < 0)
    or (m, l, acc) into partial slot ``part`` of pml float64 [*, RMAX, 2] / pacc float32
    [*, RMAX, Dv] (flat)."""
    nh, d, dv, group, bk = op[O_NH], op[O_D], op[O_DV], op[O_GROUP], op[O_BK]
    ntok = op[O_NTOK]
    tb = ti * TASK_W
    seq, t_lo, t_hi, p0 = tasks[tb], tasks[tb + 1], tasks[tb + 2], tasks[tb + 3]
    g, k_lo, k_hi, part = tasks[tb + 4], tasks[tb + 5], tasks[tb + 6], tasks[tb + 7]
    scale = _q.view_f32(op.ctypes.data + 8 * O_SCALE, 1)[0]
    window = op[O_WINDOW]
    nq = t_hi - t_lo
    R = nq * group
    qb = _gather_q(op, t_lo, nq, g, 0, group)
    m = np.full(R, -np.inf, np.float32)
    lsum = np.zeros(R, np.float64)
    acc = np.zeros(R * dv, np.float32)
    kt = np.empty(bk * d, np.float32)
    vt = np.empty(bk * dv, np.float32)
    s = np.empty(bk, np.float32)
    p_last = p0 + nq - 1
    j_end = min(k_hi, p_last + 1)
    j_start = k_lo
    if window > 0:
        j_start = max(k_lo, p0 - window + 1)
    kfmt, kseq, kpos, khead = op[O_KFMT], op[O_K_SEQ], op[O_K_POS], op[O_K_HEAD]
    vfmt, vseq, vpos, vhead = op[O_VFMT], op[O_V_SEQ], op[O_V_POS], op[O_V_HEAD]
    wide = op[O_WIDE] != 0
    for j0 in range(j_start, j_end, bk):
        nb = min(bk, j_end - j0)
        _load_rows(op[O_KC], kfmt, seq * kseq + j0 * kpos + g * khead, kpos, nb, d, kt)
        _load_rows(op[O_VC], vfmt, seq * vseq + j0 * vpos + g * vhead, vpos, nb, dv, vt)
        for tt in range(nq):
            jlo, jhi = _row_keys(p0 + tt, window, j0, j0 + nb)
            if jhi <= jlo:
                continue
            ja, jb = jlo - j0, jhi - j0
            for hh in range(group):
                r = tt * group + hh
                mx = max(m[r], _score_keys(qb, r * d, kt, 0, d, s, 0, ja, jb, d, scale, wide))
                if mx > m[r]:
                    if m[r] > -np.inf:
                        f = np.exp(m[r] - mx)
                        lsum[r] *= np.float64(f)
                        _scale_row(acc, r * dv, f, dv)
                    m[r] = mx
                lsum[r] += _exp_shifted(s, ja, jb, mx)
                _pv(acc, r * dv, s, vt, ja, jb, dv)
    if part < 0:
        out = _q.view_f32(op[O_OUT], ntok * nh * dv)
        sinks = _q.view_f32(op[O_SINKS], nh)
        for tt in range(nq):
            for hh in range(group):
                r = tt * group + hh
                h = g * group + hh
                _finish_row(out, ((t_lo + tt) * nh + h) * dv, acc, r * dv, m[r], lsum[r], dv,
                            op[O_HAS_SINKS] != 0, sinks[h])
    else:
        rmax = op[O_RMAX]
        for r in range(R):
            pml[(part * rmax + r) * 2] = m[r]
            pml[(part * rmax + r) * 2 + 1] = lsum[r]
            o = (part * rmax + r) * dv
            for i in range(dv):
                pacc[o + i] = acc[r * dv + i]


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def _pv_exact(acc, ao, p, po, vb, vo, vstride, ja, jb, dv):
    """acc[ao:ao+dv] += p[po + j] * v_j for j in ja..jb-1 in key order, v_j the Dv values at
    vb[vo + j * vstride] (a float16 cache read in place as uint16, or a float32 tile), in
    vector lanes over the value dims. Fused multiply-adds allowed: p and a float16 cache's v
    are float16 values, whose product is exact in float32, so the rounding is the scalar
    reference's (measured: P.V 10.6 -> 4.3 ns per (row, key) at Dv = 128)."""
    j = ja
    while j + 4 <= jb:  # four keys per pass over the accumulator, the additions still in key order
        p0 = _q.ld(p, po + j)
        p1 = _q.ld(p, po + j + 1)
        p2 = _q.ld(p, po + j + 2)
        p3 = _q.ld(p, po + j + 3)
        v0 = vo + j * vstride
        for i in range(dv):
            a = _q.ld(acc, ao + i) + p0 * _ld_f32(vb, v0 + i)
            a = a + p1 * _ld_f32(vb, v0 + vstride + i)
            a = a + p2 * _ld_f32(vb, v0 + 2 * vstride + i)
            _q.st(acc, ao + i, a + p3 * _ld_f32(vb, v0 + 3 * vstride + i))
        j += 4
    while j < jb:
        pj = _q.ld(p, po + j)
        v0 = vo + j * vstride
        for i in range(dv):
            _q.st(acc, ao + i, _q.ld(acc, ao + i) + pj * _ld_f32(vb, v0 + i))
        j += 1


@njit(**_JIT_VEC)
def _normalise_f16(sc, a, b, inv):
    """sc[j] = float16(sc[j] * inv) (as float32) for j in a..b-1."""
    for j in range(a, b):
        _q.st(sc, j, _f16_bits_to_f32(_f32_to_f16_bits(_q.ld(sc, j) * inv)))


@njit(**_JIT_VEC)
def _gather_q(op, t_lo, nq, g, h_lo, gh):
    """The query rows of tokens t_lo..t_lo+nq-1 x heads h_lo..h_lo+gh-1 of KV head g's group,
    rounded to float16 (as float32): float32 [nq * gh * D], row r = tt * gh + hh."""
    nh, d, group = op[O_NH], op[O_D], op[O_GROUP]
    q = _q.view_f32(op[O_Q], op[O_NTOK] * nh * d)
    qb = np.empty(nq * gh * d, np.float32)
    for tt in range(nq):
        for hh in range(gh):
            qo = ((t_lo + tt) * nh + g * group + h_lo + hh) * d
            for i in range(d):
                qb[(tt * gh + hh) * d + i] = _f16_bits_to_f32(_f32_to_f16_bits(q[qo + i]))
    return qb


@njit(**_JIT_VEC)
def _tile_pass(op, values, qb, seq, p0, nq, gh, g, kp_lo, kp_hi, sc, so, L, mrow, acc, ao):
    """One pass of the two-pass contract over keys kp_lo..kp_hi-1, key tile by key tile (a
    tile serves every row), each row masked (causal, window); rows r = tt * gh + hh, their
    values at sc[so + r * L + j] (so already minus the row's first key).

    values False (the K pass): sc = (q_r . k_j) * scale for the query rows in qb, mrow[r]
    raised to the row's maximum. values True (the V pass): acc[ao + r * Dv ...] += the
    probabilities in sc times V in key order. A float16 cache is read in place; a Q8_0 cache
    is widened to a float32 tile first."""
    bk, window, d = op[O_BK], op[O_WINDOW], op[O_D]
    if values:
        n_dim, fmt, pos, addr = op[O_DV], op[O_VFMT], op[O_V_POS], op[O_VC]
        base = seq * op[O_V_SEQ] + g * op[O_V_HEAD]
    else:
        n_dim, fmt, pos, addr = d, op[O_KFMT], op[O_K_POS], op[O_KC]
        base = seq * op[O_K_SEQ] + g * op[O_K_HEAD]
    scale = _q.view_f32(op.ctypes.data + 8 * O_SCALE, 1)[0]
    wide = op[O_WIDE] != 0
    c16 = _view_u16(addr, 1)
    # A prefill widens each key tile once into a contiguous float32 tile that all its rows
    # read. Read in place, one KV head's rows sit NKV x D x 2 bytes apart, so a tile's lines
    # share few L1 sets with the query rows and scores. Measured on Qwen3-30B-A3B shapes (32
    # heads, 4 KV heads, D = 128), 128 new tokens at depth 3968, two threads: 9.2 -> 8.8 ns
    # per (head, key) for the whole attend call. A Q8_0 cache is always widened.
    tiled = fmt != FMT_F16 or not wide
    tile = np.empty(bk * n_dim if tiled else 1, np.float32)
    ltile = np.empty(8 * n_dim if (fmt == FMT_F16 and not values and wide and n_dim == 576) else 1, np.float32)
    for j0 in range(kp_lo, kp_hi, bk):
        nb = min(bk, kp_hi - j0)
        if tiled:
            _load_rows(addr, fmt, base + j0 * pos, pos, nb, n_dim, tile)
        for tt in range(nq):
            jlo, jhi = _row_keys(p0 + tt, window, j0, j0 + nb)
            if jhi <= jlo:
                continue
            hh0 = 0
            if not values and not wide and d % 16 == 0:  # prefill: two to four heads of the token per K read
                while hh0 + 2 <= gh:
                    r = tt * gh + hh0
                    nr = min(4, gh - hh0)
                    _score_keys4(qb, r * d, d, tile, -j0 * d, d, sc, so + r * L, L, jlo, jhi, scale, mrow, r, nr)
                    hh0 += nr
            elif not values and wide and fmt == FMT_F16 and gh >= 8 and d == 576:  # a latent cache: K widened once
                r = tt * gh
                _score_latent(qb, r * d, gh, c16, base, pos, sc, so + r * L, L, jlo, jhi, d, scale, mrow, r, ltile)
                hh0 = gh
            elif not values and wide and fmt == FMT_F16 and gh > 1 and (d == 64 or d == 128):  # the group's heads per K read
                r = tt * gh
                _score_heads_wide16(qb, r * d, gh, c16, base, pos, sc, so + r * L, L, jlo, jhi, d, scale, mrow, r)
                hh0 = gh
            elif values and fmt == FMT_F16 and n_dim % 16 == 0:  # the token's heads per V read
                r = tt * gh
                if tiled:
                    _pv_heads_f16(acc, ao + r * n_dim, gh, sc, so + r * L, L, tile, -j0 * n_dim, n_dim, jlo, jhi, n_dim)
                else:
                    _pv_heads_f16(acc, ao + r * n_dim, gh, sc, so + r * L, L, c16, base, pos, jlo, jhi, n_dim)
                hh0 = gh
            for hh in range(hh0, gh):
                r = tt * gh + hh
                if values and not tiled:
                    _pv_exact(acc, ao + r * n_dim, sc, so + r * L, c16, base, pos, jlo, jhi, n_dim)
                elif values:
                    _pv_exact(acc, ao + r * n_dim, sc, so + r * L, tile, -j0 * n_dim, n_dim, jlo, jhi, n_dim)
                else:
                    if not tiled and d % 64 == 0:
                        mx = _score_keys_wide16(qb, r * d, c16, base, pos, sc, so + r * L, jlo, jhi, d, scale)
                    elif not tiled:
                        mx = _score_keys(qb, r * d, c16, base, pos, sc, so + r * L, jlo, jhi, d, scale, wide)
                    else:
                        mx = _score_keys(qb, r * d, tile, -j0 * d, d, sc, so + r * L, jlo, jhi, d, scale, wide)
                    if mx > mrow[r]:
                        mrow[r] = mx


@njit(**_JIT_VEC)
def _softmax_rows(op, sc, so, L, j_start, p0, nq, gh, g, h_lo, mrow):
    """Per row r (token tt, head h_lo + hh of group g): the maximum (mrow[r], or the sink when
    larger), exp(score - max) summed in float64 (:func:`_exp_shifted`; plus the sink's term), and the
    probabilities float16(e * float32(1/sum)) in place over the row's keys."""
    nh, group, window = op[O_NH], op[O_GROUP], op[O_WINDOW]
    sinks = _q.view_f32(op[O_SINKS], nh)
    has_sinks = op[O_HAS_SINKS] != 0
    for tt in range(nq):
        p = p0 + tt
        lo, hi = _row_keys(p, window, j_start, p + 1)
        for hh in range(gh):
            r = tt * gh + hh
            mx = mrow[r]
            h = g * group + h_lo + hh
            if has_sinks and sinks[h] > mx:
                mx = sinks[h]
            a = so + r * L + lo - j_start
            b = so + r * L + hi - j_start
            total = _exp_shifted(sc, a, b, mx)
            if has_sinks:
                total += np.float64(np.exp(sinks[h] - mx))
            _normalise_f16(sc, a, b, np.float32(1.0 / total))


@njit(**_JIT_VEC)
def run_task_exact(op, tasks, ti):
    """Task ``ti`` with the two-pass softmax of the module docstring's contract: the scores of
    every key of the task's range for its R query rows (heads h_lo..h_hi-1 of the group) into
    a scratch [R, L] while streaming K once, then per row the maximum, the float64 sum of the
    exponentials and the float16-rounded probabilities, then P.V streaming V once."""
    nh, dv, group = op[O_NH], op[O_DV], op[O_GROUP]
    tb = ti * TASK_W
    seq, t_lo, t_hi, p0 = tasks[tb], tasks[tb + 1], tasks[tb + 2], tasks[tb + 3]
    g, h_lo, h_hi = tasks[tb + 4], tasks[tb + 5], tasks[tb + 6]
    nq = t_hi - t_lo
    gh = h_hi - h_lo
    R = nq * gh
    qb = _gather_q(op, t_lo, nq, g, h_lo, gh)
    j_end = p0 + nq
    j_start = max(0, p0 - op[O_WINDOW] + 1) if op[O_WINDOW] > 0 else 0
    L = j_end - j_start
    sc = np.empty(R * L, np.float32)
    mrow = np.full(R, -np.inf, np.float32)
    acc = np.zeros(R * dv, np.float32)
    _tile_pass(op, False, qb, seq, p0, nq, gh, g, j_start, j_end, sc, -j_start, L, mrow, acc, 0)
    _softmax_rows(op, sc, 0, L, j_start, p0, nq, gh, g, h_lo, mrow)
    _tile_pass(op, True, qb, seq, p0, nq, gh, g, j_start, j_end, sc, -j_start, L, mrow, acc, 0)
    out = _q.view_f32(op[O_OUT], op[O_NTOK] * nh * dv)
    for tt in range(nq):
        for hh in range(gh):
            r = tt * gh + hh
            o = ((t_lo + tt) * nh + g * group + h_lo + hh) * dv
            for i in range(dv):
                _q.st(out, o + i, acc[r * dv + i])


@njit(**_JIT_VEC)
def _part_rows(op, tasks, ti, meta):
    """(seq, t_lo, nq, p0, g, heads part gh, h_lo, key range, meta row) of split part ``ti``."""
    tb = ti * TASK_W
    mi = tasks[tb + 7]
    mb = mi * META_W
    return (tasks[tb], tasks[tb + 1], tasks[tb + 2] - tasks[tb + 1], tasks[tb + 3], tasks[tb + 4],
            meta[mb + 4] - meta[mb + 3], meta[mb + 3], tasks[tb + 5], tasks[tb + 6], mb)


@njit(**_JIT_VEC)
def run_part_k(op, tasks, ti, meta, sc):
    """Exact split, phase 0: the scores of keys kp_lo..kp_hi-1 for the group's rows into the
    group's scores buffer (as run_task_exact's first pass, over one key range)."""
    seq, t_lo, nq, p0, g, gh, h_lo, kp_lo, kp_hi, mb = _part_rows(op, tasks, ti, meta)
    qb = _gather_q(op, t_lo, nq, g, h_lo, gh)
    mrow = np.full(nq * gh, -np.inf, np.float32)
    _tile_pass(op, False, qb, seq, p0, nq, gh, g, kp_lo, kp_hi, sc, meta[mb] - meta[mb + 2], meta[mb + 1], mrow,
               mrow, 0)


@njit(**_JIT_VEC)
def run_norm(op, tasks, meta, mi, sc):
    """Exact split, phase 1: per row of group ``mi`` the maximum over all its keys (and the
    sink), the float64 sum of the exponentials (:func:`_exp_shifted`), float16 probabilities in place."""
    mb = mi * META_W
    ti = meta[mb + 5]
    tb = ti * TASK_W
    nq, p0, g = tasks[tb + 2] - tasks[tb + 1], tasks[tb + 3], tasks[tb + 4]
    sc_off, L, j_start, h_lo, gh = meta[mb], meta[mb + 1], meta[mb + 2], meta[mb + 3], meta[mb + 4] - meta[mb + 3]
    window = op[O_WINDOW]
    mrow = np.empty(nq * gh, np.float32)
    for tt in range(nq):
        lo, hi = _row_keys(p0 + tt, window, j_start, p0 + tt + 1)
        for hh in range(gh):
            r = tt * gh + hh
            mx = np.float32(-np.inf)
            for j in range(sc_off + r * L + lo - j_start, sc_off + r * L + hi - j_start):
                mx = max(mx, _q.ld(sc, j))
            mrow[r] = mx
    _softmax_rows(op, sc, sc_off, L, j_start, p0, nq, gh, g, h_lo, mrow)


@njit(**_JIT_VEC)
def run_part_v(op, tasks, ti, meta, sc, pacc):
    """Exact split, phase 2: P.V over keys kp_lo..kp_hi-1 into this part's partial rows."""
    seq, t_lo, nq, p0, g, gh, h_lo, kp_lo, kp_hi, mb = _part_rows(op, tasks, ti, meta)
    dv = op[O_DV]
    R = nq * gh
    ao = (meta[mb + 7] + (ti - meta[mb + 5]) * R) * dv  # meta[7]: the group's first partial row
    for i in range(R * dv):
        pacc[ao + i] = 0.0
    _tile_pass(op, True, pacc, seq, p0, nq, gh, g, kp_lo, kp_hi, sc, meta[mb] - meta[mb + 2], meta[mb + 1],
               pacc, pacc, ao)  # (qb and mrow unused by the V pass)


@njit(**_JIT_VEC)
def run_combine(op, tasks, meta, mi, pacc):
    """Exact split, phase 3: out = the parts' partial P.V summed in part (key) order."""
    mb = mi * META_W
    ti = meta[mb + 5]
    tb = ti * TASK_W
    t_lo, nq, g = tasks[tb + 1], tasks[tb + 2] - tasks[tb + 1], tasks[tb + 4]
    h_lo, gh, n_parts, acc0 = meta[mb + 3], meta[mb + 4] - meta[mb + 3], meta[mb + 6], meta[mb + 7]
    nh, dv, group = op[O_NH], op[O_DV], op[O_GROUP]
    R = nq * gh
    out = _q.view_f32(op[O_OUT], op[O_NTOK] * nh * dv)
    for tt in range(nq):
        for hh in range(gh):
            r = tt * gh + hh
            o = ((t_lo + tt) * nh + g * group + h_lo + hh) * dv
            for i in range(dv):
                a = _q.ld(pacc, (acc0 + r) * dv + i)
                for c in range(1, n_parts):
                    a += _q.ld(pacc, (acc0 + c * R + r) * dv + i)
                _q.st(out, o + i, a)


@njit(**_JIT_VEC)
def _finish_row(out, o, acc, ao, m, lsum, dv, has_sink, sink):
    """out[o:o+dv] = acc[r] / l, the sink logit joining the maximum and the sum first."""
    f = np.float32(1.0)
    if has_sink:
        mx = max(m, sink)
        f = np.exp(m - mx) if m > -np.inf else np.float32(0.0)
        lsum = lsum * np.float64(f) + np.float64(np.exp(sink - mx))
    inv = np.float32(1.0 / lsum) * f if lsum > 0 else np.float32(0.0)
    for i in range(dv):
        _q.st(out, o + i, _q.ld(acc, ao + i) * inv)


@njit(**_JIT_VEC)
def run_merge(op, tasks, first, n_parts, pml, pacc):
    """Combine the partial results of tasks first..first+n_parts-1 (same rows and head,
    consecutive key ranges) into out: M = max m_c, l = sum l_c exp(m_c - M), acc likewise."""
    nh, dv, group, rmax, ntok = op[O_NH], op[O_DV], op[O_GROUP], op[O_RMAX], op[O_NTOK]
    tb = first * TASK_W
    t_lo, t_hi, g = tasks[tb + 1], tasks[tb + 2], tasks[tb + 4]
    nq = t_hi - t_lo
    out = _q.view_f32(op[O_OUT], ntok * nh * dv)
    sinks = _q.view_f32(op[O_SINKS], nh)
    acc = np.zeros(dv, np.float32)
    for tt in range(nq):
        for hh in range(group):
            r = tt * group + hh
            mx = np.float32(-np.inf)
            for c in range(n_parts):
                part = tasks[(first + c) * TASK_W + 7]
                mc = np.float32(pml[(part * rmax + r) * 2])
                if mc > mx:
                    mx = mc
            lsum = 0.0
            for i in range(dv):
                acc[i] = 0.0
            for c in range(n_parts):
                part = tasks[(first + c) * TASK_W + 7]
                mc = np.float32(pml[(part * rmax + r) * 2])
                if mc == -np.inf:
                    continue
                f = np.exp(mc - mx)
                lsum += pml[(part * rmax + r) * 2 + 1] * np.float64(f)
                o = (part * rmax + r) * dv
                for i in range(dv):
                    _q.st(acc, i, _q.ld(acc, i) + _q.ld(pacc, o + i) * f)
            h = g * group + hh
            _finish_row(out, ((t_lo + tt) * nh + h) * dv, acc, 0, mx, lsum, dv, op[O_HAS_SINKS] != 0, sinks[h])


# Item fields: (K_CALL, fn address, kind, a, b): kind 0 = online task a; kind 1 = merge of
# online tasks a..a+b-1; kind 2 = exact (two-pass) task a; kinds 3-6 = the exact split
# decode's phases (K part a, normalise group a, V part a, combine group a).
def _item(items_ptr, i, op_ptr):
    """A K_CALL item (compiled as a cfunc of pool.CALL_ITEM_SIG by item_address)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, OP_LEN)
    b = i * _pool.ITEM_W
    tasks = _q.view_i64(op[O_TASKS], 1)
    pml = _view_f64(op[O_PML], 1)
    pacc = _q.view_f32(op[O_PACC], 1)
    kind = it[b + 2]
    if kind == 2:
        run_task_exact(op, tasks, it[b + 3])
    elif kind >= 3:
        meta = _q.view_i64(op[O_META], 1)
        sc = _q.view_f32(op[O_SC], 1)
        if kind == 3:
            run_part_k(op, tasks, it[b + 3], meta, sc)
        elif kind == 4:
            run_norm(op, tasks, meta, it[b + 3], sc)
        elif kind == 5:
            run_part_v(op, tasks, it[b + 3], meta, sc, pacc)
        else:
            run_combine(op, tasks, meta, it[b + 3], pacc)
    elif kind == 0:
        run_task(op, tasks, it[b + 3], pml, pacc)
    else:
        run_merge(op, tasks, it[b + 3], it[b + 4], pml, pacc)


def item_address() -> int:
    """Address of the compiled item function (pool.K_CALL), compiled or loaded once."""
    return _pool.call_item_address(_item)


@njit(**_JIT)
def _run_serial(op, tasks, n_tasks, pml, pacc, exact):
    """Every task on the calling thread (none split): small steps skip the pool dispatch."""
    for ti in range(n_tasks):
        if exact:
            run_task_exact(op, tasks, ti)
        else:
            run_task(op, tasks, ti, pml, pacc)


# ---------------------------------------------------------------------------------------
# Planning and the public call
# ---------------------------------------------------------------------------------------

QUERY_ROWS = 64
"""Query rows (query tokens x heads of one KV head) per prefill task: the tile that shares
each K and V tile read (64 rows x 128 dims of float32 accumulators = 32 KiB)."""
MIN_SPLIT_KEYS = 256
"""Fewest keys per part when a decode task's key range is split over workers."""
SERIAL_WORK = 8192
"""Below this many (query row x key) products the step runs on the calling thread."""


def _f32_bits(x: float) -> int:
    """The float32 bits of ``x`` as an int (stored in the op array, read back as float32)."""
    return int(np.float32(x).view(np.int32))


def key_tile(d: int, dv: int) -> int:
    """Keys per tile: K and V tiles of float32 together within ~32 KiB (L1d)."""
    return int(max(16, min(128, 8192 // max(1, d + dv) // 16 * 16)))


SCORE_BUDGET = 1 << 18
"""Most float32 scores one exact task holds (1 MiB): long prefills get shorter query tiles."""


def plan_tasks(spans, group: int, n_workers: int, window: int = 0, *, n_kv: int = 1):
    """The online mode's tiles, largest first: (cost, seq, t0, t1, p0, k_lo, k_hi, split).

    A span's queries are cut into tiles of QUERY_ROWS // group tokens; when the step has
    fewer than 2 x workers tiles over the ``n_kv`` KV heads, ``split`` > 1 says how many key
    ranges (at least MIN_SPLIT_KEYS keys each) to cut each tile into. (The default mode plans
    in compiled code: :func:`_plan_exact`.)"""
    base = []
    for seq, a, e, n0 in spans:
        tq = max(1, QUERY_ROWS // group)
        for t0 in range(a, e, tq):
            t1 = min(e, t0 + tq)
            p0 = n0 + t0 - a
            k_hi = p0 + (t1 - t0)
            k_lo = max(0, p0 - window + 1) if window > 0 else 0
            base.append((seq, t0, t1, p0, k_lo, k_hi))
    tasks = []
    for seq, t0, t1, p0, k_lo, k_hi in base:
        cost = (t1 - t0) * (k_hi - k_lo)
        split = 1
        if n_workers > 1 and len(base) * n_kv < 2 * n_workers:
            split = max(1, min((k_hi - k_lo) // MIN_SPLIT_KEYS, -(-2 * n_workers // (len(base) * n_kv))))
        tasks.append((cost, seq, t0, t1, p0, k_lo, k_hi, split))
    tasks.sort(key=lambda x: -x[0])
    return tasks


class _Plan:
    __slots__ = ("items", "bounds", "tasks", "pml", "pacc", "n_tasks", "serial")
    items: np.ndarray | None  # None when serial
    bounds: np.ndarray | None
    tasks: np.ndarray
    pml: np.ndarray
    pacc: np.ndarray
    n_tasks: int
    serial: bool


def _build(spans, nkv: int, group: int, dv: int, n_workers: int, window: int, rmax: int) -> _Plan:
    """The online mode's tasks, partial slots and job (whole tiles, then key parts and merges)."""
    base = plan_tasks(spans, group, n_workers, window, n_kv=nkv)
    rows: list[tuple] = []
    merges: list[tuple[int, int]] = []
    split_rows: list[tuple] = []
    n_parts = 0
    work = 0
    for cost, seq, t0, t1, p0, k_lo, k_hi, split in base:
        work += cost * group * nkv
        for g in range(nkv):
            if split <= 1:
                rows.append((seq, t0, t1, p0, g, k_lo, k_hi, -1))
            else:
                first = len(split_rows)
                n = k_hi - k_lo
                for c in range(split):
                    a = k_lo + n * c // split
                    b = k_lo + n * (c + 1) // split
                    split_rows.append((seq, t0, t1, p0, g, a, b, n_parts))
                    n_parts += 1
                merges.append((first, split))
    pl = _Plan()
    n_direct = len(rows)
    all_rows = rows + split_rows
    pl.tasks = np.ascontiguousarray(np.array(all_rows, dtype=np.int64).reshape(-1, TASK_W))
    pl.n_tasks = len(all_rows)
    pl.serial = not split_rows and (n_workers <= 1 or work < SERIAL_WORK)
    pl.pml = np.zeros(max(1, n_parts * rmax * 2), np.float64)
    pl.pacc = np.zeros(max(1, n_parts * rmax * dv), np.float32)
    if pl.serial:
        pl.items = pl.bounds = None
        return pl
    fn = item_address()
    it0 = [(_pool.K_CALL, fn, 0, i) for i in range(pl.n_tasks)]
    # split parts first (they gate the merge phase), then whole tasks largest first
    phase0 = it0[n_direct:] + it0[:n_direct]
    phase1 = [(_pool.K_CALL, fn, 1, n_direct + first, n) for first, n in merges]
    job = _pool.Job.build([[phase0], [phase1]] if phase1 else [[phase0]], np.zeros(1, np.int64))
    pl.items, pl.bounds = job.items, job.bounds
    return pl


@njit(**_JIT)
def _plan_exact(spans, group, nkv, n_workers, window, qrows, budget, min_keys):
    """The default mode's plan in one compiled call (the per-layer Python cost of a decode
    step matters). Tiles of (sequence, KV head, query tokens); when the step has fewer tiles
    than 2 x workers, a tile with at least 2 x ``min_keys`` keys is split by key range into
    parts (phases: K parts, normalise, V parts, combine).

    Returns (tasks int64 [m, TASK_W]: the whole tiles (largest first), then the parts;
    meta int64 [groups, META_W]; n_direct; work (query row x key products); scores floats;
    partial-accumulator rows x 1 (times Dv by the caller))."""
    n_sp = spans.shape[0]
    tqs = np.empty(n_sp, np.int64)
    ntile = 0
    for i in range(n_sp):
        a, e, n0 = spans[i, 1], spans[i, 2], spans[i, 3]
        k_lo0 = max(0, n0 - window + 1) if window > 0 else 0
        tq = max(1, qrows // group)
        tq = max(1, min(tq, budget // (group * max(1, n0 + e - a - k_lo0))))
        tqs[i] = tq
        ntile += (e - a + tq - 1) // tq
    want = 0
    if n_workers > 1 and ntile * nkv < 2 * n_workers:
        want = (2 * n_workers + ntile * nkv - 1) // (ntile * nkv)
    cap = ntile * nkv * max(1, want)
    tasks = np.empty((cap, TASK_W), np.int64)
    parts = np.empty((cap, TASK_W), np.int64)
    meta = np.empty((ntile * nkv, META_W), np.int64)
    cost = np.empty(cap, np.int64)
    n_direct = 0
    n_parts = 0
    n_groups = 0
    sc_size = 0
    acc_rows = 0
    work = 0
    for i in range(n_sp):
        seq, a, e, n0 = spans[i, 0], spans[i, 1], spans[i, 2], spans[i, 3]
        tq = tqs[i]
        for t0 in range(a, e, tq):
            t1 = min(e, t0 + tq)
            p0 = n0 + t0 - a
            k_hi = p0 + (t1 - t0)
            k_lo = max(0, p0 - window + 1) if window > 0 else 0
            L = k_hi - k_lo
            c = (t1 - t0) * L
            work += c * group * nkv
            split = min(want, L // min_keys) if want > 1 else 1
            for g in range(nkv):
                if split < 2:
                    tasks[n_direct, 0] = seq
                    tasks[n_direct, 1] = t0
                    tasks[n_direct, 2] = t1
                    tasks[n_direct, 3] = p0
                    tasks[n_direct, 4] = g
                    tasks[n_direct, 5] = 0
                    tasks[n_direct, 6] = group
                    tasks[n_direct, 7] = 0
                    cost[n_direct] = c * group
                    n_direct += 1
                    continue
                R = (t1 - t0) * group
                mi = n_groups
                meta[mi, 0] = sc_size
                meta[mi, 1] = L
                meta[mi, 2] = k_lo
                meta[mi, 3] = 0
                meta[mi, 4] = group
                meta[mi, 5] = n_parts  # relative to the parts block; fixed up by the caller
                meta[mi, 6] = split
                meta[mi, 7] = acc_rows
                sc_size += R * L
                acc_rows += split * R
                for cc in range(split):
                    parts[n_parts, 0] = seq
                    parts[n_parts, 1] = t0
                    parts[n_parts, 2] = t1
                    parts[n_parts, 3] = p0
                    parts[n_parts, 4] = g
                    parts[n_parts, 5] = k_lo + L * cc // split
                    parts[n_parts, 6] = k_lo + L * (cc + 1) // split
                    parts[n_parts, 7] = mi
                    n_parts += 1
                n_groups += 1
    order = np.argsort(-cost[:n_direct], kind="mergesort")
    out = np.empty((n_direct + n_parts, TASK_W), np.int64)
    for k in range(n_direct):
        out[k] = tasks[order[k]]
    for k in range(n_parts):
        out[n_direct + k] = parts[k]
    for mi in range(n_groups):
        meta[mi, 5] += n_direct
    return out, meta[:n_groups].copy(), n_direct, work, sc_size, acc_rows


@njit(**_JIT)
def _first_bad_span(sp, n_tok, n_seq, n_ctx):
    """Index of the first span (seq, a, e, n0) outside q's rows or the cache, else -1."""
    for i in range(sp.shape[0]):
        seq, a, e, n0 = sp[i, 0], sp[i, 1], sp[i, 2], sp[i, 3]
        if seq < 0 or seq >= n_seq or a < 0 or e <= a or e > n_tok or n0 < 0 or n0 + e - a > n_ctx:
            return i
    return -1


@njit(**_JIT)
def _fill_addresses(op, q, kc, vc, out, tasks, pml, pacc, sinks, sc, meta):
    op[O_SC] = sc.ctypes.data
    op[O_META] = meta.ctypes.data
    op[O_Q] = q.ctypes.data
    op[O_KC] = kc.ctypes.data
    op[O_VC] = vc.ctypes.data
    op[O_OUT] = out.ctypes.data
    op[O_TASKS] = tasks.ctypes.data
    op[O_PML] = pml.ctypes.data
    op[O_PACC] = pacc.ctypes.data
    op[O_SINKS] = sinks.ctypes.data


@njit(**_JIT)
def _exact_prepare(op, sp, q, kc, vc, out, sinks, n_workers, fn, qrows, budget, min_keys, serial_work):
    """The default mode's whole setup in one compiled call (a decode step calls attend once per
    layer; separate Python and numba calls cost more than a short decode's attention): plan
    (_plan_exact), scratch buffers, addresses into ``op``; a small step (or one worker) runs
    right here on the calling thread. Returns (tasks, meta, scores, partial accumulators,
    items, bounds) for pool.run_arrays, items empty when the step already ran. The returned
    buffers must stay alive while the pool runs (op holds their addresses)."""
    group, nkv, window, dv, nt = op[O_GROUP], op[O_NKV], op[O_WINDOW], op[O_DV], 1 if n_workers <= 1 else n_workers
    tasks, meta, n_direct, work, sc_size, acc_rows = _plan_exact(sp, group, nkv, nt, window, qrows, budget, min_keys)
    n_tasks = tasks.shape[0]
    serial = n_workers <= 1 or (work < serial_work and n_direct == n_tasks)
    if serial and n_direct != n_tasks:  # (planned with splits: plan again without)
        tasks, meta, n_direct, work, sc_size, acc_rows = _plan_exact(sp, group, nkv, 1, window, qrows, budget, min_keys)
        n_tasks = tasks.shape[0]
    pacc = np.empty(max(1, acc_rows * dv), np.float32)
    sc = np.empty(max(1, sc_size), np.float32)
    meta1 = meta if meta.shape[0] else np.zeros((1, META_W), np.int64)
    _fill_addresses(op, q, kc, vc, out, tasks, pacc, pacc, sinks, sc, meta1)
    flat = tasks.reshape(-1)
    if serial:
        for ti in range(n_tasks):
            run_task_exact(op, flat, ti)
        return tasks, meta1, sc, pacc, np.zeros((0, _pool.ITEM_W), np.int64), np.zeros((0, 1, 2), np.int64)
    n_groups = meta.shape[0]
    n_parts = n_tasks - n_direct
    n_items = n_tasks + n_groups + n_parts + n_groups if n_groups else n_tasks
    items = np.zeros((n_items, _pool.ITEM_W), np.int64)
    for i in range(n_items):
        items[i, 0] = _pool.K_CALL
        items[i, 1] = fn
    if not n_groups:
        for i in range(n_tasks):
            items[i, 2] = 2
            items[i, 3] = i
        bounds = np.zeros((1, 1, 2), np.int64)
        bounds[0, 0, 1] = n_tasks
        return tasks, meta1, sc, pacc, items, bounds
    # phase 0: K parts, then whole tiles; 1: normalise; 2: V parts; 3: combine
    k = 0
    for i in range(n_direct, n_tasks):
        items[k, 2], items[k, 3] = 3, i
        k += 1
    for i in range(n_direct):
        items[k, 2], items[k, 3] = 2, i
        k += 1
    for i in range(n_groups):
        items[k, 2], items[k, 3] = 4, i
        k += 1
    for i in range(n_direct, n_tasks):
        items[k, 2], items[k, 3] = 5, i
        k += 1
    for i in range(n_groups):
        items[k, 2], items[k, 3] = 6, i
        k += 1
    bounds = np.zeros((4, 1, 2), np.int64)
    e0, e1, e2 = n_tasks, n_tasks + n_groups, n_tasks + n_groups + n_parts
    bounds[0, 0, 1] = e0
    bounds[1, 0, 0], bounds[1, 0, 1] = e0, e1
    bounds[2, 0, 0], bounds[2, 0, 1] = e1, e2
    bounds[3, 0, 0], bounds[3, 0, 1] = e2, n_items
    return tasks, meta1, sc, pacc, items, bounds


_NO_SINKS = np.zeros(1, np.float32)
_NO_PML = np.zeros(1, np.float64)
_NO_PACC = np.zeros(1, np.float32)
_NO_META = np.zeros((1, META_W), np.int64)


_CACHE_MAX = 64
_OPS: dict[tuple, np.ndarray] = {}
"""(shapes, formats, scale, window, sinks?) -> the op array's fields that depend on them alone,
checked once: a decode step calls attend once per layer with the same shapes, and the Python
checks and op filling cost about as much as a short decode's attention kernels. Cleared
when it holds _CACHE_MAX entries; entries are never modified (attend copies one)."""
_SPANS: dict[tuple, np.ndarray] = {}
"""tuple(spans) -> the int64 [S, 4] array (the layers of one step share their spans)."""


def _op_template(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, out: np.ndarray, scale: float, window: int,
                 has_sinks: bool) -> np.ndarray:
    """The op array for these shapes, formats and settings, O_NTOK and O_WIDE left to the
    call. Raises ValueError for caches of another dtype or shapes that do not agree."""
    key = (q.shape[1:], kc.shape, vc.shape, kc.dtype.char, vc.dtype.char, out.shape[1:], scale, window, has_sinks)
    op = _OPS.get(key)
    if op is not None:
        return op
    nh, d = q.shape[1], q.shape[2]
    kfmt, vfmt = cache_format(kc), cache_format(vc)
    nkv = kc.shape[2]
    dk, dvc = cache_head_dim(kc), cache_head_dim(vc)
    dv = out.shape[2]
    if (nkv == 0 or nh % nkv or dk != d or vc.shape[2] != nkv or dv > dvc or out.shape[1] != nh
            or vc.shape[:2] != kc.shape[:2]
            or (kfmt == FMT_Q8_0 and d % Q8_0_BLOCK) or (vfmt == FMT_Q8_0 and dv % Q8_0_BLOCK)):
        raise ValueError(f"attention: q {q.shape}, k cache {kc.shape}, v cache {vc.shape}, out {out.shape} do not agree")
    group = nh // nkv
    rmax = max(1, QUERY_ROWS // group) * group
    op = np.zeros(OP_LEN, np.int64)
    krow, vrow = kc.shape[3], vc.shape[3]
    op[O_NH:O_NTOK + 1] = (nh, d, nkv, dv, group, key_tile(d, dv),
                           kfmt, kc.shape[1] * nkv * krow, nkv * krow, krow,
                           vfmt, vc.shape[1] * nkv * vrow, nkv * vrow, vrow,
                           _f32_bits(scale), window, int(has_sinks), rmax, 0)
    if len(_OPS) >= _CACHE_MAX:
        _OPS.clear()
    _OPS[key] = op
    return op


def _spans_array(spans) -> np.ndarray:
    """spans as int64 [S, 4], from _SPANS when a list of tuples of ints was seen before (never
    modified: the kernels only read it)."""
    try:
        key = tuple(spans) if isinstance(spans, list) else None
        sp = _SPANS.get(key) if key is not None else None
    except TypeError:  # unhashable rows (lists): converted every time
        key = sp = None
    if sp is None:
        sp = np.asarray(spans, dtype=np.int64).reshape(-1, 4)
        if key is not None:
            if len(_SPANS) >= _CACHE_MAX:
                _SPANS.clear()
            _SPANS[key] = sp
    return sp


def attend(ops, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, spans, scale: float, out: np.ndarray, *,
           window: int = 0, sinks: np.ndarray | None = None, online: bool = False) -> None:
    """Causal attention of every span's new queries over its sequence's cache (already
    holding the new keys), written to ``out``.

    ops: the CPU kernel backend (moe_service.engine.ops.CpuOps, whose worker ``pool`` runs the
    tasks; None or an object without a pool: the calling thread runs them); q: float32
    [T, NH, D]; out: float32 [T, NH, Dv]; NH a multiple of NKV (query head h reads KV head
    h // (NH / NKV)); scale: float (usually 1/sqrt(D)); window: 0 for full causal attention,
    else the sliding window in tokens; sinks: float32 [NH] or None; online: the one-pass
    online softmax (flash attention; decode splits key ranges over the workers) instead of the
    default two-pass contract (module docstring). Caches in either format. Raises ValueError
    for inconsistent shapes or a span outside the cache (never reads outside the caches).
    """
    T = q.shape[0]
    op = _op_template(q, kc, vc, out, float(scale), int(window), sinks is not None).copy()
    if out.shape[0] != T:
        raise ValueError(f"attention: q {q.shape}, k cache {kc.shape}, v cache {vc.shape}, out {out.shape} do not agree")
    if sinks is not None and sinks.shape[0] != op[O_NH]:
        raise ValueError(f"attention: {sinks.shape[0]} sinks for {op[O_NH]} heads")
    sp = _spans_array(spans)
    i = _first_bad_span(sp, T, kc.shape[0], kc.shape[1])
    if i >= 0:
        raise ValueError(f"attention: span {tuple(int(x) for x in sp[i])} is outside q ({T} rows) or the cache "
                         f"{kc.shape}")
    if not (kc.flags.c_contiguous and vc.flags.c_contiguous):
        raise ValueError("attention: the caches must be C-contiguous")
    q32 = np.ascontiguousarray(q, dtype=np.float32)
    o32 = out if (out.dtype == np.float32 and out.flags.c_contiguous) else np.empty(out.shape, np.float32)
    s = np.ascontiguousarray(sinks, dtype=np.float32) if sinks is not None else _NO_SINKS
    pool: Any = getattr(ops, "pool", None)  # a WorkerPool, or None (one thread: every plan is serial)
    n_workers = pool.n_workers if pool is not None else 1
    op[O_NTOK] = T
    op[O_WIDE] = int(T == 1 or op[O_D] % 16 != 0)
    if not online:
        keep = _exact_prepare(op, sp, q32, kc, vc, o32, s, n_workers, item_address(), QUERY_ROWS, SCORE_BUDGET,
                              MIN_SPLIT_KEYS, SERIAL_WORK)
        if keep[4].shape[0]:
            pool.run_arrays(keep[4], keep[5], op)
    else:
        pl = _build(spans, int(op[O_NKV]), int(op[O_GROUP]), int(op[O_DV]), n_workers, int(op[O_WINDOW]),
                    int(op[O_RMAX]))
        _fill_addresses(op, q32, kc, vc, o32, pl.tasks, pl.pml, pl.pacc, s, _NO_PACC, _NO_META)
        if pl.serial:
            _run_serial(op, pl.tasks.reshape(-1), pl.n_tasks, pl.pml, pl.pacc, False)
        else:
            pool.run_arrays(pl.items, pl.bounds, op)
    if o32 is not out:
        out[...] = o32
