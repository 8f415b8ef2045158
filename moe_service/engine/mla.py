"""Per-head matmuls on 3-D GGUF weights read in place: the CPU kernel behind
``CpuPath.head_linear`` (deepseek2's MLA absorption, moe_service/engine/arch/deepseek2.py:
q_abs[h] = W_kb[h] q_nope[h] and o[h] = W_vb[h] o_lat[h]).

As ggml's mul_mat with a 3-D weight broadcast over heads: every (token, head) activation row
is quantized to the weight's partner format (Q8_0 for Q8_0 weights, float16 for F16, ...)
and dotted with head h's rows by the same format kernels as every other matmul
(quant.matmul_rows), so the results equal a 2-D matmul of head h's rows bit for bit.

Layout: the activation rows are quantized head-major (row h * T + t holds token t of head h)
and the results written head-major ([NH, T, rows], returned as a [T, NH, rows] view), so one
head's T activation rows and T output rows are contiguous. Token-major, a head's rows sat
NH x row bytes apart: 64 KiB for V3's W_vb (128 heads x 512 Q8_K bytes), 16 KiB for its
W_kb (128 x 128 Q8_0 bytes), strides at which every row maps to the same L1/L2 cache sets.
Each pooled item quantizes its own heads' rows (no serial quantization pass on the caller).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit

from moe_service.engine import pool as _pool
from moe_service.engine import quant
from moe_service.engine.quant import matmul_rows, quantize_partner_row
from moe_service.engine.quant.ir import view_f32, view_i8, view_i16, view_i64, view_u8

_POOL_MIN_MACS = 1 << 20
"""Multiply-adds of the whole call (all heads) below which it runs on the calling thread. (It
was per head: a decode step's V3 W_kb / W_vb, 128 heads of 64 Ki MACs, ran on one thread,
~0.8 / ~0.5 ms per layer.)"""
_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def _quantize_heads(partner, x_addr, x_size, st_t, st_h, n_tok, n_cols, h_lo, h_hi, xf, xq, xd, xs, xbs):
    """Quantize the activation rows of heads h_lo..h_hi-1 head-major: x's row (t, h), float32
    at element ``t * st_t + h * st_h`` of the ``x_size`` elements at ``x_addr``, into partner
    row h * n_tok + t."""
    x = view_f32(x_addr, x_size)
    for h in range(h_lo, h_hi):
        for t in range(n_tok):
            quantize_partner_row(partner, x, t * st_t + h * st_h, n_cols, xf, xq, xd, xs, xbs, h * n_tok + t)


@njit(**_JIT)
def _head_matmul_kernel(arena, w_off, head_stride, ggml_type, n_cols, rb, n_rows, n_head, n_tok, partner, x_addr,
                        x_size, st_t, st_h, xf, xq, xd, xs, xbs, out, kernels):
    rows = np.arange(n_head * n_tok, dtype=np.int64)
    _quantize_heads(partner, x_addr, x_size, st_t, st_h, n_tok, n_cols, 0, n_head, xf, xq, xd, xs, xbs)
    for h in range(n_head):
        hr = rows[h * n_tok:(h + 1) * n_tok]
        matmul_rows(arena, w_off + h * head_stride, ggml_type, n_cols, rb, 0, n_rows, xf, xq, xd, xs, xbs,
                    hr, hr, out, n_rows, 0, kernels)


# The pooled form: one K_CALL item per range of heads (pool.CALL_ITEM_SIG); ``op`` holds the
# addresses and sizes below, ``rows`` int64 [NH * T] = arange: the (h * T + t) activation and
# output row of each (head, token); x's address, size (elements) and token / head strides.
(O_ARENA, O_WOFF, O_STRIDE, O_TYPE, O_NCOLS, O_RB, O_NROWS, O_NHEAD, O_NTOK, O_XF, O_XQ, O_XD, O_XS, O_XBS,
 O_OUT, O_KERNELS, O_ROWS, O_PARTNER, O_X, O_XSIZE, O_ST_T, O_ST_H, OP_LEN) = range(23)


def _item(items_ptr, i, op_ptr):
    """Heads [it[2], it[3]) of a pooled head_matmul (compiled as a cfunc, see item_address)."""
    it = carray(items_ptr, (i + 1) * _pool.ITEM_W)
    op = carray(op_ptr, OP_LEN)
    b = i * _pool.ITEM_W
    n_tok, n_head, n_rows, n_cols = op[O_NTOK], op[O_NHEAD], op[O_NROWS], op[O_NCOLS]
    big = n_tok * n_head * n_cols
    arena = view_u8(op[O_ARENA], 1)
    xf, xq = view_f32(op[O_XF], big), view_i8(op[O_XQ], big)
    xd, xs, xbs = view_f32(op[O_XD], big), view_f32(op[O_XS], big), view_i16(op[O_XBS], big)
    out = view_f32(op[O_OUT], n_tok * n_head * n_rows)
    kernels = view_i64(op[O_KERNELS], 64)
    _quantize_heads(op[O_PARTNER], op[O_X], op[O_XSIZE], op[O_ST_T], op[O_ST_H], n_tok, n_cols, it[b + 2], it[b + 3],
                    xf, xq, xd, xs, xbs)
    for h in range(it[b + 2], it[b + 3]):
        rows = view_i64(op[O_ROWS] + 8 * h * n_tok, n_tok)
        matmul_rows(arena, op[O_WOFF] + h * op[O_STRIDE], op[O_TYPE], n_cols, op[O_RB], 0, n_rows, xf, xq, xd, xs,
                    xbs, rows, rows, out, n_rows, 0, kernels)


def item_address() -> int:
    """Address of the compiled item function (pool.K_CALL), compiled or loaded once."""
    return _pool.call_item_address(_item)


def _source(x: np.ndarray, n_head: int, n_cols: int) -> tuple[np.ndarray, int, int, int, int]:
    """x float32 [T, NH, n_cols] as (the array to keep alive, its data address, size in elements
    from that address, token stride, head stride in elements): read in place when its rows
    are contiguous float32 (a column slice of q, the attention's output), else a copy."""
    if x.ndim != 3 or x.shape[1] != n_head or x.shape[2] != n_cols:
        raise ValueError(f"head_matmul: x of shape {x.shape} for {n_head} heads of {n_cols} columns")
    if not (x.dtype == np.float32 and x.strides[2] == 4 and x.strides[0] % 4 == 0 and x.strides[1] % 4 == 0
            and x.strides[0] >= 0 and x.strides[1] >= 0):
        x = np.ascontiguousarray(x, dtype=np.float32)
    st_t, st_h = x.strides[0] // 4, x.strides[1] // 4
    size = (x.shape[0] - 1) * st_t + (n_head - 1) * st_h + n_cols if x.shape[0] else 0
    return x, x.ctypes.data, size, st_t, st_h


def head_matmul(arena: np.ndarray, offset: int, ggml_type: int, n_head: int, n_rows: int, n_cols: int,
                x: np.ndarray, head_stride_bytes: int | None = None, pool: Any = None) -> np.ndarray:
    """Per-head matmul on a 3-D GGUF weight read in place (ggml_mul_mat broadcast over heads):
    out[t, h] = W[h] @ x[t, h].

    arena: uint8 [*]; W[h]: ``n_rows`` rows of ``n_cols`` ``ggml_type`` elements starting at
    byte ``offset + h * head_stride_bytes`` (default: heads back to back); x: float32
    [T, NH, n_cols] (each (t, h) row quantized to the weight's partner format, as ggml
    does; read in place when its rows are contiguous float32). Returns float32 [T, NH, n_rows]:
    a view of a head-major [NH, T, n_rows] buffer (module docstring). ``pool``: a WorkerPool to spread the heads over
    (a prefill step; the result is the same bit for bit), else the calling thread runs all.
    Raises ValueError when a head's rows run past the arena or x has the wrong shape.
    """
    x, x_addr, x_size, st_t, st_h = _source(x, n_head, n_cols)
    rb = quant.row_bytes(ggml_type, n_cols)
    stride = n_rows * rb if head_stride_bytes is None else int(head_stride_bytes)
    quant.check_tensor(arena, int(offset) + (n_head - 1) * stride, ggml_type, n_rows, n_cols)
    T = x.shape[0]
    partner = quant.block_format(ggml_type).partner
    pa = quant._alloc_partner(partner, T * n_head, n_cols)
    out = np.empty(n_head * T * n_rows, np.float32)  # head-major [NH, T, n_rows]
    kernels = quant.ensure_kernels([ggml_type])
    n_workers = pool.n_workers if pool is not None else 1
    if n_workers > 1 and n_head > 1 and n_head * T * n_rows * n_cols >= _POOL_MIN_MACS:
        rows = np.arange(n_head * T, dtype=np.int64)
        op = np.array([arena.ctypes.data, int(offset), stride, int(ggml_type), int(n_cols), rb, int(n_rows),
                       int(n_head), T, pa.xf.ctypes.data, pa.xq.ctypes.data, pa.xd.ctypes.data, pa.xs.ctypes.data,
                       pa.xbs.ctypes.data, out.ctypes.data, kernels.ctypes.data, rows.ctypes.data, int(partner),
                       x_addr, x_size, st_t, st_h], np.int64)
        step = max(1, -(-n_head // (4 * n_workers)))
        items = [(_pool.K_CALL, item_address(), h, min(n_head, h + step)) for h in range(0, n_head, step)]
        job = _pool.Job.build([_pool._spread(items, pool.n_nodes)], op)
        pool.run_arrays(job.items, job.bounds, job.op)
    elif T:
        _head_matmul_kernel(arena, int(offset), stride, int(ggml_type), int(n_cols), rb, int(n_rows), int(n_head), T,
                            int(partner), x_addr, x_size, st_t, st_h, pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, out, kernels)
    return out.reshape(n_head, T, n_rows).transpose(1, 0, 2)
