"""Per-head matmuls on 3-D GGUF weights read in place: the CPU kernel behind
``CpuPath.head_linear`` (deepseek2's MLA absorption, moe_service/engine/arch/deepseek2.py:
q_abs[h] = W_kb[h] q_nope[h] and o[h] = W_vb[h] o_lat[h]).

As ggml's mul_mat with a 3-D weight broadcast over heads: every (token, head) activation row
is quantized to the weight's partner format (Q8_0 for Q8_0 weights, float16 for F16, ...)
and dotted with head h's rows by the same format kernels as every other matmul
(quant.matmul_rows), so the results equal a 2-D matmul of head h's rows bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from moe_service.engine import quant
from moe_service.engine.quant import matmul_rows

_JIT = {"nogil": True, "cache": True, "fastmath": False, "error_model": "numpy"}


@njit(**_JIT)
def _head_matmul_kernel(arena, w_off, head_stride, ggml_type, n_cols, rb, n_rows, n_head, n_tok,
                        xf, xq, xd, xs, xbs, out, kernels):
    rows = np.empty(n_tok, np.int64)
    for h in range(n_head):
        for t in range(n_tok):
            rows[t] = t * n_head + h
        matmul_rows(arena, w_off + h * head_stride, ggml_type, n_cols, rb, 0, n_rows, xf, xq, xd, xs, xbs,
                    rows, rows, out, n_rows, 0, kernels)


def head_matmul(arena: np.ndarray, offset: int, ggml_type: int, n_head: int, n_rows: int, n_cols: int,
                x: np.ndarray, head_stride_bytes: int | None = None) -> np.ndarray:
    """Per-head matmul on a 3-D GGUF weight read in place (ggml_mul_mat broadcast over heads):
    out[t, h] = W[h] @ x[t, h].

    arena: uint8 [*]; W[h]: ``n_rows`` rows of ``n_cols`` ``ggml_type`` elements starting at
    byte ``offset + h * head_stride_bytes`` (default: heads back to back); x: float32
    [T, NH, n_cols] (each (t, h) row quantized to the weight's partner format, as ggml
    does). Returns float32 [T, NH, n_rows]. Single-threaded on the calling thread.
    Raises ValueError when a head's rows run past the arena or x has the wrong shape.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 3 or x.shape[1] != n_head or x.shape[2] != n_cols:
        raise ValueError(f"head_matmul: x of shape {x.shape} for {n_head} heads of {n_cols} columns")
    rb = quant.row_bytes(ggml_type, n_cols)
    stride = n_rows * rb if head_stride_bytes is None else int(head_stride_bytes)
    quant.check_tensor(arena, int(offset) + (n_head - 1) * stride, ggml_type, n_rows, n_cols)
    T = x.shape[0]
    pa = quant.quantize_activations(x.reshape(T * n_head, n_cols), quant.block_format(ggml_type).partner)
    out = np.empty(T * n_head * n_rows, np.float32)
    _head_matmul_kernel(arena, int(offset), stride, int(ggml_type), int(n_cols), rb, int(n_rows), int(n_head), T,
                        pa.xf, pa.xq, pa.xd, pa.xs, pa.xbs, out, quant.ensure_kernels([ggml_type]))
    return out.reshape(T, n_head, n_rows)
